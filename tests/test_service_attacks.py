"""The service under attack and faults, each against a real `graphopt serve` on a loopback port:
silent and stalled streams, jobs that spin or eat memory, idle streams against the thread pool,
authentication that fails closed, workers that die or outlive their server, stale folders,
malformed uploads. Each: the legitimate client is served, the server stays healthy, nothing is
left behind."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from onnx import TensorProto, helper, numpy_helper

from graphopt.examples import training_example
from graphopt.optimize import save_model
from graphopt_service._proto import graphopt_pb2 as pb
from graphopt_service._proto import graphopt_pb2_grpc as pb_grpc
from graphopt_service.client import Client, make_options
from service_process import ServerProcess

IDLE_SECONDS = 2.0


# -- models ------------------------------------------------------------------------------------
def _training_graph(forward: list, initializers: list, name: str) -> onnx.ModelProto:
    """A training graph around `forward` (x -> y, both [1]): loss = sum(y * w), w_grad = y."""
    nodes = forward + [helper.make_node("Mul", ["y", "w"], ["yw"], name="mulw"),
                       helper.make_node("ReduceSum", ["yw"], ["loss"], keepdims=0, name="loss"),
                       helper.make_node("Identity", ["y"], ["w_grad"], name="grad")]
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("w_grad", TensorProto.FLOAT, [1])],
                              initializers + [numpy_helper.from_array(np.ones(1, np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def spinning_model() -> onnx.ModelProto:
    """A Loop of 10^12 iterations: a few hundred bytes that would pin a worker for days."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", "one"], ["v_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.ones(1, np.float32), "one")])
    return _training_graph([helper.make_node("Loop", ["trips", "cond", "x"], ["y"], body=body, name="loop")],
                           [numpy_helper.from_array(np.array(10**12, np.int64), "trips"),
                            numpy_helper.from_array(np.array(True), "cond")], "spin")


def memory_hog_model(elements: int = 1 << 28) -> onnx.ModelProto:
    """A ConstantOfShape of 2^28 floats: a few hundred bytes that make ONNX Runtime take 1 GiB."""
    return _training_graph(
        [helper.make_node("ConstantOfShape", ["shape"], ["big"], name="big",
                          value=numpy_helper.from_array(np.ones(1, np.float32))),
         helper.make_node("ReduceSum", ["big"], ["s"], keepdims=1, name="sum"),
         helper.make_node("Mul", ["s", "x"], ["y"], name="y")],
        [numpy_helper.from_array(np.array([elements], np.int64), "shape")], "hog")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("attack-models")
    paths = {}
    model, _ = training_example("mlp", small=True)
    save_model(model, folder / "mlp.onnx")
    paths["mlp"] = folder / "mlp.onnx"
    # big enough that its result (about 32 MB) outruns any flow-control window
    model, _ = training_example("mlp", batch=2, width=1024, depth=8, d_in=1024)
    save_model(model, folder / "wide.onnx")
    paths["wide"] = folder / "wide.onnx"
    for name, make in (("spin", spinning_model), ("hog", memory_hog_model)):
        onnx.save(make(), folder / f"{name}.onnx")
        paths[name] = folder / f"{name}.onnx"
    return paths


# -- helpers -----------------------------------------------------------------------------------
def _health(target: str, timeout_seconds: float = 5.0) -> str:
    with grpc.insecure_channel(target) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_seconds)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _served(server: ServerProcess, models, tmp_path: Path, name: str = "legit") -> None:
    """The legitimate client: a real optimize call that succeeds."""
    with Client(server.target) as client:
        report = client.optimize(models["mlp"], tmp_path / f"{name}.onnx", measure=False, timeout_seconds=120)
    assert report.outputs_match and (tmp_path / f"{name}.onnx").is_file()


def _error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__"):
            list(result)
    return info.value


def _file_requests(name: str, data: bytes, chunk_bytes: int = 1 << 16):
    yield pb.OptimizeRequest(file=pb.FileHeader(path=name, size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))
    for offset in range(0, len(data), chunk_bytes):
        yield pb.OptimizeRequest(chunk=pb.FileChunk(offset=offset, data=data[offset:offset + chunk_bytes]))


def _stalled(first_messages: list, release: threading.Event):
    """A request stream that sends `first_messages`, then nothing until `release`."""
    yield from first_messages
    release.wait(120)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _processes_below(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                kids = [int(k) for k in children.read_text().split()]
            except OSError:
                continue
            found.extend(kids)
            todo.extend(kids)
    return found


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _exited(pid: int) -> bool:
    """The process is gone, or a zombie with every thread ended (reapable: its parent's waitpid
    sees it). A killed process's leader shows Z while its other threads are still being torn
    down, and waitpid does not report it until they are: the server then saw it alive (once in
    a loaded full run)."""
    if _state(pid) is None:
        return True
    try:
        return _state(pid) == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


# -- stalled streams ---------------------------------------------------------------------------
def test_silent_uploads_neither_hold_the_queue_nor_stay(tmp_path, models):
    """10 streams that send the options and then nothing, against workers 2 + queue 8: the
    legitimate client is served meanwhile, the silent ones are ended after the idle timeout."""
    server = ServerProcess(tmp_path / "work", "--workers", "2", "--queue", "8", "--idle-timeout", str(IDLE_SECONDS))
    release = threading.Event()
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.GraphoptStub(channel)
            silent = [stub.Optimize(_stalled([pb.OptimizeRequest(options=make_options(measure=False))], release))
                      for _ in range(10)]
            server.wait_for_logs("call started", 10)
            _served(server, models, tmp_path)
            assert _health(server.target) == "SERVING"
            for call in silent:
                error = _error(lambda: call)
                assert error.code() == grpc.StatusCode.CANCELLED
        # the server logs each call's end on the call's own thread, after the client saw it end
        ended = server.wait_for_logs("idle call ended", 10)
        assert len(ended) == 10 and {e["waiting_for"] for e in ended} == {"the next request message"}
        assert len(server.wait_for_logs("call finished", 10, status="DEADLINE_EXCEEDED")) == 10
        assert server.wait_no_leftovers() == []
        _served(server, models, tmp_path, "after")
    finally:
        release.set()
        server.kill()


def test_a_partial_upload_is_ended_and_its_file_removed(tmp_path, models):
    server = ServerProcess(tmp_path / "work", "--workers", "1", "--idle-timeout", str(IDLE_SECONDS))
    release = threading.Event()
    try:
        data = models["wide"].read_bytes()
        first = [pb.OptimizeRequest(options=make_options(measure=False)), *list(_file_requests("m.onnx", data))[:5]]
        with grpc.insecure_channel(server.target) as channel:
            call = pb_grpc.GraphoptStub(channel).Optimize(_stalled(first, release))
            server.wait_for_log("call started")
            assert _error(lambda: call).code() == grpc.StatusCode.CANCELLED
        assert server.wait_for_log("idle call ended")["waiting_for"] == "the next request message"
        assert server.wait_no_leftovers() == []
        _served(server, models, tmp_path)
    finally:
        release.set()
        server.kill()


def test_an_unread_response_is_ended(tmp_path, models):
    """A client that starts an Optimize call and never reads the result holds neither its slot
    nor its folder past the idle timeout."""
    server = ServerProcess(tmp_path / "work", "--workers", "1", "--queue", "0", "--idle-timeout", str(IDLE_SECONDS))
    try:
        with Client(server.target) as client:
            call = client.optimize_call(models["wide"], strategy="chen-sqrt", measure=False, verify=False,
                                        response_chunk_bytes=64 << 10)
            assert next(call).progress.stage == "queued"   # then it stops reading
            entry = server.wait_for_log("idle call ended", timeout_seconds=120)
            assert entry["waiting_for"] == "the client to read a response"
            server.wait_for_log("call finished", status="DEADLINE_EXCEEDED")
            call.cancel()
        assert server.wait_no_leftovers() == []
        _served(server, models, tmp_path)   # the one slot is free again
    finally:
        server.kill()


# -- jobs that spin or eat memory --------------------------------------------------------------
def test_a_job_past_the_job_timeout_is_stopped_whatever_the_client_deadline(tmp_path, models):
    server = ServerProcess(tmp_path / "work", "--workers", "1", "--job-timeout", "5")
    try:
        with Client(server.target) as client:   # no client deadline
            error = _error(lambda: client.optimize(models["spin"], tmp_path / "never.onnx", measure=False))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "--job-timeout" in error.details()
        assert server.wait_for_log("stopping a worker")["worker_pid"] > 0
        assert not (tmp_path / "never.onnx").exists()
        assert _health(server.target) == "SERVING"
        _served(server, models, tmp_path)   # on the replacement worker
        assert server.wait_no_leftovers() == []
    finally:
        server.kill()


def test_a_job_over_the_memory_limit_is_stopped(tmp_path, models):
    server = ServerProcess(tmp_path / "work", "--workers", "1", "--job-memory", "512MiB")
    try:
        with Client(server.target) as client:
            error = _error(lambda: client.optimize(models["hog"], tmp_path / "never.onnx", measure=False))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert "512.0 MiB" in error.details() and "--job-memory" in error.details()
        assert _health(server.target) == "SERVING"
        _served(server, models, tmp_path)
        assert server.wait_no_leftovers() == []
    finally:
        server.kill()


class _Sampler:
    """From outside the server (this test process): every ~2 ms, the kernel's charge of the
    worker's group (cgroup kinds) and the resident set of each process of the worker's tree
    (every kind); the largest of each seen."""

    def __init__(self, worker_pid: int, cgroup: str | None):
        self.worker_pid, self.cgroup = worker_pid, cgroup
        self.group_bytes, self.process_bytes, self.samples = 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        found, todo = [], [self.worker_pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/children") as f:
                        todo.extend(int(c) for c in f.read().split())
            except OSError:
                pass
        return found

    def _run(self) -> None:
        usage = None
        if self.cgroup is not None:
            name = "memory.current" if os.path.exists(os.path.join(self.cgroup, "memory.current")) \
                else "memory.usage_in_bytes"
            usage = os.path.join(self.cgroup, name)
        while not self._stop.is_set():
            if usage is not None:
                try:
                    with open(usage) as f:
                        self.group_bytes = max(self.group_bytes, int(f.read()))
                except (OSError, ValueError):
                    pass
            for pid in self._tree():
                try:
                    with open(f"/proc/{pid}/status") as f:
                        for line in f:
                            if line.startswith("VmRSS:"):
                                self.process_bytes = max(self.process_bytes, int(line.split()[1]) * 1024)
                except (OSError, ValueError):
                    pass
            self.samples += 1
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.parametrize("cap", ["kernel", "rlimit"])
def test_a_job_allocating_four_times_the_memory_limit_at_once_is_stopped_by_the_kernel(tmp_path, cap):
    """A job that asks for 4 GiB in one step (one ConstantOfShape) under a 1 GiB limit: the
    kernel stops it before it holds more than the limit (a page's margin), measured from here;
    the call ends RESOURCE_EXHAUSTED naming the limit and the next client is served. "kernel":
    the cap this machine allows the server (a cgroup where it may create one, as here), checked
    against what this process may create; "rlimit": the fallback (GRAPHOPT_KERNEL_MEMORY_CAP=0),
    each process's data bounded by RLIMIT_DATA, the sum still polled."""
    from graphopt_service.memory_cap import MemoryCap
    limit = 1 << 30
    page = os.sysconf("SC_PAGE_SIZE")
    onnx.save(memory_hog_model(1 << 30), tmp_path / "hog4g.onnx")
    model, _ = training_example("mlp", small=True)
    save_model(model, tmp_path / "mlp.onnx")
    env = dict(os.environ, **({"GRAPHOPT_KERNEL_MEMORY_CAP": "0"} if cap == "rlimit" else {}))
    expected = "rlimit" if cap == "rlimit" else MemoryCap.create(limit)
    if not isinstance(expected, str):
        expected.close(attempts=1)
        expected = expected.kind
    server = ServerProcess(tmp_path / "work", "--workers", "1", "--job-memory", "1GiB", env=env)
    try:
        assert server.wait_for_log("serving")["job_memory_enforced_by"] == expected
        worker = server.wait_for_log("worker memory cap")
        assert worker["memory_cap"] == expected and worker["memory_limit_bytes"] == limit
        sampler = _Sampler(worker["worker_pid"], worker["cgroup"])
        try:
            with Client(server.target) as client:
                error = _error(lambda: client.optimize(tmp_path / "hog4g.onnx", tmp_path / "never.onnx",
                                                       measure=False, timeout_seconds=120))
        finally:
            sampler.stop()
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert "1.0 GiB" in error.details() and "--job-memory" in error.details()
        assert sampler.samples > 10
        assert sampler.process_bytes <= limit + page, sampler.process_bytes
        if expected in ("cgroup1", "cgroup2"):
            assert "the kernel stopped it" in error.details()
            assert limit // 2 < sampler.group_bytes <= limit + page, sampler.group_bytes   # it got near
            stopped = server.wait_for_log("stopping a worker", worker_pid=worker["worker_pid"])
            assert limit // 2 < stopped["memory_peak_bytes"] <= limit + page       # the kernel's own mark
        else:
            assert "an allocation failed" in error.details()
        assert not (tmp_path / "never.onnx").exists()
        assert _health(server.target) == "SERVING"
        _served(server, {"mlp": tmp_path / "mlp.onnx"}, tmp_path)
        assert server.wait_no_leftovers() == []
    finally:
        server.terminate()
    if worker["cgroup"] is not None:     # the server removed its workers' groups as it stopped
        assert not os.path.exists(worker["cgroup"])


def test_the_memory_groups_of_a_killed_server_are_removed_at_the_next_start(tmp_path):
    """A server killed with SIGKILL cannot remove its workers' groups; the next server on the
    machine removes those of servers that are gone (and only those: its own stay)."""
    from graphopt_service.memory_cap import MemoryCap
    probe = MemoryCap.create(1 << 30)
    probe.close(attempts=1)
    first = ServerProcess(tmp_path / "work1", "--workers", "1", "--job-memory", "1GiB")
    try:
        group = first.wait_for_log("worker memory cap")["cgroup"]
    finally:
        first.kill()
    assert (group is not None) == (probe.folder is not None)     # a group wherever one can be made
    if group is None:
        return                                                    # RLIMIT_DATA: nothing to sweep
    deadline = time.monotonic() + 30
    while Path(group, "cgroup.procs").read_text().strip():        # the worker dies with its server
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert os.path.isdir(group)                                   # left behind by the killed server
    second = ServerProcess(tmp_path / "work2", "--workers", "1", "--job-memory", "1GiB")
    try:
        own = second.wait_for_log("worker memory cap")["cgroup"]
        assert not os.path.exists(group) and os.path.isdir(own)
    finally:
        second.terminate()
    assert not os.path.exists(own)


# -- tricklers and one address's many uploads ----------------------------------------------------
def _trickled(first_messages: list, release: threading.Event, every_seconds: float = 0.2):
    """Sends `first_messages`, then one byte of the file every `every_seconds` (never silent
    for the idle timeout), until `release`."""
    yield from first_messages
    offset = 0
    while not release.wait(every_seconds):
        yield pb.OptimizeRequest(chunk=pb.FileChunk(offset=offset, data=b"x"))
        offset += 1


def test_an_upload_under_the_minimum_rate_is_ended(tmp_path, models):
    """A client that trickles a byte every 0.2 s (never idle for the 60 s idle timeout) is ended
    DEADLINE_EXCEEDED once a 2 s window brings fewer than 64 KiB a second; a fast upload of
    32 MB and the legitimate client are served meanwhile, and nothing is left behind."""
    server = ServerProcess(tmp_path / "work", "--workers", "1", "--idle-timeout", "60", "--job-timeout", "20",
                           "--min-upload-rate", "64KiB", "--upload-rate-window", "2")
    release = threading.Event()
    try:
        data = models["wide"].read_bytes()
        header = pb.OptimizeRequest(file=pb.FileHeader(path="m.onnx", size_bytes=len(data),
                                                       sha256=hashlib.sha256(data).hexdigest()))
        with grpc.insecure_channel(server.target) as channel:
            started = time.monotonic()
            call = pb_grpc.GraphoptStub(channel).Optimize(
                _trickled([pb.OptimizeRequest(options=make_options(measure=False)), header], release))
            error = _error(lambda: call)
            ended_after = time.monotonic() - started
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error.details()
        assert "--min-upload-rate" in error.details() and "65536 bytes a second" in error.details()
        assert 2.0 <= ended_after < 30.0, ended_after      # after the window, long before the idle timeout
        assert server.wait_for_log("call finished", status="DEADLINE_EXCEEDED")
        with Client(server.target) as client:       # 32 MB at loopback speed: far over the minimum
            report = client.optimize(models["wide"], tmp_path / "wide-out.onnx", strategy="chen-sqrt",
                                     measure=False, verify=False, timeout_seconds=300)
        assert report.strategy == "chen-sqrt"
        _served(server, models, tmp_path)
        assert server.wait_no_leftovers() == []
    finally:
        release.set()
        server.kill()


def test_one_address_holds_at_most_its_uploads(tmp_path, models):
    """--uploads-per-address 2: two stalled uploads from 127.0.0.1, a third from there is refused
    at once, naming the flag; a client from another address (::1) is served meanwhile; once the
    two end, 127.0.0.1 is served again."""
    server = ServerProcess(tmp_path / "work", "--host", "[::]", "--workers", "1", "--queue", "4",
                           "--uploads-per-address", "2", "--idle-timeout", "60")
    release = threading.Event()
    try:
        v4, v6 = f"127.0.0.1:{server.port}", f"[::1]:{server.port}"
        with grpc.insecure_channel(v4) as channel:
            stub = pb_grpc.GraphoptStub(channel)
            held = [stub.Optimize(_stalled([pb.OptimizeRequest(options=make_options(measure=False))], release))
                    for _ in range(2)]
            server.wait_for_logs("call started", 2)
            third = _error(lambda: stub.Optimize(iter([pb.OptimizeRequest(options=make_options(measure=False))])))
            assert third.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, third.details()
            assert "--uploads-per-address" in third.details() and "2 uploads from this address" in third.details()
            with Client(v6) as client:                     # another address: served
                client.optimize(models["mlp"], tmp_path / "v6.onnx", measure=False, timeout_seconds=120)
            release.set()
            for call in held:
                _error(lambda: call)       # their streams ended without a model: an error each
        server.wait_for_logs("call finished", 4)
        with Client(v4) as client:
            client.optimize(models["mlp"], tmp_path / "v4.onnx", measure=False, timeout_seconds=120)
        assert server.wait_no_leftovers() == []
    finally:
        release.set()
        server.kill()


# -- idle streams against the thread pool --------------------------------------------------------
# the idle timeout of the reflection test. On a quiet machine its 30 streams all arrive while the
# first 4 are held (4 held, 26 refused); on a loaded one they arrive over longer than that (at 2 s
# a CI run saw 13 held in turn and 17 refused, at 8 s 15 and 15), so the test checks the limit by
# when the held ones ended: in waves of at most 4, an idle timeout apart
REFLECTION_IDLE_SECONDS = 8.0


def _iso_seconds(stamp: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_idle_reflection_streams_do_not_starve_health(tmp_path, models):
    server = ServerProcess(tmp_path / "work", "--workers", "1", "--queue", "0",
                           "--idle-timeout", str(REFLECTION_IDLE_SECONDS))
    release = threading.Event()
    channels = []
    try:
        calls = []
        for _ in range(30):   # each on its own connection, as separate clients would
            channel = grpc.insecure_channel(server.target)
            channels.append(channel)
            calls.append(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                _stalled([], release)))
        time.sleep(0.5)
        assert _health(server.target, timeout_seconds=5) == "SERVING"
        with Client(server.target) as client:
            assert client.list_strategies(timeout_seconds=5)
        _served(server, models, tmp_path)
        errors = [_error(lambda c=c: c) for c in calls]
        codes = [e.code() for e in errors]
        seen = [(e.code().name, e.details()) for e in errors]
        # a few at a time held a thread, until the idle timeout ended them (CANCELLED; once seen
        # on a loaded machine as UNAVAILABLE); the others were refused
        assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED,
                              grpc.StatusCode.UNAVAILABLE}, seen
        refused = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        ended = sorted(_iso_seconds(e["time"]) for e in server.logs() if e.get("message") == "idle call ended")
        assert refused >= 1 and len(ended) <= len(codes) - refused, (seen, ended)
        # never more than 4 held at once (OTHER_STREAMS): a stream is held for the idle timeout
        # from when it was let in, so five that ended within half of it were held together
        assert all(ended[i + 4] - ended[i] >= REFLECTION_IDLE_SECONDS / 2 for i in range(len(ended) - 4)), ended
        assert _health(server.target) == "SERVING"
    finally:
        release.set()
        for channel in channels:
            channel.close()
        server.kill()


def test_serve_listens_on_loopback_by_default():
    from graphopt.cli import build_parser
    environment = {k: v for k, v in os.environ.items() if k != "GRAPHOPT_HOST"}
    code = "from graphopt.cli import build_parser; print(build_parser().parse_args(['serve']).host)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=60)
    assert result.stdout.strip() == "127.0.0.1", result.stderr
    assert build_parser().parse_args(["serve", "--host", "[::]"]).host == "[::]"


# -- authentication fails closed -----------------------------------------------------------------
@pytest.mark.parametrize("content", ["", "  \n\t\n"])
def test_an_empty_token_file_is_an_error_at_start(tmp_path, content):
    (tmp_path / "token").write_text(content)
    result = subprocess.run([sys.executable, "-m", "graphopt.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                             "--token-file", str(tmp_path / "token"), "--work-dir", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "token file" in result.stderr and "is empty" in result.stderr, result.stderr
    assert "listening" not in result.stdout


def test_an_empty_token_variable_is_an_error_at_start(tmp_path):
    result = subprocess.run([sys.executable, "-m", "graphopt.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                             "--work-dir", str(tmp_path / "work")], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "GRAPHOPT_TOKEN": ""})
    assert result.returncode == 2 and "GRAPHOPT_TOKEN is set but empty" in result.stderr, result.stderr


def test_failed_tokens_are_logged_and_throttled_per_address(tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    server = ServerProcess(tmp_path / "work", "--workers", "1", "--token-file", str(tmp_path / "token"))
    try:
        with Client(server.target, token="wrong") as wrong, Client(server.target, token="s3cret") as right:
            messages = [_error(lambda: wrong.list_strategies(timeout_seconds=5)).details() for _ in range(40)]
            assert all("wrong bearer token" in m or "too many failed" in m for m in messages)
            assert sum("too many failed" in m for m in messages) >= 25   # refused without a look at the token
            # while throttled, the right token from this address is refused too (guessing gains nothing)
            error = _error(lambda: right.list_strategies(timeout_seconds=5))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "too many failed" in error.details()
            assert right.health() == "SERVING"     # probes are never throttled
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert right.list_strategies(timeout_seconds=5)
                    break
                except grpc.RpcError as exc:
                    assert "too many failed" in exc.details() and time.monotonic() < deadline
                    time.sleep(0.2)
        failures = [e for e in server.logs() if e.get("message") == "authentication failed"]
        assert 10 <= len(failures) < 40 and all(e["peer"].startswith("ipv4:127.0.0.1:") for e in failures)
        assert failures[-1]["attempts_left"] == 0
        assert any(e.get("message") == "authentication throttled" for e in server.logs())
    finally:
        server.kill()


# -- workers -------------------------------------------------------------------------------------
def test_a_worker_that_died_while_idle_is_replaced_before_a_call(tmp_path, models):
    server = ServerProcess(tmp_path / "work", "--workers", "1")
    try:
        # the server's own children (each worker has its warm measuring parent below it)
        workers = [p for p in _processes_below(server.proc.pid)
                   if _state(p) not in (None, "Z") and _parent(p) == server.proc.pid]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _exited(workers[0]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _served(server, models, tmp_path)
        entry = server.wait_for_log("an idle worker had died; replacing it")
        assert entry["worker_pid"] == workers[0] and entry["exit_code"] == -signal.SIGKILL
        assert _state(workers[0]) is None, "the dead worker was left a zombie"
        _served(server, models, tmp_path, "second")   # the full capacity is back
    finally:
        server.kill()


def test_workers_and_their_measuring_processes_die_with_the_server(tmp_path, models):
    server = ServerProcess(tmp_path / "work", "--workers", "2")
    try:
        workers = _processes_below(server.proc.pid)
        with Client(server.target) as client:
            call = client.optimize_call(models["spin"], measure=False)
            next(call)                                   # queued: a worker runs the loop
            server.wait_for_log("call admitted")
            time.sleep(1.0)
            below = set(workers) | set(_processes_below(server.proc.pid))
            os.kill(server.proc.pid, signal.SIGKILL)     # the server alone, as the OOM killer would
            deadline = time.monotonic() + 15
            while alive := [p for p in below if _state(p) not in (None, "Z")]:
                assert time.monotonic() < deadline, f"still running after their server died: {alive}"
                time.sleep(0.1)
            call.cancel()
    finally:
        server.kill()


def test_stale_work_folders_are_swept_at_start(tmp_path, models):
    work = tmp_path / "work"
    stale = work / "graphopt-service-gone"
    (stale / "call-1234-x" / "upload").mkdir(parents=True)
    (stale / "call-1234-x" / "upload" / "m.onnx").write_bytes(b"x" * 1000)
    (stale / ".lock").write_text("")
    running = ServerProcess(work, "--workers", "1")     # a live server's folder is kept
    try:
        live_roots = [p for p in work.iterdir() if p.is_dir() and p != stale]
        assert not stale.exists(), "the stale folder of a server that is gone was kept"
        assert running.wait_for_log("removed stale work folders")["folders"] == ["graphopt-service-gone"]
        second = ServerProcess(work, "--workers", "1")   # (its log file is the first one's: same work dir)
        try:
            assert len(live_roots) == 1 and live_roots[0].exists(), "a running server's folder was swept"
            assert not any(e.get("message") == "removed stale work folders" for e in second.logs())
        finally:
            second.kill()
        _served(running, models, tmp_path)
    finally:
        running.kill()


# -- a work disk that fills during a job -------------------------------------------------------------
def test_a_work_disk_that_fills_during_a_job_is_resource_exhausted(tmp_path, models):
    """The upload fits (33 MB on a 48 MiB disk), the job's own files do not: RESOURCE_EXHAUSTED
    naming the full disk, no server path, the next client served, nothing left behind. The disk
    is a tmpfs mounted for the test (root, as on the CI machines)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        assert models["wide"].stat().st_size > 24 << 20     # over half the disk: its copies cannot fit
        server = ServerProcess(disk / "work", "--workers", "1")
        try:
            with Client(server.target) as client:
                error = _error(lambda: client.optimize(models["wide"], tmp_path / "never.onnx", measure=False,
                                                       timeout_seconds=300))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            assert "disk is full" in error.details() and str(disk) not in error.details(), error.details()
            assert _health(server.target) == "SERVING"
            _served(server, models, tmp_path)
            assert server.wait_no_leftovers() == []
        finally:
            server.kill()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
