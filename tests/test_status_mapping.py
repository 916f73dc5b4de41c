"""The service's error -> gRPC status mapping (service/status.py), without a server: every error
a call can meet gets the status code gRPC's own definitions give it, and a library error raised in
a worker process comes back to the server as the same class with the same details. (Through a
real server, tests/test_service.py and tests/test_service_attacks.py see most of these codes
reach a client; this file holds the whole table, and is what mutation testing runs.)"""
from __future__ import annotations

import json

import grpc
import pytest

from graphopt import errors
from graphopt_service import status
from graphopt_service.transfer import ProtocolError
from graphopt_service.worker import error_message

# The contract, from gRPC's status code definitions (grpc.github.io/grpc/core/md_doc_statuscodes):
# bad input is INVALID_ARGUMENT; a size, memory or capacity limit RESOURCE_EXHAUSTED; a time limit
# DEADLINE_EXCEEDED; what graphopt cannot do UNIMPLEMENTED; a budget no plan meets (the system
# is not in the state the call needs: the model does not fit) FAILED_PRECONDITION; a server
# going down UNAVAILABLE; a call the client ended CANCELLED; a broken result or a crash INTERNAL.
EXPECTED = {
    ProtocolError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidModelError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidOptionError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.LimitExceededError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    status.QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    status.JobMemoryError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    status.JobTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    status.IdleTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    status.UploadTooSlowError: grpc.StatusCode.DEADLINE_EXCEEDED,   # a client that trickles
    errors.UnsupportedOpError: grpc.StatusCode.UNIMPLEMENTED,
    errors.BudgetInfeasibleError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.MemoryLimitError: grpc.StatusCode.FAILED_PRECONDITION,   # a budget that is a memory cap
    status.ShuttingDownError: grpc.StatusCode.UNAVAILABLE,
    status.CallCancelledError: grpc.StatusCode.CANCELLED,
    errors.VerificationError: grpc.StatusCode.INTERNAL,
    status.WorkerFailedError: grpc.StatusCode.INTERNAL,
    errors.GraphoptError: grpc.StatusCode.INTERNAL,                 # a library error of no known kind
}
PEAK_KEY = "graphopt-least-feasible-peak-bytes"


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_each_error_gets_its_status_and_its_own_message(cls):
    message = f"what went wrong in {cls.__name__}"
    assert status.status_for(cls(message)) == (EXPECTED[cls], message)


def test_every_error_class_of_the_library_and_the_service_is_in_the_contract():
    """A new error type must be given its status on purpose (here and in status.py)."""
    library = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, Exception)}
    service = {c for c in vars(status).values()
               if isinstance(c, type) and issubclass(c, Exception) and c.__module__ == status.__name__}
    assert library | service | {ProtocolError} == set(EXPECTED)


@pytest.mark.parametrize("error", [KeyError("shape"), ZeroDivisionError("division by zero"), RuntimeError()],
                         ids=lambda e: type(e).__name__)
def test_an_unexpected_error_is_internal_and_named(error):
    code, message = status.status_for(error)
    assert code == grpc.StatusCode.INTERNAL
    assert message == f"internal error ({type(error).__name__}): {error}"


@pytest.mark.parametrize("cls", [errors.BudgetInfeasibleError, errors.MemoryLimitError])
def test_the_least_feasible_peak_goes_with_an_infeasible_budget(cls):
    assert status.trailing_metadata_for(cls("no plan fits", 123_456_789)) == ((PEAK_KEY, "123456789"),)
    assert status.trailing_metadata_for(cls("no plan fits", 0)) == ((PEAK_KEY, "0"),)
    assert status.trailing_metadata_for(cls("no plan fits")) == ()


@pytest.mark.parametrize("cls", [c for c in EXPECTED if not issubclass(c, errors.BudgetInfeasibleError)],
                         ids=lambda c: c.__name__)
def test_no_other_error_has_trailing_metadata(cls):
    error = cls("x")
    error.least_feasible_peak_bytes = 5   # even one that happens to carry the attribute
    assert status.trailing_metadata_for(error) == ()


def _from_worker(exc: BaseException) -> BaseException:
    """What the server rebuilds from a worker that failed with `exc`: the worker's own message
    (service/worker.py's error_message), through JSON, as the pipe carries it."""
    try:
        raise exc
    except BaseException as raised:  # noqa: BLE001 - a real traceback, as the worker sends it
        import traceback
        name, message = error_message(raised, {"model_path": "/nowhere/upload/model.onnx"})
        payload = {"error": name, "message": message,
                   "least_feasible_peak_bytes": getattr(raised, "least_feasible_peak_bytes", None),
                   "traceback": traceback.format_exc()}
    return status.error_from_worker(json.loads(json.dumps(payload)))


@pytest.mark.parametrize("cls", [c for c in EXPECTED if c.__module__ == errors.__name__], ids=lambda c: c.__name__)
def test_a_library_error_crosses_the_worker_boundary_as_itself(cls):
    rebuilt = _from_worker(cls(f"the {cls.__name__} message"))
    assert type(rebuilt) is cls and str(rebuilt) == f"the {cls.__name__} message"
    assert "raise exc" in rebuilt.worker_traceback and cls.__name__ in rebuilt.worker_traceback
    assert status.status_for(rebuilt) == (EXPECTED[cls], f"the {cls.__name__} message")


@pytest.mark.parametrize("cls", [errors.BudgetInfeasibleError, errors.MemoryLimitError])
def test_the_least_feasible_peak_crosses_the_worker_boundary(cls):
    rebuilt = _from_worker(cls("no plan fits under 1 byte", 987_654))
    assert type(rebuilt) is cls and rebuilt.least_feasible_peak_bytes == 987_654
    assert status.trailing_metadata_for(rebuilt) == ((PEAK_KEY, "987654"),)
    assert _from_worker(cls("no plan fits")).least_feasible_peak_bytes is None


def test_a_subclass_of_a_library_error_crosses_as_its_library_class():
    class ShapeError(errors.InvalidModelError):
        pass
    rebuilt = _from_worker(ShapeError("bad shape"))
    assert type(rebuilt) is errors.InvalidModelError and str(rebuilt) == "bad shape"


def test_a_failure_the_library_does_not_type_comes_back_as_a_failed_worker():
    rebuilt = _from_worker(KeyError("weights"))
    assert type(rebuilt) is status.WorkerFailedError
    assert str(rebuilt) == "the worker failed (KeyError): 'weights'"
    assert "KeyError" in rebuilt.worker_traceback
    assert status.status_for(rebuilt) == (grpc.StatusCode.INTERNAL, "the worker failed (KeyError): 'weights'")


def test_a_payload_with_missing_fields_still_names_the_failure():
    """The payload is read, not trusted: absent fields are empty, never a crash of the server."""
    rebuilt = status.error_from_worker({})
    assert type(rebuilt) is status.WorkerFailedError and str(rebuilt) == "the worker failed (None): "
    assert rebuilt.worker_traceback is None
    rebuilt = status.error_from_worker({"error": "InvalidModelError"})
    assert type(rebuilt) is errors.InvalidModelError and str(rebuilt) == ""
    rebuilt = status.error_from_worker({"error": "BudgetInfeasibleError", "message": "m"})
    assert type(rebuilt) is errors.BudgetInfeasibleError and rebuilt.least_feasible_peak_bytes is None
    # a class name that is not a library error's is not looked up anywhere else
    rebuilt = status.error_from_worker({"error": "ShuttingDownError", "message": "m"})
    assert type(rebuilt) is status.WorkerFailedError and str(rebuilt) == "the worker failed (ShuttingDownError): m"
