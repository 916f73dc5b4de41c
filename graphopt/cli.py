"""The `graphopt` command line (in-process)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from .errors import GraphoptError, InvalidModelError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'123', '200MB', '1.5GiB' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 500000000, 512MiB, 2GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def env_default(name: str, default):
    """$GRAPHOPT_<NAME> when set (argparse converts it with the option's type), else `default`."""
    return os.environ.get(f"GRAPHOPT_{name}") or default


def mib(n: int | float) -> str:
    return f"{n / 2**20:.1f} MiB"


class StageProgress:
    """Prints each pipeline stage with the time it started (long steps show progress)."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.started = time.perf_counter()

    def __call__(self, stage: str, fraction: float) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f}s {fraction:4.0%}] {stage}", file=self.stream, flush=True)


def _input_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-dims", action="append", default=[], metavar="NAME=D1,D2,...",
                        help="values of symbolic input dimensions, e.g. x=4,3,224,224 (repeatable)")
    parser.add_argument("--inputs", type=Path, help="inputs as .npz (default: synthesized)")
    parser.add_argument("--threads", type=int, default=None,
                        help="ONNX Runtime intra-op threads of the runs that time and measure (default: the "
                             "machine's cores; outputs are always verified at one thread)")


def _load_inputs(args, model):
    from .inputs import load_inputs, parse_input_dims, synthesize_inputs
    if args.inputs:
        return load_inputs(args.inputs)
    return synthesize_inputs(model, parse_input_dims(args.input_dims))


def _server_options(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument("--server", metavar="HOST:PORT", required=required,
                        help="run on a graphopt server (default: in this process)")
    parser.add_argument("--token-file", type=Path, help="bearer token for the server (or $GRAPHOPT_TOKEN)")
    parser.add_argument("--tls-ca", help="CA certificate to trust the server's TLS certificate")
    parser.add_argument("--deadline-seconds", type=float, help="give up (and stop the server's work) after this")


def option_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """The flags of `OptimizeOptions`' fields (graphopt/options.py: each field's flag, help and
    type) on `command`'s parser: optimize, analyze or batch. Each flag stores under its field's
    name; an absent flag stores None (the field's default applies)."""
    for spec in _flagged(command):
        kwargs = {"dest": spec.name, "default": None, "help": spec.help}
        if spec.kind == "bool":
            kwargs.update(action="store_const", const=not spec.default)
            if spec.negated:
                kwargs["help"] = f"do not {spec.help}"
        elif spec.kind in ("list[str]", "dict[str, list[int]]"):
            kwargs.update(action="append")
        elif spec.is_bytes:
            kwargs.update(type=parse_bytes, metavar=spec.metavar or "BYTES")
        elif spec.kind in _FLAG_TYPES:
            kwargs.update(type=_FLAG_TYPES[spec.kind])
        else:
            raise TypeError(f"option {spec.name}: type {spec.kind!r} has no flag form (known: bool, int, float, "
                            f"str, list[str]); give it flag=\"\" or another type")
        if spec.choices is not None:
            kwargs["choices"] = list(spec.choices())
        if spec.metavar and "metavar" not in kwargs and spec.kind != "bool":
            kwargs["metavar"] = spec.metavar
        parser.add_argument(spec.flag, **kwargs)


_FLAG_TYPES = {"int": int, "float": float, "str": str}


def _flagged(command: str):
    """The option specs with a flag on `command` (optimize, analyze or batch)."""
    from .options import option_specs
    return [spec for spec in option_specs() if spec.flag and not (command == "analyze" and not spec.analyze)
            and not (command == "batch" and not spec.batch)]


def option_values(args, command: str = "optimize") -> dict:
    """The `OptimizeOptions` fields the parsed flags of `command` set (see `option_flags`), in
    `to_dict`'s form."""
    from .inputs import parse_input_dims
    values = {}
    for spec in _flagged(command):
        value = getattr(args, spec.name, None)
        if value is None:
            continue
        values[spec.name] = parse_input_dims(value) if spec.kind == "dict[str, list[int]]" else value
    return values


def options_from_args(args, **extra):
    """The `OptimizeOptions` of parsed flags (each flag stores under its field's name; see
    `option_flags`); `extra` sets inputs and progress. Threads default to the machine's cores in
    this process, to one on a server (whose jobs run side by side)."""
    from .optimize import OptimizeOptions
    from .runtime.session import machine_cores
    values = option_values(args)
    if not values.get("threads"):
        values["threads"] = 1 if getattr(args, "server", None) else machine_cores()
    return OptimizeOptions.from_dict(values, **extra)


def _check_plot(args) -> None:
    if getattr(args, "plot", None) is None:
        return
    if args.plot.suffix.lower() not in (".png", ".svg"):
        raise GraphoptError(f"--plot {args.plot}: the file must end in .png or .svg")
    if getattr(args, "server", None) or getattr(args, "sweep", None) is not None:
        raise GraphoptError("--plot draws the timeline in-process, for one optimize: drop --server or --sweep, "
                            "or --plot")


def _plot(path: Path, timelines, model: Path) -> None:
    """`--plot FILE`: the predicted bytes alive over the original's schedule and the returned
    one's (graphopt.plot.plot_timeline), PNG or SVG by the file's suffix."""
    from .plot import plot_timeline
    original, returned = timelines
    plot_timeline(original, returned, path, title=f"Memory over one training step: {Path(model).name}")


def cmd_optimize(args) -> int:
    from .ingest import load_graph
    from .optimize import optimize, restate_own_memory
    from .report import summary_text
    from .runtime.weights import save_model
    _check_plot(args)
    if args.sweep is not None:
        return cmd_sweep(args)
    if args.server:
        from graphopt_service import commands
        if args.inputs:
            raise GraphoptError("--inputs is not sent to a server; give --input-dims (the server "
                                "synthesizes inputs) or run in-process")
        return commands.optimize(args, options_from_args(args), StageProgress())
    # the weights stay on disk: read by the children that run the model, written into the
    # returned model's file one tensor at a time (at any size: past 2 GB, as external data)
    model, weights = load_graph(args.model)
    options = options_from_args(args, inputs=_load_inputs(args, model), progress=StageProgress())
    with optimize(model, options, weights=weights) as result:
        del model, options
        save_model(result.model, args.output, result.weights)
    report = result.report
    if args.plot:
        _plot(args.plot, result.timelines, args.model)
    restate_own_memory(report)   # the writing counts as graphopt's own memory too
    if args.report:
        args.report.write_text(json.dumps(report.to_dict(), indent=2))
    print(summary_text(report))
    print(f"wrote {args.output}" + (f" and {args.report}" if args.report else "")
          + (f"; the timeline: {args.plot}" if args.plot else ""))
    return 0


def cmd_sweep(args) -> int:
    """`optimize --sweep N`: the least-peak model to OUT, and the front's table and plot beside it."""
    from .ingest import load_graph
    from .sweep import markdown_table, sweep, write_outputs
    if args.sweep < 1:
        raise GraphoptError("--sweep needs at least 1 point")
    if args.budget_bytes is not None:
        raise GraphoptError("--sweep chooses its own budgets; drop --budget")
    if args.measure is False:
        raise GraphoptError("--sweep measures every point; drop --no-measure")
    model, weights = load_graph(args.model)     # the weights stay on disk, as for optimize
    options = options_from_args(args, inputs=_load_inputs(args, model), progress=StageProgress())
    result = sweep(model, options, args.sweep, weights=weights)
    try:
        paths = write_outputs(result, args.output, title=f"Memory-time front: {Path(args.model).name}")
    finally:
        result.close()
    if args.report:
        args.report.write_text(json.dumps(result.report_dict(), indent=2))
    print(markdown_table(result.rows))
    for note in result.notes:
        print(f"note: {note}")
    print(f"wrote {args.output} (the least-peak plan), {paths['csv']}, {paths['md']}, {paths['png']}"
          + (f" and {args.report}" if args.report else ""))
    return 0


def cmd_measure(args) -> int:
    import tempfile

    from .ingest import load_model
    from .inputs import save_inputs
    from .optimize import ORIGINAL_UNOPTIMIZED
    from .runtime.measure import measure
    from .runtime.session import DEFAULT_SETTINGS, read_settings
    model = load_model(args.model, weights_on_disk=True)     # the graph; the run reads the weights from disk
    if not model.graph.output:
        raise InvalidModelError(f"{args.model}: the model has no outputs, so a step computes nothing to measure")
    settings = {"model": read_settings(model) or DEFAULT_SETTINGS, "default": DEFAULT_SETTINGS,
                "off": ORIGINAL_UNOPTIMIZED}[args.session]
    inputs = _load_inputs(args, model)
    with tempfile.TemporaryDirectory(prefix="graphopt-") as tmp:
        inputs_path = Path(tmp) / "inputs.npz"
        save_inputs(inputs_path, inputs)
        from .runtime.session import machine_cores
        m = measure(args.model, inputs_path, settings, threads=args.threads or machine_cores(), repeats=args.repeats)
    result = {"model": str(args.model), "peak_bytes": m.peak_bytes, "step_seconds": m.step_seconds,
              "provider": m.provider, "method": m.method, "session": settings.to_dict()}
    print(json.dumps(result, indent=2) if args.json else
          f"{args.model}: peak {mib(m.peak_bytes)} ({m.peak_bytes} bytes), step {m.step_seconds:.4f} s "
          f"on {m.provider} ({args.session} session)")
    return 0


def _optimizer_spec(args):
    """The --optimizer options as an OptimizerSpec (None without --optimizer)."""
    from .builder.optimizer import OptimizerSpec
    given = {k: getattr(args, k) for k in ("lr", "momentum", "weight_decay", "betas", "eps")
             if getattr(args, k) is not None}
    if args.optimizer is None:
        if given:
            raise GraphoptError(f"--{next(iter(given)).replace('_', '-')} needs --optimizer")
        return None
    if "lr" not in given:
        raise GraphoptError("--optimizer needs --lr")
    if args.optimizer == "sgd" and ("betas" in given or "eps" in given):
        raise GraphoptError("--betas and --eps are AdamW's: sgd takes --momentum and --weight-decay")
    if "betas" in given:
        try:
            betas = tuple(float(b) for b in given["betas"].split(","))
        except ValueError:
            raise GraphoptError(f"--betas takes two numbers B1,B2, got {given['betas']!r}") from None
        if len(betas) != 2:
            raise GraphoptError(f"--betas takes two numbers B1,B2, got {given['betas']!r}")
        given["betas"] = betas
    spec = OptimizerSpec(args.optimizer, **given)
    spec.check()
    return spec


def cmd_train_graph(args) -> int:
    from .builder.train_graph import build_training_graph
    from .ingest import load_graph
    from .runtime.weights import save_model
    optimizer = _optimizer_spec(args)
    # the weights stay where they are (read into the output one tensor at a time when it is
    # written): the builder works on the graph alone, at any size
    forward, weights = load_graph(args.model)
    build = dict(loss=args.loss, labels=args.labels, freeze=args.freeze or (), class_axis=args.class_axis,
                 optimizer=optimizer, weights=weights)
    from .builder import rules
    with rules.blocked_layout(rules.BLOCKED_CONVS and not args.plain_convs):
        if args.provider is None:
            train = build_training_graph(forward, **build)
        else:
            from .builder.forms import build_for_provider
            train = build_for_provider(forward, args.provider, args.threads, **build)
    save_model(train, args.output, weights)
    if args.provider is not None:
        from .builder.forms import FORMS_KEY
        forms = json.loads(next(p.value for p in train.metadata_props if p.key == FORMS_KEY))
        convs = forms["conv_weight_gradients"]
        per_tap = sum(1 for c in convs if c["per_tap"])
        changed = sum(1 for c in convs if c["per_tap"] != c["rule_per_tap"])
        print(f"Conv weight gradients measured on {args.provider}: {len(convs)} distinct, {per_tap} per tap, "
              f"{len(convs) - per_tap} whole map ({changed} other than the CPU's rule)")
    rest = [o.name for o in train.graph.output][1:]
    if optimizer is None:
        what = f"{len(rest)} gradients"
    else:
        what = f"{optimizer.kind} step inside, {len(rest)} updated inputs"
    print(f"wrote {args.output}: loss {train.graph.output[0].name!r}, {what}, {len(train.graph.node)} nodes")
    return 0


def cmd_train(args) -> int:
    from .ingest import load_graph
    from .inputs import load_inputs
    from .train import train, with_state
    from .runtime.weights import save_model
    data = load_inputs(args.data)
    providers = [args.provider] if args.provider else None
    result = train(str(args.model), data, args.steps, batch_size=args.batch_size, log=args.log,
                   providers=providers, threads=args.threads, progress=not args.quiet,
                   memory_limit_bytes=args.memory_limit)
    if result.losses:
        print(f"{result.steps} steps of batch {result.batch_size}: loss {result.losses[0]:.6g} -> "
              f"{result.losses[-1]:.6g}")
    if args.out:
        # the graph read alone, the trained state written into the new file, and the other weights
        # copied over from the model's folder, one tensor at a time (at any size)
        model, weights = load_graph(args.model)
        save_model(with_state(model, result.state, weights), args.out, weights)
        print(f"wrote {args.out}: the training graph with the trained parameters and state as its defaults")
    return 0


def cmd_analyze(args) -> int:
    _check_plot(args)
    if args.server:
        from graphopt_service import commands
        return commands.analyze(args, options_from_args(args))
    from .ingest import load_graph
    from .optimize import analyze_model
    model, weights = load_graph(args.model)
    options = options_from_args(args)
    analysis = analyze_model(model, options, plan=args.plan, weights=weights)
    print(json.dumps(analysis.to_dict(), indent=2))
    if args.plot:
        _plot(args.plot, analysis.timelines, args.model)
    if analysis.peaks_explained is not None:   # for the eye; the JSON above holds the same
        from .report import peak_lines
        print("\n".join(peak_lines(analysis.peaks_explained)), file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from graphopt_service import commands
    return commands.serve(args)


def cmd_health(args) -> int:
    from graphopt_service import commands
    return commands.health(args)


def cmd_batch(args) -> int:
    from tqdm import tqdm

    from .batch import LocalRunner, discover, run_batch
    from .batch_summary import write_summary
    options = batch_options_from_args(args)
    options.check()
    if args.server and args.ray:
        raise GraphoptError("--server and --ray each say where the models run: give one")
    if args.server:
        if args.sweep:
            raise GraphoptError("--sweep runs in-process only; drop --server or --sweep")
        from graphopt_service import commands
        runner = commands.remote_runner(args)
    elif args.ray:
        from .batch_ray import RayRunner
        runner = RayRunner(args.ray, cpus_per_job=args.ray_cpus_per_job, memory_bytes=args.ray_memory)
    else:
        runner = LocalRunner()
    args.output.mkdir(parents=True, exist_ok=True)
    jobs = discover(args.zoo, args.output, options)
    if not jobs:
        raise GraphoptError(f"no .onnx file under {args.zoo}")
    counts = {"ok": 0, "failed": 0, "skipped": 0}
    with tqdm(total=len(jobs), unit="model", desc="optimizing", file=sys.stderr) as bar:
        def progress(outcome):
            counts[outcome.status] += 1
            bar.set_postfix(counts, refresh=False)
            bar.update(1)
            if outcome.status == "failed":
                bar.write(f"failed: {outcome.name}: {outcome.error}", file=sys.stderr)
        outcomes = run_batch(jobs, runner, options, workers=args.jobs, progress=progress)
    paths = write_summary(args.output, [o.report for o in outcomes])
    print(f"{counts['ok']} optimized, {counts['skipped']} done before, {counts['failed']} failed; "
          f"summary: {paths['md']}")
    failed = [o.name for o in outcomes if o.status == "failed"]
    if failed:
        print(f"graphopt: error: {len(failed)} model(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def batch_options_from_args(args):
    """`graphopt batch`'s BatchOptions: its own flags (--loss is the loss of forward models'
    training graphs), and each model's OptimizeOptions from the option flags."""
    from .batch import BatchOptions
    from .options import OptimizeOptions
    return BatchOptions(loss=args.loss, budget_fraction=args.budget_fraction, sweep=args.sweep,
                        optimize=OptimizeOptions.from_dict(option_values(args, "batch")))


def cmd_strategies(args) -> int:
    if args.server:
        from graphopt_service import commands
        return commands.strategies(args)
    from .search import DEFAULT_STRATEGY, STRATEGIES
    for name, strategy in STRATEGIES.items():
        print(f"{name:16s}{' (default)' if name == DEFAULT_STRATEGY else '':10s} {strategy.description}")
    return 0


def cmd_example(args) -> int:
    import numpy as np

    from .examples import EXAMPLES, example_inputs, forward_example
    from .inputs import save_inputs
    from .optimize import save_model
    if args.name not in EXAMPLES:
        raise GraphoptError(f"unknown example {args.name!r} (known: {EXAMPLES})")
    if args.batches < 1:
        raise GraphoptError(f"--batches must be at least 1, got {args.batches}")
    forward = forward_example(args.name, small=args.small)
    batches = [example_inputs(forward, seed=k) for k in range(args.batches)]
    args.output.mkdir(parents=True, exist_ok=True)
    model_path, data_path = args.output / f"{args.name}.onnx", args.output / f"{args.name}.data.npz"
    save_model(forward, model_path)
    save_inputs(data_path, {k: np.concatenate([b[k] for b in batches]) for k in batches[0]})
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in batches[0].items())
    print(f"wrote {model_path} (forward model; its loss is the output 'loss') and {data_path} "
          f"({args.batches} batches of {shapes}, seeded)")
    return 0


def cmd_demo(args) -> int:
    from .examples import EXAMPLES, training_example
    from .optimize import OptimizeOptions, optimize, save_model
    from .report import summary_text
    if args.example not in EXAMPLES:
        raise GraphoptError(f"unknown example {args.example!r} (known: {EXAMPLES})")
    print(f"building the {args.example!r} example training graph ...", file=sys.stderr)
    model, inputs = training_example(args.example)
    result = optimize(model, OptimizeOptions(inputs=inputs, progress=StageProgress()))
    print(summary_text(result.report))
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        save_model(model, args.output / f"{args.example}_train.onnx")
        save_model(result.model, args.output / f"{args.example}_optimized.onnx")
        (args.output / f"{args.example}_report.json").write_text(json.dumps(result.report.to_dict(), indent=2))
        print(f"wrote {args.output}/")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .search import DEFAULT_STRATEGY, STRATEGIES
    parser = argparse.ArgumentParser(prog="graphopt", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("optimize", help="plan checkpoints, rewrite with recomputation, verify, measure")
    p.add_argument("model", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    option_flags(p, "optimize")
    p.add_argument("--report", type=Path, help="write the JSON report here")
    p.add_argument("--sweep", type=int, nargs="?", const=8, default=None, metavar="N",
                   help="measure the memory-time front: N budgets (default 8) from the least peak to "
                        "store-all's; writes OUT (least peak) and <OUT stem>.sweep.csv/.md/.png")
    p.add_argument("--inputs", type=Path, help="inputs as .npz (default: synthesized from --input-dims)")
    p.add_argument("--plot", type=Path, metavar="FILE",
                   help="draw the predicted bytes alive over the step, by kind, the original's and the returned "
                        "model's on the same axes (.png or .svg; in-process only)")
    _server_options(p)
    p.set_defaults(func=cmd_optimize)

    p = sub.add_parser("analyze", help="annotate in ONNX Runtime and predict peaks; no rewrite (JSON)")
    p.add_argument("model", type=Path)
    p.add_argument("--plan", action="store_true", help="also run the search and predict its peak")
    p.add_argument("--plot", type=Path, metavar="FILE",
                   help="draw the predicted bytes alive over the step, by kind (with --plan, the plan's too; "
                        ".png or .svg; in-process only)")
    option_flags(p, "analyze")
    _server_options(p)
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("measure", help="peak memory and step time of one run in ONNX Runtime")
    p.add_argument("model", type=Path)
    p.add_argument("--session", choices=["model", "default", "off"], default="model",
                   help="model: the settings in its metadata (else defaults); default: a plain session; "
                        "off: graph optimizations disabled")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    _input_options(p)
    p.set_defaults(func=cmd_measure)

    p = sub.add_parser("train-graph", help="turn a forward model into a training graph (loss, gradients)")
    p.add_argument("model", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--loss", metavar="KIND",
                   help="cross_entropy (class indices), mse, or output:NAME (the model computes its loss); "
                        "default: the output named loss, else the first output, taken as the loss")
    p.add_argument("--labels", default="labels", help="name of the label input the loss adds (default labels)")
    p.add_argument("--class-axis", type=int, help="cross_entropy: the class axis (default 1 for rank 2, else last)")
    p.add_argument("--freeze", nargs="*", help="initializers that are not trained")
    from .builder.optimizer import OPTIMIZERS
    p.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="put the optimizer step in the graph: inputs the parameters and optimizer state, "
                        "outputs loss then <input>_updated (torch.optim.SGD / AdamW semantics)")
    p.add_argument("--lr", type=float, help="learning rate (required with --optimizer)")
    p.add_argument("--momentum", type=float, help="sgd: momentum (default 0)")
    p.add_argument("--weight-decay", type=float, help="default 0 for sgd, 0.01 for adamw (decoupled)")
    p.add_argument("--betas", metavar="B1,B2", help="adamw: the moments' decay rates (default 0.9,0.999)")
    p.add_argument("--eps", type=float, help="adamw: added to the denominator (default 1e-8)")
    p.add_argument("--provider", metavar="NAME",
                   help="build for this ONNX Runtime execution provider: where a gradient has more than one "
                        "form (a Conv's weight gradient per kernel tap or over the whole map), the faster there, "
                        "measured (default: the forms measured on the CPU)")
    p.add_argument("--threads", type=int, default=1, help="with --provider: intra-op threads of the runs that "
                                                          "time the forms (default 1)")
    p.add_argument("--plain-convs", action="store_true",
                   help="write every Conv in the standard layout, for a graph that runs on other machines and "
                        "providers (default on the CPU: Convs larger than 1x1 in ONNX Runtime's blocked layout "
                        "for this machine, which runs its fastest kernels in every session)")
    p.set_defaults(func=cmd_train_graph)

    p = sub.add_parser("train", help="train a graph made by train-graph --optimizer on ONNX Runtime")
    p.add_argument("model", type=Path)
    p.add_argument("--data", type=Path, required=True,
                   help=".npz with arrays named like the graph's data inputs, first axis the samples")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch-size", type=int, help="samples per step (default: the graph's batch dimension)")
    p.add_argument("--log", type=Path, help="CSV of step,loss")
    p.add_argument("--out", type=Path, help="write the graph with the trained parameters and state as defaults")
    p.add_argument("--provider", help="ONNX Runtime execution provider (default: CUDA when present, else CPU)")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: ONNX Runtime's, one per "
                                               "physical core)")
    p.add_argument("--memory-limit", type=parse_bytes, metavar="BYTES",
                   help="what the training may hold at once on its device (e.g. 1GiB): ONNX Runtime's arena is "
                        "capped at it less the weights, state and batch; a step that needs more fails")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("batch", help="optimize every .onnx under a folder (resumable; a summary and plots)")
    p.add_argument("zoo", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--jobs", type=int, default=2, help="models optimized at once (default 2)")
    p.add_argument("--server", metavar="H:P[,H:P...]",
                   help="optimize on these servers (client-side round robin; one name may be a DNS name "
                        "resolving to many, e.g. a headless Service); default: worker processes here")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="each model a task on a Ray cluster: 'auto' (the cluster this machine is in), 'local' "
                        "(start one here) or its address; pip install 'graphopt[ray]'")
    p.add_argument("--ray-cpus-per-job", type=int, default=1, metavar="N",
                   help="CPUs each model's task declares to Ray (and the optimize's threads; default 1)")
    p.add_argument("--ray-memory", type=parse_bytes, metavar="BYTES",
                   help="memory each model's task declares to Ray (it runs only on a node with that much free)")
    p.add_argument("--budget-fraction", type=float, help="budget = this fraction of each model's predicted peak")
    p.add_argument("--loss", default="cross_entropy", metavar="KIND",
                   help="loss for forward models (cross_entropy, mse, output:NAME); training graphs go straight in")
    option_flags(p, "batch")   # each model's options (see optimize)
    p.add_argument("--sweep", type=int, metavar="N", help="each model's memory-time front too (in-process)")
    p.add_argument("--token-file", type=Path)
    p.add_argument("--tls-ca")
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("strategies", help="list the checkpoint-search strategies")
    _server_options(p)
    p.set_defaults(func=cmd_strategies)

    p = sub.add_parser("serve", help="run the gRPC service (health, reflection, worker processes)")
    p.add_argument("--host", default=env_default("HOST", "127.0.0.1"),
                   help="address to listen on ($GRAPHOPT_HOST, default 127.0.0.1: this machine only; "
                        "'[::]' or 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=env_default("PORT", 50051),
                   help="port ($GRAPHOPT_PORT, default 50051; 0 picks a free one)")
    p.add_argument("--workers", type=int, default=env_default("WORKERS", 2),
                   help="worker processes doing the optimization ($GRAPHOPT_WORKERS)")
    p.add_argument("--queue", type=int, default=env_default("QUEUE", 8),
                   help="calls that may wait for a worker; more are refused ($GRAPHOPT_QUEUE)")
    p.add_argument("--max-model-bytes", type=parse_bytes, default=env_default("MAX_MODEL_BYTES", 4 << 30),
                   help="limit on a model's files in all ($GRAPHOPT_MAX_MODEL_BYTES)")
    p.add_argument("--max-message-bytes", type=parse_bytes, default=env_default("MAX_MESSAGE_BYTES", 16 << 20),
                   help="limit on one gRPC message ($GRAPHOPT_MAX_MESSAGE_BYTES)")
    p.add_argument("--work-dir", default=env_default("WORK_DIR", None),
                   help="where per-call folders go ($GRAPHOPT_WORK_DIR; default: the temp dir)")
    p.add_argument("--token-file", type=Path, help="require this bearer token (or $GRAPHOPT_TOKEN)")
    p.add_argument("--tls-cert", default=env_default("TLS_CERT", None), help="TLS certificate (PEM; $GRAPHOPT_TLS_CERT)")
    p.add_argument("--tls-key", default=env_default("TLS_KEY", None), help="TLS private key (PEM; $GRAPHOPT_TLS_KEY)")
    p.add_argument("--drain-seconds", type=float, default=env_default("DRAIN_SECONDS", 25.0),
                   help="on SIGTERM, how long calls in flight may finish ($GRAPHOPT_DRAIN_SECONDS, default 25)")
    p.add_argument("--idle-timeout", type=float, default=env_default("IDLE_TIMEOUT", 60.0), metavar="SECONDS",
                   help="end a call whose client neither sends nor reads for this long, uploads and unread "
                        "responses alike ($GRAPHOPT_IDLE_TIMEOUT, default 60)")
    p.add_argument("--job-timeout", type=float, default=env_default("JOB_TIMEOUT", 1800.0), metavar="SECONDS",
                   help="limit on one call's work on a worker (and on its upload), whatever the client's "
                        "deadline: DEADLINE_EXCEEDED and the worker replaced ($GRAPHOPT_JOB_TIMEOUT, default 1800)")
    p.add_argument("--job-memory", type=parse_bytes, default=env_default("JOB_MEMORY", None), metavar="BYTES",
                   help="limit on the memory of a worker and its measuring processes during a job, e.g. 4GiB: "
                        "over it the job ends RESOURCE_EXHAUSTED ($GRAPHOPT_JOB_MEMORY, default 80%% of the "
                        "machine's or container's memory divided by the workers)")
    p.add_argument("--max-files", type=int, default=env_default("MAX_FILES", 4096), metavar="N",
                   help="limit on the files of one upload, the model and its external data "
                        "($GRAPHOPT_MAX_FILES, default 4096)")
    p.add_argument("--uploads-per-address", type=int, default=env_default("UPLOADS_PER_ADDRESS", None), metavar="N",
                   help="limit on the uploads in progress from one client address; more are refused "
                        "RESOURCE_EXHAUSTED ($GRAPHOPT_UPLOADS_PER_ADDRESS, default none: behind a proxy or a NAT "
                        "every client has one address)")
    p.add_argument("--min-upload-rate", type=parse_bytes, default=env_default("MIN_UPLOAD_RATE", 16 << 10),
                   metavar="BYTES",
                   help="least bytes a second an upload must bring over each --upload-rate-window, else DEADLINE_EXCEEDED: a "
                        "client that trickles does not hold a slot until --job-timeout "
                        "($GRAPHOPT_MIN_UPLOAD_RATE, default 16KiB; 0: none)")
    p.add_argument("--upload-rate-window", type=float, default=env_default("UPLOAD_RATE_WINDOW", 30.0),
                   metavar="SECONDS", help="the window over which --min-upload-rate is measured "
                                           "($GRAPHOPT_UPLOAD_RATE_WINDOW, default 30)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("health", help="ask a server's grpc.health.v1 service; exit 0 when SERVING")
    p.add_argument("--server", default=f"127.0.0.1:{env_default('PORT', 50051)}", metavar="HOST:PORT",
                   help="default 127.0.0.1:$GRAPHOPT_PORT")
    p.add_argument("--service", default="", help="service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--token-file", type=Path)
    p.add_argument("--tls-ca")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("example", help="write a bundled example's forward model and seeded batches of data")
    p.add_argument("name", help="mlp, resnet, densenet, unet, transformer or randwire")
    p.add_argument("-o", "--output", type=Path, required=True, help="folder for NAME.onnx and NAME.data.npz")
    p.add_argument("--batches", type=int, default=4, help="batches of data (default 4)")
    p.add_argument("--small", action="store_true", help="the small variant (seconds, not minutes)")
    p.set_defaults(func=cmd_example)

    p = sub.add_parser("demo", help="build a bundled example, optimize it, print the measured saving")
    p.add_argument("--example", default="mlp")
    p.add_argument("-o", "--output", type=Path, help="folder for the models and the report")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    from google.protobuf.message import EncodeError
    try:
        try:
            return args.func(args)
        except EncodeError as exc:     # a model serialized whole past 2 GB: what to do, not a traceback
            from .runtime.weights import past_limit_error
            raise past_limit_error(exc, f"graphopt {args.command}") from exc
    except GraphoptError as exc:
        print(f"graphopt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
