"""The step time of graphopt's BUILT training graph under ONNX Runtime's default session, next to
PyTorch eager's for the same model, parameters and inputs (issue 25, item 1), and where ONNX
Runtime's step goes by operator type.

    python benchmarks/step_vs_eager.py [--examples mlp,resnet] [--corpus resnet50,mobilenet_v2]
        [--size full] [--exporter legacy|dynamo] [--threads 1|all|N] [--rounds 7]

For each bundled example (graphopt/examples.py) and its torch twin (zoo/torch_twins.py,
the same parameters and inputs, the same loss):

* the training graph as graphopt builds it, and built again with every Conv gradient as it was
  before (graphopt.builder.rules.PER_TAP_WEIGHT_GRADIENTS off: weight gradients as whole-map
  convolutions, input gradients as ONNX Runtime's ConvTranspose);
* and built once more with the axes of extent 1 kept that the builder drops where they cut ONNX
  Runtime's spans (graphopt/builder/unit_axes.py, issue 48: the "unit axes kept" column);
* and once more with every Conv in the standard layout instead of ONNX Runtime's blocked one
  (graphopt/builder/blocked_convs.py, issue 48: the "plain convs" column, as `train-graph
  --plain-convs` builds it);
* each in a plain onnxruntime.InferenceSession (its defaults: all graph optimizations, the
  arena), and the twin's eager step (forward, loss, backward; every .grad None before it);
* timed in one process, in turn, `--rounds` rounds of one step each after a warm-up step, each
  step after `SETTLE_SECONDS` idle (the previous step's threads spin on meanwhile); the
  medians, and the medians of each round's ratios over eager's step;
* (examples) the worst relative difference of each built graph's gradients from torch's (max |a - b| over
  max |b|, per parameter, floored at 1e-3 x the largest gradient), so that a faster formulation
  that is wrong shows; (corpus, zoo/real_zoo.py's architectures and their eager step) against
  torch float64, beside torch float32's own difference from it (real_zoo.gradient_check);
* one profiled step of the built graph: the share of its kernel time per operator type (top 4).

One thread by default (torch.set_num_threads, ORT's intra-op threads); `--threads all` uses
every core. `--parameters-as-inputs`: the examples' parameters are graph inputs fed every step, as
in training, where ONNX Runtime cannot treat them as constants (see `_parameters_as_inputs`).

`--provider CUDAExecutionProvider` (issue 25, item 6): ONNX Runtime's CUDA provider against
torch eager on the GPU. The inputs live on the device and the outputs stay there (IOBinding);
each step ends when the device has finished (ORT's run synchronizes, torch.cuda.synchronize).
TF32 is off on both sides (ORT's `use_tf32` 0; torch's cuDNN and matmul flags), so that both
compute in float32. The examples' gradients are compared against the twin's in float64 on the CPU
(the `against` column), for ORT's graphs and torch eager on the GPU alike.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

EXAMPLES = ("mlp", "resnet", "densenet", "unet", "transformer", "randwire")


PROVIDER = "CPUExecutionProvider"


def _cuda() -> bool:
    return PROVIDER == "CUDAExecutionProvider"


def _session(model, threads: int, profile_prefix: str | None = None):
    import onnxruntime as ort
    ort.set_default_logger_severity(3)   # no warning per initializer that is also an input
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    providers = ([("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"] if _cuda()
                 else ["CPUExecutionProvider"])
    session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    if session.get_providers()[0] != PROVIDER:
        raise RuntimeError(f"{PROVIDER} not used: the session has {session.get_providers()}")
    return session


def _stepper(session, feeds: dict):
    """One step of `session` (a callable). On CUDA the inputs are copied to the device once and the
    outputs stay there: what a training loop on the GPU does."""
    import onnxruntime as ort
    known = {i.name for i in session.get_inputs()}
    fed = {k: v for k, v in feeds.items() if k in known}
    if not _cuda():
        return lambda: session.run(None, fed)
    binding = session.io_binding()
    on_device = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in fed.items()}
    for k, v in on_device.items():
        binding.bind_ortvalue_input(k, v)
    names = [o.name for o in session.get_outputs()]

    def step():
        binding.clear_binding_outputs()
        for name in names:
            binding.bind_output(name, "cuda", 0)
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
    return step


def _torch_device():
    import torch
    if not _cuda():
        return torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda")


def _synchronize():
    if _cuda():
        import torch
        torch.cuda.synchronize()


PARAMETERS_AS_INPUTS = False


@contextlib.contextmanager
def _unit_axes(dropped: bool):
    """Within it, the builder drops the axes of extent 1 that cut ONNX Runtime's spans, or keeps
    them (graphopt/builder/unit_axes.py; `train_graph.UNIT_AXES_DROPPED`)."""
    from graphopt.builder import train_graph
    saved, train_graph.UNIT_AXES_DROPPED = train_graph.UNIT_AXES_DROPPED, dropped
    try:
        yield
    finally:
        train_graph.UNIT_AXES_DROPPED = saved


def _built(forward, per_tap: bool, forms_for: str | None = None, threads: int = 1, unit_axes_dropped: bool = True,
           blocked: bool = True):
    from graphopt.builder import rules
    from graphopt.builder.train_graph import build_training_graph
    saved = rules.PER_TAP_WEIGHT_GRADIENTS
    rules.PER_TAP_WEIGHT_GRADIENTS = per_tap
    # fed parameters are built as `train-graph --optimizer` builds them (rules.FED_WEIGHTS)
    fed = [t.name for t in forward.graph.initializer] if PARAMETERS_AS_INPUTS else []
    try:
        # the blocked convolutions are CPU kernels (graphopt/builder/blocked_convs.py)
        with rules.weights_fed(fed), _unit_axes(unit_axes_dropped), \
                rules.blocked_layout(blocked and rules.BLOCKED_CONVS and not _cuda()):
            if forms_for is None:
                model = build_training_graph(forward)
            else:
                from graphopt.builder.forms import build_for_provider
                model = build_for_provider(forward, forms_for, threads)
    finally:
        rules.PER_TAP_WEIGHT_GRADIENTS = saved
    return _parameters_as_inputs(model) if PARAMETERS_AS_INPUTS else model


def _parameters_as_inputs(model):
    """`model` with every parameter (a float initializer whose gradient it outputs) also a graph
    input, its value the default: as a training loop runs it, feeding new values every step.
    ONNX Runtime then treats the parameters as values, not constants: no constant folding of
    expressions of them, and its NCHWc layout (level ALL) leaves their Convs alone, since it
    needs constant weights to reorder."""
    import onnx
    graded = {o.name[:-len("_grad")] for o in model.graph.output if o.name.endswith("_grad")}
    have = {i.name for i in model.graph.input}
    for t in model.graph.initializer:
        if t.name in graded and t.name not in have:
            model.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return model


def _op_type_shares(model, feeds, threads: int) -> list[tuple[str, float]]:
    from graphopt.runtime.profile import profile_events
    with tempfile.TemporaryDirectory() as tmp:
        session = _session(model, threads, os.path.join(tmp, "p"))
        step = _stepper(session, feeds)
        step()
        step()
        runs, kernels = profile_events(session.end_profiling())
    last = max(runs, key=lambda e: e["ts"])
    per_type: dict[str, float] = {}
    for e in kernels:
        if last["ts"] <= e["ts"] <= last["ts"] + last.get("dur", 0):
            kind = e.get("args", {}).get("op_name", "?")
            per_type[kind] = per_type.get(kind, 0.0) + float(e.get("dur", 0))
    total = sum(per_type.values()) or 1.0
    return sorted(((k, v / total) for k, v in per_type.items()), key=lambda kv: -kv[1])


# Idle seconds before each timed step. A step's thread pool keeps spinning for work once the step
# has returned (ONNX Runtime's intra-op threads, torch's OpenMP threads: the libgomp torch bundles),
# and the next contender's step ran beside it. Measured by hand on the resnet example at two threads
# (medians of 7; benchmarks/step_vs_eager.py's own sessions and eager step): ONNX Runtime's step
# took 143.6 ms right after eager's, 135.7 ms 0.1 s later, 126.3 ms 0.2 s later and 73.8-78.1 ms
# 0.25-0.6 s later (76.1 ms after its own step, 0.1 s apart); eager's step 109.5 ms right after ONNX
# Runtime's, 80.1 ms 0.1 s later and 64.8-66.6 ms 0.25-0.6 s later. Until issue 48 this pause was
# 0.1 s, which charged the step timed right after eager's (the graph as built) with torch's
# spinning threads at two threads. With one thread neither has a pool; the pause costs only time.
SETTLE_SECONDS = 0.3


def _timed(models: dict, feeds: dict, eager, threads: int, rounds: int) -> tuple[dict, dict]:
    """Median seconds of a step of each model's default session and of `eager`, in turn, each
    after `SETTLE_SECONDS` idle; and the median over the rounds of each one's step over eager's in
    the same round. The machine's speed drifts over seconds (at two threads here, a step of the
    densenet example took 72-77 ms for four steps and 115-143 ms for the next five), and the steps
    of one round are timed within a second or two: the ratios of a round are less disturbed by
    it than the ratio of the medians."""
    steps = {}
    for label, model in models.items():
        steps[label] = _stepper(_session(model, threads), feeds)
    steps["eager"] = eager
    for step in steps.values():   # warm-up
        step()
    seconds: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(rounds):
        for label, step in steps.items():
            time.sleep(SETTLE_SECONDS)
            started = time.perf_counter()
            step()
            seconds[label].append(time.perf_counter() - started)
    return ({label: statistics.median(v) for label, v in seconds.items()},
            {label: statistics.median(a / b for a, b in zip(v, seconds["eager"])) for label, v in seconds.items()})


def _worst_difference(outputs: dict, expected: dict, floor: float) -> float:
    """max over parameters of max |a - b| / max |b| (the denominator floored at `floor`)."""
    import numpy as np
    return max((float(np.abs(np.asarray(outputs[p], dtype=np.float64) - g).max()) / max(float(np.abs(g).max()), floor))
               for p, g in expected.items() if p in outputs)


def run_example(name: str, threads: int, rounds: int, batch_scale: int = 1) -> dict:
    import copy

    import numpy as np
    import torch
    from memory_limit import scaled_batch
    from graphopt_zoo.torch_twins import torch_inputs, twin_example
    torch.set_num_threads(threads)
    module, forward, inputs = twin_example(name, **scaled_batch(name, batch_scale))
    models = {"per_tap": _built(forward, True), "whole_map": _built(forward, False),
              # as built before the axes of extent 1 were dropped (issue 48)
              "unit_axes_kept": _built(forward, True, unit_axes_dropped=False),
              # every Conv in the standard layout (graphopt/builder/blocked_convs.py, issue 48)
              "plain_convs": _built(forward, True, blocked=False),
              # each Conv weight gradient's form measured on the provider (`train-graph --provider`)
              "measured": _built(forward, True, forms_for=PROVIDER, threads=threads)}
    if PARAMETERS_AS_INPUTS:   # fed every step, as a training loop feeds them
        from onnx import numpy_helper
        fed = {i.name for i in models["per_tap"].graph.input}
        inputs = dict(inputs, **{t.name: numpy_helper.to_array(t) for t in models["per_tap"].graph.initializer
                                 if t.name in fed and t.name not in inputs})
    # the oracle: the twin in float64 on the CPU (before the float32 one moves to the device)
    exact = copy.deepcopy(module).to(torch.float64)
    exact_args = [a.double() if a.is_floating_point() else a for a in torch_inputs(exact, inputs)]
    exact(*exact_args).backward()
    expected = {f"{pname}_grad": p.grad.detach().numpy()
                for pname, p in exact.onnx_parameters().items() if p.grad is not None}
    device = _torch_device()
    module.to(device)
    args = [a.to(device) for a in torch_inputs(module, inputs)]
    parameters = list(module.parameters())

    def eager():
        for p in parameters:
            p.grad = None
        module(*args).backward()
        _synchronize()

    median, ratios = _timed(models, inputs, eager, threads, rounds)
    eager()
    # a gradient that is zero in exact arithmetic (the attention keys' bias) is rounding noise on
    # both sides: its denominator is floored at 1e-3 x the model's largest gradient
    floor = 1e-3 * max(float(np.abs(g).max()) for g in expected.values())
    worst = {"eager": _worst_difference({f"{pname}_grad": p.grad.detach().cpu().numpy()
                                         for pname, p in module.onnx_parameters().items() if p.grad is not None},
                                        expected, floor)}
    for label, model in models.items():
        session = _session(model, threads)
        known = {i.name for i in session.get_inputs()}
        names = [o.name for o in session.get_outputs()]
        worst[label] = _worst_difference(
            dict(zip(names, session.run(None, {k: v for k, v in inputs.items() if k in known}))), expected, floor)
    # on CUDA ORT's profile times each node's launch, not its kernel: no shares there
    shares = [] if _cuda() else _op_type_shares(models["per_tap"], inputs, threads)
    label = name if batch_scale == 1 else f"{name} (batch x{batch_scale})"
    return {"model": label, "seconds": median, "ratios": ratios, "worst_gradient_difference": worst,
            "against": f"torch float64 on the CPU; torch eager {worst['eager']:.1e}", "shares": shares[:4]}


def run_corpus(name: str, size: str, exporter: str, threads: int, rounds: int) -> dict:
    """A real architecture of zoo/real_zoo.py: its gradients against torch float64
    (real_zoo.gradient_check; `floor` is torch float32's own difference from float64)."""
    import torch
    from graphopt_zoo import real_zoo
    from graphopt.builder.train_graph import build_training_graph
    torch.set_num_threads(threads)
    model = real_zoo.CORPUS[name](size)
    forward = real_zoo.export(model, exporter)
    from graphopt.builder import rules
    models = {}
    for label, per_tap, dropped, blocked in (("per_tap", True, True, True), ("whole_map", False, True, True),
                                             ("unit_axes_kept", True, False, True), ("plain_convs", True, True, False)):
        saved, rules.PER_TAP_WEIGHT_GRADIENTS = rules.PER_TAP_WEIGHT_GRADIENTS, per_tap
        try:
            with _unit_axes(dropped), rules.blocked_layout(blocked and rules.BLOCKED_CONVS):
                models[label] = build_training_graph(forward, loss="cross_entropy", class_axis=model.class_axis)
        finally:
            rules.PER_TAP_WEIGHT_GRADIENTS = saved
    feeds = real_zoo.model_feeds(model)
    module = real_zoo._train_mode(model.module)
    args = list(model.inputs.values())
    axis_of = model.class_axis

    def eager():
        module.zero_grad(set_to_none=True)
        out = module(*args)
        axis = axis_of if axis_of is not None else (1 if out.dim() == 2 else out.dim() - 1)
        torch.nn.functional.cross_entropy(out.movedim(axis, 1), model.labels).backward()

    median, ratios = _timed(models, feeds, eager, threads, rounds)
    worst, floor = {}, 0.0
    for label, train in models.items():
        check = real_zoo.gradient_check(model, forward, train, threads=threads, sensitivity_samples=0)
        worst[label] = check["grad_error_fp64"]
        floor = check["torch_fp32_vs_fp64"]
    shares = _op_type_shares(models["per_tap"], feeds, threads)
    return {"model": f"{name} ({exporter})", "seconds": median, "ratios": ratios, "worst_gradient_difference": worst,
            "against": f"torch float64 (torch float32: {floor:.1e})", "shares": shares[:4]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--corpus", default="", help="real architectures of zoo/real_zoo.py, e.g. resnet50,mobilenet_v2")
    parser.add_argument("--size", default="full", choices=("tiny", "full", "large"))
    parser.add_argument("--exporter", default="legacy", choices=("legacy", "dynamo"))
    parser.add_argument("--threads", default="1", help="1, N, or all (every core)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--provider", default="CPUExecutionProvider",
                        choices=("CPUExecutionProvider", "CUDAExecutionProvider"))
    parser.add_argument("--parameters-as-inputs", action="store_true",
                        help="the examples' parameters as graph inputs, as a training loop feeds them (ONNX Runtime "
                             "then neither folds nor reorders them: no NCHWc Conv)")
    parser.add_argument("--batch-scale", type=int, default=1, metavar="K",
                        help="the examples at K times their bundled batch (e.g. a GPU-sized step)")
    args = parser.parse_args()
    global PROVIDER, PARAMETERS_AS_INPUTS
    PROVIDER = args.provider
    PARAMETERS_AS_INPUTS = args.parameters_as_inputs
    if PARAMETERS_AS_INPUTS and args.corpus:
        parser.error("--parameters-as-inputs applies to the examples only")
    if _cuda() and args.corpus:
        parser.error("--corpus runs on the CPU provider only (its gradient check is real_zoo's, on the CPU)")
    threads = os.cpu_count() or 1 if args.threads == "all" else int(args.threads)
    print(f"{PROVIDER}, threads: {threads}; medians of {args.rounds} steps each, in turn, each after {SETTLE_SECONDS} s idle, in one "
          "process; the ratios: medians of the rounds' ratios"
          + ("; parameters as graph inputs" if PARAMETERS_AS_INPUTS else ""))
    print("| model | built, per-tap weight grads (s) | built, whole-map (s) | torch eager (s) | per-tap / eager | "
          "whole-map / eager | forms measured on the provider / eager | unit axes kept / eager | plain convs / eager | "
          "worst gradient difference: per-tap, whole-map, unit axes kept, plain convs (against) | "
          "where ORT's step goes (per-tap) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    jobs = [(run_example, (n, threads, args.rounds, args.batch_scale)) for n in args.examples.split(",") if n]
    jobs += [(run_corpus, (n, args.size, args.exporter, threads, args.rounds)) for n in args.corpus.split(",") if n]
    for run, job in jobs:
        r = run(*job)
        s, q = r["seconds"], r["ratios"]
        shares = ", ".join(f"{kind} {share:.0%}" for kind, share in r["shares"])
        print(f"| {r['model']} | {s['per_tap']:.3f} | {s['whole_map']:.3f} | {s['eager']:.3f} | "
              f"{q['per_tap']:.2f}x | {q['whole_map']:.2f}x | "
              + (f"{q['measured']:.2f}x | " if "measured" in q else "| ")
              + f"{q['unit_axes_kept']:.2f}x | {q['plain_convs']:.2f}x | "
              + f"{r['worst_gradient_difference']['per_tap']:.1e}, {r['worst_gradient_difference']['whole_map']:.1e}, "
              f"{r['worst_gradient_difference']['unit_axes_kept']:.1e}, {r['worst_gradient_difference']['plain_convs']:.1e} "
              f"({r['against']}) | {shares} |", flush=True)


if __name__ == "__main__":
    main()
