"""`OptimizeOptions`: the one options type of `optimize`, the sweep and analysis.

The CLI's flags, the worker protocol's JSON (`to_dict`/`from_dict`) and the proto's
`OptimizeOptions` message use these field names; `check` rejects bad values before any work.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

import numpy as np

from .errors import InvalidOptionError
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

# fields that do not travel as JSON: the inputs' arrays (a file instead) and the callback
NOT_JSON = ("inputs", "progress")


@dataclass
class OptimizeOptions:
    loss: str | None = None                 # the loss output's name (None: the first output)
    budget_bytes: int | None = None         # peak-memory budget (None: see `objective`)
    # what the training session may hold at once on its device (weights, state, the step),
    # enforced by ONNX Runtime in the runs that check the returned model (runtime/limit.py);
    # without a budget the plan is the least step time that runs within it
    memory_limit_bytes: int | None = None
    objective: str = BOUNDED_OVERHEAD       # without a budget: see OBJECTIVES
    # the step time allowed, as a fraction above the original's under ONNX Runtime's default
    # session (None: DEFAULT_MAX_OVERHEAD for bounded-overhead; with a budget, no limit)
    max_overhead: float | None = None
    strategy: str = DEFAULT_STRATEGY
    input_dims: dict[str, list[int]] = field(default_factory=dict)   # shapes of symbolic inputs
    inputs: dict[str, np.ndarray] | None = None   # None: synthesized from the shapes
    providers: list[str] | None = None      # ONNX Runtime execution providers (None: CPU)
    verify: bool = True                     # compare outputs and check the order
    measure: bool = True                    # measure peaks in fresh processes
    threads: int = 1                        # ONNX Runtime intra-op threads
    # ORT's graph optimizations applied offline before planning (runtime/offline.py): the plan
    # keeps their fused kernels; "none" plans the file as given
    graph_optimizations: str = DEFAULT_GRAPH_OPTIMIZATIONS
    tolerance: float = 1e-5                 # relative output difference accepted
    progress: Progress | None = None

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
