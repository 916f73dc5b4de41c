"""Malformed requests against a real `graphopt serve`: each named case gets its status and a
message without the server's paths; then a bounded protocol fuzzer (thousands of malformed
requests, seeded) after which the server is healthy, has left nothing behind, and serves a
legitimate client."""
from __future__ import annotations

import hashlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from graphopt.examples import training_example
from graphopt.optimize import save_model
from graphopt_service._proto import graphopt_pb2 as pb
from graphopt_service.client import Client, make_options
from service_process import ServerProcess

MAX_FILES = 8
OPTIMIZE = "/graphopt.v1.Graphopt/Optimize"
ANALYZE = "/graphopt.v1.Graphopt/Analyze"
LIST = "/graphopt.v1.Graphopt/ListStrategies"
# what a malformed request may get; never INTERNAL or UNKNOWN (a crash), never OK
EXPECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED,
            grpc.StatusCode.FAILED_PRECONDITION}


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory) -> bytes:
    model, _ = training_example("mlp", small=True)
    path = tmp_path_factory.mktemp("fuzz-model") / "mlp.onnx"
    save_model(model, path)
    return path.read_bytes()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # huge model limit: a declared size past the disk's free space meets the disk check, not this one
    proc = ServerProcess(tmp_path_factory.mktemp("fuzz") / "work", "--workers", "1", "--queue", "2",
                         "--max-files", str(MAX_FILES), "--max-model-bytes", str(1 << 62), "--idle-timeout", "5")
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target) as ch:
        yield ch


def _raw_call(channel, method: str, messages: list[bytes], timeout: float = 30.0) -> grpc.StatusCode:
    """Send `messages` as raw bytes (anything, valid or not) and return the status."""
    if method == LIST:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(messages[0] if messages else b"", timeout=timeout)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    if method == OPTIMIZE:
        call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)
    else:
        call = channel.stream_unary(method, request_serializer=None, response_deserializer=None)
    try:
        result = call(iter(messages), timeout=timeout)
        if method == OPTIMIZE:
            list(result)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def _header(path: str, data: bytes, size: int | None = None) -> bytes:
    return pb.OptimizeRequest(file=pb.FileHeader(path=path, size_bytes=len(data) if size is None else size,
                                                 sha256=hashlib.sha256(data).hexdigest())).SerializeToString()


def _chunk(data: bytes, offset: int = 0) -> bytes:
    return pb.OptimizeRequest(chunk=pb.FileChunk(offset=offset, data=data)).SerializeToString()


def _options(**fields) -> bytes:
    return pb.OptimizeRequest(options=make_options(measure=False, **fields)).SerializeToString()


def _file(path: str, data: bytes) -> list[bytes]:
    return [_header(path, data), _chunk(data)]


def test_each_malformed_request_gets_its_status_without_server_paths(server, channel, model_bytes):
    small = b"weights"
    cases = {
        "a 300-character file name": (grpc.StatusCode.INVALID_ARGUMENT, "longer than 255 bytes",
                                      [_options(), *_file("m.onnx", model_bytes), *_file("w" * 300, small)]),
        "a 300-character model name": (grpc.StatusCode.INVALID_ARGUMENT, "longer than 255 bytes",
                                       [_options(), *_file("m" * 300 + ".onnx", model_bytes)]),
        "a 5000-byte path": (grpc.StatusCode.INVALID_ARGUMENT, "longer than 1024 bytes",
                             [_options(), *_file("m.onnx", model_bytes), *_file("d/" * 2500 + "w", small)]),
        "a file where a folder was": (grpc.StatusCode.INVALID_ARGUMENT, "clashes with a folder",
                                      [_options(), *_file("m.onnx", model_bytes), *_file("a/b.bin", small),
                                       *_file("a", small)]),
        "a folder where a file was": (grpc.StatusCode.INVALID_ARGUMENT, "which is a file",
                                      [_options(), *_file("m.onnx", model_bytes), *_file("a", small),
                                       *_file("a/b.bin", small)]),
        "a folder under the model": (grpc.StatusCode.INVALID_ARGUMENT, "which is a file",
                                     [_options(), *_file("m.onnx", model_bytes), *_file("m.onnx/x", small)]),
        "too many files": (grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {MAX_FILES} files",
                           [_options(), *_file("m.onnx", model_bytes),
                            *[m for k in range(MAX_FILES + 5) for m in _file(f"w{k}.bin", small)]]),
        "more than the disk holds": (grpc.StatusCode.RESOURCE_EXHAUSTED, "does not fit on the server's work disk",
                                     [_options(), _header("m.onnx", model_bytes, size=1 << 60)]),
        "1-byte response chunks": (grpc.StatusCode.INVALID_ARGUMENT, "response_chunk_bytes",
                                   [_options(response_chunk_bytes=1), *_file("m.onnx", model_bytes)]),
        "random bytes": (grpc.StatusCode.INVALID_ARGUMENT, "not a valid OptimizeRequest",
                         [bytes(random.Random(1).randrange(256) for _ in range(300))]),
        "options then random bytes": (grpc.StatusCode.INVALID_ARGUMENT, "not a valid OptimizeRequest",
                                      [_options(), b"\xff\xff\xff\xff\x0f\x01"]),
    }
    failures = []
    for case, (code, words, messages) in cases.items():
        for method in (OPTIMIZE, ANALYZE):
            got, details = _raw_call(channel, method, messages)
            if got != code or words not in details:
                failures.append(f"{case} ({method}): {got.name}: {details}")
            if str(server.work_dir) in details or "/tmp" in details:
                failures.append(f"{case} ({method}): the message shows the server's folders: {details}")
    got, details = _raw_call(channel, LIST, [b"\xff\xff\xff\xff\x0f"])
    if got != grpc.StatusCode.INVALID_ARGUMENT or "ListStrategiesRequest" not in details:
        failures.append(f"ListStrategies of random bytes: {got.name}: {details}")
    assert not failures, "\n".join(failures)
    assert server.wait_no_leftovers() == []
    with Client(server.target) as client:
        assert client.health() == "SERVING"


def _mutations(rng: random.Random, model_bytes: bytes):
    """Malformed request streams, each a list of raw messages."""
    good = [_options(), *_file("m.onnx", model_bytes[:2000])]   # (a truncated model: never a valid one)
    while True:
        kind = rng.randrange(7)
        messages = list(good)
        if kind == 0:       # random bytes in place of a message
            messages[rng.randrange(len(messages))] = rng.randbytes(rng.randrange(1, 200))
        elif kind == 1:     # a bit flipped somewhere
            k = rng.randrange(len(messages))
            data = bytearray(messages[k])
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            messages[k] = bytes(data)
        elif kind == 2:     # a message cut short
            k = rng.randrange(len(messages))
            messages[k] = messages[k][:rng.randrange(len(messages[k]))]
        elif kind == 3:     # dropped, duplicated or swapped messages
            k = rng.randrange(len(messages))
            choice = rng.randrange(3)
            if choice == 0:
                del messages[k]
            elif choice == 1:
                messages.insert(k, messages[k])
            else:
                j = rng.randrange(len(messages))
                messages[k], messages[j] = messages[j], messages[k]
        elif kind == 4:     # odd paths, sizes, offsets
            path = rng.choice(["", "/abs", "../up", "a\\b", "a\x00b", ".", "x" * rng.randrange(200, 400),
                               "a/" * rng.randrange(1, 600) + "b", "m.onnx/sub", "ok.bin"])
            messages = [_options(), _header("m.onnx", model_bytes[:2000]), _chunk(model_bytes[:2000]),
                        _header(path, b"abc", size=rng.choice([3, -1, 1 << 62, 0])),
                        _chunk(b"abc", offset=rng.choice([0, 1, -5, 1 << 40]))]
        elif kind == 5:     # odd options
            options = make_options(measure=False)
            options.threads = rng.choice([-1, 0, 10**6])
            options.response_chunk_bytes = rng.choice([-1, 1, 100, 10**9])
            options.input_dims.add(name=rng.choice(["", "x"]), dims=[rng.choice([-3, 0, 2])])
            messages[0] = pb.OptimizeRequest(options=options).SerializeToString()
        else:               # the stream ends early
            messages = messages[:rng.randrange(len(messages))]
        yield messages


def test_a_bounded_protocol_fuzzer_finds_no_crash(server, channel, model_bytes):
    rng = random.Random(15)
    cases = []
    generator = _mutations(rng, model_bytes)
    for _ in range(2000):
        cases.append((rng.choice([OPTIMIZE, ANALYZE]), next(generator)))
    cases += [(LIST, [rng.randbytes(rng.randrange(1, 50))]) for _ in range(200)]
    failures, lock = [], threading.Lock()

    def run(case):
        method, messages = case
        code, details = _raw_call(channel, method, messages)
        # a mutation can leave a valid request: then the (truncated) model is refused, or a valid
        # ListStrategies request is answered
        if code not in EXPECTED and not (method == LIST and code == grpc.StatusCode.OK):
            with lock:
                failures.append(f"{method} {[m[:40] for m in messages]}: {code.name}: {details}")
        elif str(server.work_dir) in details:
            with lock:
                failures.append(f"{method}: the message shows the server's folders: {details}")

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(run, cases))
    assert not failures, f"{len(failures)} of {len(cases)} failed, e.g.:\n" + "\n".join(failures[:10])
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    assert server.wait_no_leftovers() == []
    # every call that started logs "call finished", after its status reached the client: wait
    # for all of them before the statuses are read
    finished = server.wait_for_logs("call finished", 2000, timeout_seconds=60)
    deadline = time.monotonic() + 60
    while len(finished) < len(server.entries("call started")):
        assert time.monotonic() < deadline, "calls that started never finished"
        time.sleep(0.1)
        finished = server.entries("call finished")
    statuses = {e.get("status") for e in finished}
    assert "INTERNAL" not in statuses and "UNKNOWN" not in statuses, statuses
