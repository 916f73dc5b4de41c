"""`OptimizeOptions`: the one options type of `optimize`, the sweep and analysis.

The CLI's flags, the worker protocol's JSON (`to_dict`/`from_dict`) and the proto's
`OptimizeOptions` message use these field names; `check` rejects bad values before any work.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

import numpy as np

from .errors import InvalidOptionError
from .search import DEFAULT_STRATEGY, STRATEGIES

Progress = Callable[[str, float], None]

# fields that do not travel as JSON: the inputs' arrays (a file instead) and the callback
NOT_JSON = ("inputs", "progress")


@dataclass
class OptimizeOptions:
    loss: str | None = None                 # the loss output's name (None: the first output)
    budget_bytes: int | None = None         # peak-memory budget (None: the least peak)
    strategy: str = DEFAULT_STRATEGY
    input_dims: dict[str, list[int]] = field(default_factory=dict)   # shapes of symbolic inputs
    inputs: dict[str, np.ndarray] | None = None   # None: synthesized from the shapes
    providers: list[str] | None = None      # ONNX Runtime execution providers (None: CPU)
    verify: bool = True                     # compare outputs and check the order
    measure: bool = True                    # measure peaks in fresh processes
    threads: int = 1                        # ONNX Runtime intra-op threads
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
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise InvalidOptionError(f"budget must be positive, got {self.budget_bytes} bytes")
        if self.threads < 1:
            raise InvalidOptionError(f"threads must be at least 1, got {self.threads}")
        if not self.tolerance >= 0:
            raise InvalidOptionError(f"tolerance must be at least 0, got {self.tolerance}")

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
