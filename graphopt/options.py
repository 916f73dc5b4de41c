"""`OptimizeOptions`: the one options type of `optimize`, the sweep and analysis, and the one
schema of every form an option takes.

Each field carries its schema in its `option(...)` metadata (read through `option_specs`): its
help, its CLI flag, its proto field number and type. From it come the CLI's flags
(graphopt/cli.py), the worker protocol's JSON (`to_dict`/`from_dict`), the proto's
`OptimizeOptions` message (generated: `python -m graphopt_service.gen_proto`), the server's and
the Python client's mappings (service/options.py) and the Node client's (from the proto's
descriptor). `check` rejects bad values before any work.

A new option: one field below with its `option(help=..., proto=<the next free number>)`, then
`python -m graphopt_service.gen_proto` (tests/test_options_schema.py fails until it is run).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Callable

import numpy as np

from .errors import GraphoptError, InvalidOptionError
from .runtime.offline import DEFAULT_GRAPH_OPTIMIZATIONS, GRAPH_OPTIMIZATION_LEVELS
from .search import DEFAULT_STRATEGY, STRATEGIES

Progress = Callable[[str, float], None]

# Objectives without a budget (with one: the least step time whose measured peak fits it).
BOUNDED_OVERHEAD = "bounded-overhead"   # the least peak within (1 + max_overhead) x the original's step time
LEAST_PEAK = "least-peak"               # the least peak, whatever it costs in time
OBJECTIVES = (BOUNDED_OVERHEAD, LEAST_PEAK)
# The default objective's overhead: see README "Choices" (the fronts of the examples and the
# corpus: what a 0.1-0.5 overhead buys).
DEFAULT_MAX_OVERHEAD = 0.25

# Where node seconds come from (`OptimizeOptions.node_times`; graphopt/runtime/replay.py).
NODE_TIMES = ("auto", "profile", "replay")
# Providers whose profile times each node's kernel (the rest time only its launch on the host).
PROFILE_TIMES_KERNELS = ("CPUExecutionProvider",)

# fields that do not travel as JSON: the inputs' arrays (a file instead) and the callback
NOT_JSON = ("inputs", "progress")


def option(default=MISSING, *, help: str, proto: int | None = None, flag: str | None = None,
           default_factory=MISSING, **metadata):
    """A field of `OptimizeOptions` with its schema: `help` (the CLI's help, the proto's comment:
    the field's documentation), `proto` (its field number in graphopt.v1.OptimizeOptions; None:
    it does not travel), `flag` (the CLI's flag; default: `flag_name`'s), and, optional:
    `proto_type` (instead of the one of its Python type, e.g. "int32"), `proto_presence` (False:
    a plain proto3 scalar whose zero value means the default, as the first fields were
    declared), `choices` (a callable giving the accepted values), `metavar`, `analyze` (False:
    no flag on `graphopt analyze`), `batch` (False: no flag on `graphopt batch`, where the
    option is per model)."""
    metadata = {"help": help, "proto": proto, "flag": flag, **metadata}
    return field(default=default, default_factory=default_factory, metadata=metadata)


@dataclass
class OptimizeOptions:
    """The options of `optimize`, the sweep and analysis. Each field's `option(...)` metadata is
    its schema: the CLI's flags, the proto's field (proto/graphopt/v1/graphopt.proto, generated
    by `python -m graphopt_service.gen_proto`), the worker's JSON and both clients' mappings are
    derived from it. A new option is one field here."""
    loss: str | None = option(None, proto=7, proto_presence=False, batch=False, metavar="NAME",
                              help="name of the loss output (default: the first output)")
    budget_bytes: int | None = option(None, proto=1, batch=False, metavar="BYTES",
                                      help="peak-memory budget (bytes, or e.g. 512MiB): the least step time "
                                           "whose measured peak fits (default: see the objective)")
    memory_limit_bytes: int | None = option(
        None, proto=18, analyze=False, metavar="BYTES",
        help="what the training session may hold at once on its device (weights, state, the step; e.g. "
             "1GiB), enforced by ONNX Runtime in the runs that check the returned model; without a "
             "budget, the least step time that runs within it (default: no limit)")
    objective: str = option(BOUNDED_OVERHEAD, proto=15, choices=lambda: OBJECTIVES,
                            help="without a budget: bounded-overhead (default: the least peak whose step "
                                 "time is at most (1 + max overhead) x the original's under ONNX Runtime's "
                                 "default session) or least-peak (whatever it costs in time)")
    max_overhead: float | None = option(
        None, proto=16, metavar="F",
        help=f"step time at most (1 + F) x the original's under ONNX Runtime's default session, "
             f"measured (default {DEFAULT_MAX_OVERHEAD} for bounded-overhead without a budget; with a "
             f"budget, no limit unless given)")
    strategy: str = option(DEFAULT_STRATEGY, proto=2, proto_presence=False, choices=lambda: sorted(STRATEGIES),
                           help=f"the checkpoint search strategy (default {DEFAULT_STRATEGY})")
    input_dims: dict[str, list[int]] = option(
        proto=3, default_factory=dict, batch=False, metavar="NAME=D1,D2,...",
        help="values of symbolic input dimensions, e.g. x=4,3,224,224 (repeatable)")
    inputs: dict[str, np.ndarray] | None = option(
        None, flag="", help="the inputs' arrays (default: synthesized from the shapes); not sent to a server")
    providers: list[str] | None = option(None, proto=11, flag="--provider", analyze=False, metavar="NAME",
                                         help="ONNX Runtime execution provider (default: CPU)")
    verify: bool = option(True, proto=12, analyze=False,
                          help="compare the outputs with the original's and check the order (default on; "
                               "off is not recommended)")
    measure: bool = option(True, proto=13, analyze=False,
                           help="measure the peaks in fresh processes (default on)")
    threads: int = option(1, proto=8, proto_type="int32", proto_presence=False, batch=False, metavar="N",
                          help="ONNX Runtime intra-op threads of the runs that time and measure (default: "
                               "the machine's cores in this process, 1 on a server; outputs are always "
                               "verified at one thread)")
    graph_optimizations: str = option(
        DEFAULT_GRAPH_OPTIMIZATIONS, proto=17, choices=lambda: list(GRAPH_OPTIMIZATION_LEVELS),
        help=f"ONNX Runtime's graph optimizations applied offline before planning, so the plan keeps "
             f"their fused kernels (default {DEFAULT_GRAPH_OPTIMIZATIONS}; extended only on the CPU "
             f"provider, basic elsewhere; none: plan the file as given)")
    node_times: str = option(
        "auto", proto=19, choices=lambda: list(NODE_TIMES),
        help="where the seconds of each node the plan is built on come from: profile (ONNX Runtime's "
             "profiler), replay (each distinct node run alone on the device, inputs bound there) or auto "
             "(default: the profile on the CPU provider, whose profile times the kernels; replay on any "
             "other, whose profile times the launches)")
    tolerance: float = option(1e-5, proto=14, analyze=False, metavar="REL",
                              help="relative output difference accepted (default 1e-5): per output, max |a - b| "
                                   "over its largest value, or over a hundredth of the largest value of its kind "
                                   "(gradients, updated parameters, each optimizer state) where that is larger")
    progress: Progress | None = option(None, flag="", help="called with each stage and the fraction done")

    def check(self) -> None:
        """Reject unknown strategies, unavailable providers and bad numbers before any work."""
        import onnxruntime as ort
        if self.strategy not in STRATEGIES:
            raise InvalidOptionError(f"unknown strategy {self.strategy!r} (known: {sorted(STRATEGIES)})")
        refuse = getattr(STRATEGIES[self.strategy], "check", None)   # the registry's: what it supports
        if refuse is not None:
            refuse(self.budget_bytes)
        available = ort.get_available_providers()
        for provider in self.providers or []:
            if provider not in available:
                raise InvalidOptionError(f"execution provider {provider!r} is not available here "
                                         f"(available: {available})")
        if self.objective not in OBJECTIVES:
            raise InvalidOptionError(f"unknown objective {self.objective!r} (known: {list(OBJECTIVES)})")
        if self.max_overhead is not None:
            if not self.max_overhead >= 0 or self.max_overhead == float("inf"):
                raise InvalidOptionError(f"max overhead must be a finite fraction >= 0 (0.1: 10% slower "
                                         f"at most), got {self.max_overhead}")
            if self.objective == LEAST_PEAK:
                raise InvalidOptionError("objective least-peak takes no max overhead: drop one of them")
            if not STRATEGIES[self.strategy].takes_budget:
                raise InvalidOptionError(f"strategy {self.strategy!r} plans only its own least peak: it cannot "
                                         f"bound the step time (max overhead {self.max_overhead})")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise InvalidOptionError(f"budget must be positive, got {self.budget_bytes} bytes")
        if self.memory_limit_bytes is not None:
            if self.memory_limit_bytes <= 0:
                raise InvalidOptionError(f"memory limit must be positive, got {self.memory_limit_bytes} bytes")
            if self.provider not in (None, "CPUExecutionProvider", "CUDAExecutionProvider"):
                raise InvalidOptionError(f"a memory limit is enforced on the CPU and CUDA providers only, "
                                         f"not {self.provider}")
            if not self.measure:
                raise InvalidOptionError("a memory limit is shown by runs under it: it needs measurement on")
        if self.graph_optimizations not in GRAPH_OPTIMIZATION_LEVELS:
            raise InvalidOptionError(f"unknown graph optimizations {self.graph_optimizations!r} "
                                     f"(known: {list(GRAPH_OPTIMIZATION_LEVELS)})")
        if self.node_times not in NODE_TIMES:
            raise InvalidOptionError(f"unknown node times {self.node_times!r} (known: {list(NODE_TIMES)})")
        if self.threads < 1:
            raise InvalidOptionError(f"threads must be at least 1, got {self.threads}")
        if not self.tolerance >= 0:
            raise InvalidOptionError(f"tolerance must be at least 0, got {self.tolerance}")

    @property
    def overhead_limit(self) -> float | None:
        """The step-time overhead the plan must stay within (None: no limit): `max_overhead`,
        or DEFAULT_MAX_OVERHEAD under the default objective with no budget and a strategy that
        takes budgets (one that plans only its least peak has nothing to trade)."""
        if self.max_overhead is not None:
            return float(self.max_overhead)
        if (self.objective == BOUNDED_OVERHEAD and self.budget_bytes is None and self.memory_limit_bytes is None
                and STRATEGIES[self.strategy].takes_budget):
            return DEFAULT_MAX_OVERHEAD
        return None

    @property
    def plans_for_limit(self) -> bool:
        """Whether the plan is the least step time that runs within the memory limit (a limit,
        no budget, no step-time limit, the default objective, a strategy that takes budgets)."""
        return (self.memory_limit_bytes is not None and self.budget_bytes is None and self.max_overhead is None
                and self.objective == BOUNDED_OVERHEAD and STRATEGIES[self.strategy].takes_budget)

    @property
    def effective_objective(self) -> str:
        """What the plan optimizes: "least-time-under-budget", "least-time-within-memory-limit",
        "bounded-overhead" or "least-peak"."""
        if self.budget_bytes is not None:
            return "least-time-under-budget"
        if self.plans_for_limit:
            return "least-time-within-memory-limit"
        return BOUNDED_OVERHEAD if self.overhead_limit is not None else LEAST_PEAK

    @property
    def provider(self) -> str | None:
        """The first execution provider asked for (None: CPU)."""
        return self.providers[0] if self.providers else None

    @property
    def replays_node_times(self) -> bool:
        """Whether node seconds come from replaying the nodes (`node_times`; auto: where the
        provider's profile does not time its kernels)."""
        if self.node_times != "auto":
            return self.node_times == "replay"
        return (self.provider or "CPUExecutionProvider") not in PROFILE_TIMES_KERNELS

    def to_dict(self) -> dict:
        """JSON-ready: every field but the inputs' arrays and the progress callback."""
        return {f.name: _copy(getattr(self, f.name)) for f in fields(self) if f.name not in NOT_JSON}

    @classmethod
    def from_dict(cls, data: dict, **extra) -> "OptimizeOptions":
        """From `to_dict`'s form (absent fields take their defaults); `extra` sets the rest
        (inputs, progress). An unknown field is an InvalidOptionError."""
        names = {f.name for f in fields(cls)} - set(NOT_JSON)
        unknown = set(data) - names
        if unknown:
            raise InvalidOptionError(f"unknown option(s) {sorted(unknown)} (known: {sorted(names)})")
        values = dict(data)
        if "input_dims" in values:
            values["input_dims"] = {str(k): [int(d) for d in v] for k, v in (values["input_dims"] or {}).items()}
        return cls(**values, **extra)


def _copy(value):
    if isinstance(value, dict):
        return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in value.items()}
    if isinstance(value, list):
        return list(value)
    return value


# The Python types an option may have (without "| None") and the proto type of each.
PROTO_TYPES = {"int": "int64", "float": "double", "str": "string", "bool": "bool",
               "list[str]": "repeated string", "dict[str, list[int]]": "repeated InputDims"}


@dataclass(frozen=True)
class OptionSpec:
    """One option's schema, from its field's metadata (see `option`)."""
    name: str
    kind: str                   # the Python type without "| None": a key of PROTO_TYPES, or another
    default: object             # the default value (a fresh one for default factories)
    help: str
    proto: int | None           # field number in graphopt.v1.OptimizeOptions; None: does not travel
    proto_type: str | None      # e.g. "int64", "repeated string"
    proto_presence: bool        # `optional` in the proto: set and unset differ
    flag: str                   # the CLI's flag; "": none
    choices: Callable[[], object] | None
    metavar: str | None
    analyze: bool               # a flag of `graphopt analyze` too
    batch: bool                 # a flag of `graphopt batch` too

    @property
    def is_bytes(self) -> bool:
        """An integer count of bytes: its flags read 512MiB, 2GB, ..."""
        return self.kind == "int" and self.name.endswith("_bytes")

    @property
    def negated(self) -> bool:
        """A flag that turns a default-on option off (--no-verify)."""
        return self.kind == "bool" and self.default is True


def _kind(annotation) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None) or repr(annotation)
    text = text.replace("typing.", "").replace(" ", "")
    for none in ("|None", "None|"):
        text = text.replace(none, "")
    if text.startswith("Optional[") and text.endswith("]"):
        text = text[len("Optional["):-1]
    return text.replace(",", ", ")


def flag_name(name: str, kind: str, default) -> str:
    """The CLI flag of an option by convention (the Node CLI uses the same): --budget for
    budget_bytes (a count of bytes: 512MiB), --no-verify for a bool that is on by default,
    --input-dims for input_dims."""
    stem = name[:-len("_bytes")] if kind == "int" and name.endswith("_bytes") else name
    stem = stem.replace("_", "-")
    return f"--no-{stem}" if kind == "bool" and default is True else f"--{stem}"


def option_specs(cls=None) -> list[OptionSpec]:
    """The schema of every field of `cls` (default OptimizeOptions), in field order. A field
    without `option(...)` metadata, or whose type has no proto form, is an error naming it."""
    cls = cls or OptimizeOptions
    specs = []
    for f in fields(cls):
        meta = f.metadata
        if "help" not in meta or not str(meta["help"]).strip():
            raise TypeError(f"{cls.__name__}.{f.name} has no help: declare it with option(..., help=...)")
        kind = _kind(f.type)
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        proto_type = None
        if meta.get("proto") is not None:
            proto_type = meta.get("proto_type") or PROTO_TYPES.get(kind)
            if proto_type is None:
                raise TypeError(f"{cls.__name__}.{f.name}: type {kind!r} has no proto form (known: "
                                f"{sorted(PROTO_TYPES)}); give proto=None or another type")
        flag = meta.get("flag")
        if flag is None:
            flag = flag_name(f.name, kind, default)
        specs.append(OptionSpec(name=f.name, kind=kind, default=default, help=" ".join(str(meta["help"]).split()),
                                proto=meta.get("proto"), proto_type=proto_type,
                                proto_presence=meta.get("proto_presence", True), flag=flag,
                                choices=meta.get("choices"), metavar=meta.get("metavar"),
                                analyze=meta.get("analyze", True), batch=meta.get("batch", True)))
    return specs


def option_args(options) -> list[str]:
    """The flags that give `options` (the inverse of `cli.option_values`): each flagged field that
    differs from its default, as --flag=VALUE (a value may start with '-')."""
    argv = []
    for spec in option_specs(type(options)):
        value = getattr(options, spec.name)
        if not spec.flag or value is None or value == spec.default:
            continue
        if spec.kind == "bool":
            if value != (not spec.default):
                raise GraphoptError(f"option {spec.name}={value!r} has no flag ({spec.flag} sets {not spec.default})")
            argv.append(spec.flag)
        elif spec.kind == "dict[str, list[int]]":
            argv += [f"{spec.flag}={name}={','.join(str(int(d)) for d in dims)}" for name, dims in value.items()]
        elif spec.kind == "list[str]":
            argv += [f"{spec.flag}={item}" for item in value]
        elif spec.kind == "float":
            argv.append(f"{spec.flag}={float(value)!r}")
        else:
            argv.append(f"{spec.flag}={value}")
    return argv
