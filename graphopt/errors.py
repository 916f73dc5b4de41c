"""Typed errors of graphopt. Every error a caller can provoke is one of these."""


class GraphoptError(Exception):
    """Base class of every error graphopt raises on purpose."""


class InvalidModelError(GraphoptError):
    """The model is malformed or is not a training graph (the message names the problem)."""


class UnsupportedOpError(GraphoptError):
    """An operator graphopt cannot handle (unknown domain, no gradient rule, ...)."""


class BudgetInfeasibleError(GraphoptError):
    """No plan fits under the requested memory budget."""

    def __init__(self, message: str, least_feasible_peak_bytes: int | None = None):
        super().__init__(message)
        self.least_feasible_peak_bytes = least_feasible_peak_bytes


class MemoryLimitError(BudgetInfeasibleError):
    """The training step does not fit in the memory limit (`memory_limit_bytes`): ONNX Runtime
    refused an allocation under the cap, or no plan found fits it."""


class VerificationError(GraphoptError):
    """The rewritten model does not reproduce the original's outputs."""


class LimitExceededError(GraphoptError):
    """An input is over a configured size limit."""


class InvalidOptionError(GraphoptError):
    """An option is unknown or out of range (unknown strategy, unavailable execution provider, ...)."""
