"""Every error a call can meet, mapped to one gRPC status code, here and nowhere else."""
from __future__ import annotations

import grpc

from graphopt import errors

from .transfer import ProtocolError


class QueueFullError(Exception):
    """Every worker is busy and the waiting queue is full."""


class ShuttingDownError(Exception):
    """The server is draining and takes no new work."""


class CallCancelledError(Exception):
    """The client cancelled the call or its deadline passed; the work was stopped."""


class WorkerFailedError(Exception):
    """A worker process died, or failed in a way the library does not type."""


class JobTimeoutError(Exception):
    """A job ran past the server's time limit per job (--job-timeout); its worker was replaced."""


class JobMemoryError(Exception):
    """A job's processes used more memory than the server's limit per job (--job-memory)."""


class UploadTooSlowError(Exception):
    """An upload brought fewer bytes a second than the server's minimum (--min-upload-rate)."""


class IdleTimeoutError(Exception):
    """The client neither sent nor read for longer than the server's idle timeout."""


# First match wins: subclasses before their bases.
STATUS_BY_ERROR: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (ProtocolError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.InvalidModelError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.InvalidOptionError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (JobMemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (JobTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (IdleTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (UploadTooSlowError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.UnsupportedOpError, grpc.StatusCode.UNIMPLEMENTED),
    (errors.BudgetInfeasibleError, grpc.StatusCode.FAILED_PRECONDITION),
    (ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (CallCancelledError, grpc.StatusCode.CANCELLED),
    (errors.VerificationError, grpc.StatusCode.INTERNAL),
    (WorkerFailedError, grpc.StatusCode.INTERNAL),
]

# Library errors that cross the worker-process boundary by class name.
LIBRARY_ERRORS = {cls.__name__: cls for cls in (
    errors.GraphoptError, errors.InvalidModelError, errors.InvalidOptionError, errors.LimitExceededError,
    errors.UnsupportedOpError, errors.BudgetInfeasibleError, errors.MemoryLimitError, errors.VerificationError)}


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a call ends with for `error` (INTERNAL when unexpected)."""
    for cls, code in STATUS_BY_ERROR:
        if isinstance(error, cls):
            return code, str(error)
    if isinstance(error, errors.GraphoptError):
        return grpc.StatusCode.INTERNAL, str(error)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__}): {error}"


def trailing_metadata_for(error: BaseException) -> tuple[tuple[str, str], ...]:
    """Machine-readable details that go with some statuses."""
    if isinstance(error, errors.BudgetInfeasibleError) and error.least_feasible_peak_bytes is not None:
        return (("graphopt-least-feasible-peak-bytes", str(error.least_feasible_peak_bytes)),)
    return ()


def error_from_worker(payload: dict) -> BaseException:
    """Rebuild the exception a worker reported ({"error": class name, "message": ...})."""
    cls = LIBRARY_ERRORS.get(payload.get("error", ""))
    message = payload.get("message", "")
    if cls is not None and issubclass(cls, errors.BudgetInfeasibleError):
        error = cls(message, payload.get("least_feasible_peak_bytes"))
    elif cls is not None:
        error = cls(message)
    else:
        error = WorkerFailedError(f"the worker failed ({payload.get('error')}): {message}")
    error.worker_traceback = payload.get("traceback")
    return error
