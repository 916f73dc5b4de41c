"""The gRPC service end to end: a real `graphopt serve` process on a loopback port, the
Python client, real training graphs in real ONNX Runtime (in the server's workers)."""
from __future__ import annotations

import hashlib
import json
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
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from onnx import TensorProto, helper, numpy_helper

from graphopt.examples import training_example
from graphopt.ingest import load_model
from graphopt.optimize import OptimizeOptions, analyze_model, optimize, save_model
from graphopt.report import Report, summary_text
from graphopt.search import DEFAULT_STRATEGY, STRATEGIES
from graphopt_service._proto import graphopt_pb2 as pb
from graphopt_service._proto import graphopt_pb2_grpc as pb_grpc
from graphopt_service.client import Client, make_options
from service_process import ServerProcess

MAX_MODEL_BYTES = 300 * 10**6


# -- models ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    paths = {}
    # "slow": a 4+ MiB upload (its optimize takes about 3 s here); "long": the full-size resnet
    # example, whose optimize takes 13 s or more here (a job that outlasts a short deadline)
    for name, example, size in (("resnet", "resnet", dict(small=True)), ("mlp", "mlp", dict(small=True)),
                                ("slow", "mlp", dict(batch=512, width=384, depth=10, d_in=256)),
                                ("long", "resnet", {})):
        model, _ = training_example(example, **size)
        paths[name] = folder / f"{name}.onnx"
        save_model(model, paths[name])
    # the same resnet with every initializer as external data in a sub-folder
    model, _ = training_example("resnet", small=True)
    (folder / "ext" / "weights").mkdir(parents=True)
    onnx.save(model, folder / "ext" / "model.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights/w.bin", size_threshold=0)
    paths["external"] = folder / "ext" / "model.onnx"
    return paths


def _same_graph(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    """Nodes (in order, with inputs, outputs, attributes) and initializers equal; metadata may differ."""
    assert [n.SerializeToString(deterministic=True) for n in a.graph.node] == \
           [n.SerializeToString(deterministic=True) for n in b.graph.node]
    assert {t.name: numpy_helper.to_array(t).tobytes() for t in a.graph.initializer} == \
           {t.name: numpy_helper.to_array(t).tobytes() for t in b.graph.initializer}
    assert [o.name for o in a.graph.output] == [o.name for o in b.graph.output]


def _code(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, (dict, list)):
            list(result)
    return info.value


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("srv") / "work", "--workers", "2", "--queue", "4",
                         "--max-model-bytes", str(MAX_MODEL_BYTES))
    yield proc
    proc.kill()


@pytest.fixture
def client(server):
    with Client(server.target) as c:
        yield c


# -- the contract's code is generated from the proto -------------------------------------------
def test_stubs_are_generated_from_the_proto():
    result = subprocess.run([sys.executable, "-m", "graphopt_service.gen_proto", "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- what works --------------------------------------------------------------------------------
def test_python_client_gets_the_in_process_graph(client, models, tmp_path):
    # feng-huang plans on measured bytes only, so both runs plan alike (auto breaks ties by
    # seconds); without measurement, so that which graph comes back does not hang on this tiny
    # model's peaks (20-80 KiB: page-level noise decides the never-worse comparison)
    unmeasured = client.optimize(models["resnet"], tmp_path / "unmeasured.onnx", strategy="feng-huang",
                                 measure=False)
    local = optimize(load_model(models["resnet"]), OptimizeOptions(strategy="feng-huang", measure=False))
    _same_graph(onnx.load(tmp_path / "unmeasured.onnx"), local.model)
    assert unmeasured.checkpoints == local.report.checkpoints and unmeasured.outcome == "unmeasured"
    assert unmeasured.solver_exact == local.report.solver_exact is not None
    (tmp_path / "unmeasured.onnx").unlink()
    # measured: the typed report, as the library's (the options arrived under the library's names)
    progress = []
    report = client.optimize(models["resnet"], tmp_path / "opt.onnx", strategy="feng-huang",
                             progress=lambda stage, fraction: progress.append((stage, fraction)))
    assert report.outputs_match and report.order_followed
    # (the peaks of this tiny model can measure 0: its buffers fit in pages the process already had)
    measured = report.measured
    assert measured.optimized.step_seconds > 0 and measured.optimized.peak_bytes >= 0
    if report.outcome == "optimized":   # returned only below the original in both sessions
        assert measured.optimized.peak_bytes < min(measured.original_default_session.peak_bytes,
                                                   measured.original_optimizations_off.peak_bytes), measured
    assert report.measurement_method
    assert report.provider == "CPUExecutionProvider"
    # said of the plan returned, never of one rejected for the original
    assert (report.solver_exact is not None) == (report.outcome == "optimized"), report.outcome
    stages = [s for s, _ in progress]
    assert stages[0] == "queued" and {"annotate", "plan", "rewrite", "verify", "measure"} <= set(stages)
    fractions = [f for _, f in progress]
    assert fractions == sorted(fractions) and fractions[-1] < 1.0
    assert [p.name for p in tmp_path.iterdir()] == ["opt.onnx"]   # no staging folder left


def test_report_message_carries_the_summary_and_headline_fields(client, models):
    """The proto's Report: the library's report as JSON, its headline fields, and the one summary
    text (graphopt.report.summary_text) that every client prints."""
    message = list(client.optimize_call(models["mlp"], strategy="chen-sqrt", measure=False))[-1].report
    report = Report.from_dict(json.loads(message.json))
    assert message.summary == summary_text(report) and "strategy chen-sqrt" in message.summary
    assert message.HasField("order_followed") and message.order_followed == report.order_followed
    assert report.order_followed is True and report.outputs_match is True
    assert message.outcome == report.outcome == "unmeasured" and message.provider == report.provider != ""
    assert message.measurement_method == "" and report.measured is None
    assert message.HasField("solver_exact") == (report.solver_exact is not None)


def test_objective_and_max_overhead_travel_under_the_library_names():
    """make_options -> the proto -> the server's job options -> OptimizeOptions: the same values;
    unset fields stay unset (the library's defaults apply on the server)."""
    from graphopt.options import BOUNDED_OVERHEAD, LEAST_PEAK
    from graphopt_service.server import job_options
    for options in (OptimizeOptions(), OptimizeOptions(objective=LEAST_PEAK),
                    OptimizeOptions(max_overhead=0.0), OptimizeOptions(objective=BOUNDED_OVERHEAD, max_overhead=0.35),
                    OptimizeOptions(budget_bytes=1 << 20, max_overhead=0.5, strategy="chen-greedy"),
                    OptimizeOptions(graph_optimizations="none"), OptimizeOptions(graph_optimizations="basic"),
                    OptimizeOptions(memory_limit_bytes=3 << 30)):
        message = make_options(options)
        assert message.HasField("objective") == (options.objective != BOUNDED_OVERHEAD)
        assert message.HasField("max_overhead") == (options.max_overhead is not None)
        assert message.HasField("graph_optimizations") == (options.graph_optimizations != "extended")
        library, _ = job_options(pb.OptimizeOptions.FromString(message.SerializeToString()), max_threads=1)
        back = OptimizeOptions.from_dict(library)
        assert message.HasField("memory_limit_bytes") == (options.memory_limit_bytes is not None)
        assert (back.objective, back.max_overhead, back.budget_bytes, back.graph_optimizations,
                back.memory_limit_bytes) == (options.objective, options.max_overhead, options.budget_bytes,
                                             options.graph_optimizations, options.memory_limit_bytes)


def test_objective_reaches_the_library_and_comes_back_in_the_report(client, models, tmp_path):
    # unmeasured: the limit holds the plan's predicted step time (the baseline is predicted too,
    # from timed annotations: the seconds differ from run to run, the objective does not)
    local = optimize(load_model(models["mlp"]), OptimizeOptions(max_overhead=0.05, measure=False)).report.objective
    message = list(client.optimize_call(models["mlp"], max_overhead=0.05, measure=False))[-1].report
    report = Report.from_dict(json.loads(message.json))
    assert (report.objective.name, report.objective.max_overhead, report.objective.baseline) == \
           (local.name, local.max_overhead, local.baseline)
    assert report.objective.name == message.objective == "bounded-overhead"
    assert message.HasField("max_overhead") and message.max_overhead == report.objective.max_overhead == 0.05
    assert not message.HasField("measured_overhead") and not message.HasField("objective_met")
    assert "objective bounded-overhead: step time at most 1.05x" in message.summary
    least = client.optimize(models["mlp"], tmp_path / "least.onnx", objective="least-peak", measure=False)
    assert least.objective.name == "least-peak" and least.objective.max_overhead is None


def test_external_data_travels_with_the_model(client, models, tmp_path):
    client.optimize(models["external"], tmp_path / "opt.onnx", strategy="feng-huang", measure=False)
    local = optimize(load_model(models["resnet"]), OptimizeOptions(strategy="feng-huang", measure=False))
    _same_graph(load_model(tmp_path / "opt.onnx"), local.model)


def test_analyze_matches_the_library(client, models):
    remote = client.analyze(models["resnet"], plan=True, strategy="feng-huang")
    local = analyze_model(load_model(models["resnet"]), OptimizeOptions(strategy="feng-huang"), plan=True).to_dict()
    assert remote["predicted_peak_bytes"] == local["predicted_peak_bytes"]
    assert remote["tensor_bytes"] == local["tensor_bytes"]
    assert remote["plan"]["checkpoints"] == local["plan"]["checkpoints"]
    assert remote["peaks_explained"] == local["peaks_explained"]


def test_list_strategies(client):
    listed = client.list_strategies()
    assert [s.name for s in listed] == list(STRATEGIES)
    assert [s.name for s in listed if s.is_default] == [DEFAULT_STRATEGY]


def test_reflection_describes_the_service(server):
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(stub.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="graphopt.v1.Graphopt")])))
    services = {s.name for s in answers[0].list_services_response.service}
    assert {"graphopt.v1.Graphopt", "grpc.health.v1.Health"} <= services
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in answers[1].file_descriptor_response.file_descriptor_proto]
    methods = {m.name for f in files if f.package == "graphopt.v1" for s in f.service for m in s.method}
    assert methods == {"Optimize", "Analyze", "ListStrategies"}


def test_a_200_mb_model_streams_through(client, tmp_path):
    # ~200 MB of weights in an external-data file; the result comes back as one 200 MB model
    model, _ = training_example("mlp", batch=4, width=2048, depth=12, d_in=2048)
    weights = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    assert weights > 200 * 10**6
    digest = lambda m: {t.name: hashlib.sha256(numpy_helper.to_array(t).tobytes()).hexdigest()
                        for t in m.graph.initializer}
    expected = digest(model)   # onnx.save below moves the weights out of `model`
    (tmp_path / "big").mkdir()
    onnx.save(model, tmp_path / "big" / "model.onnx", save_as_external_data=True,
              all_tensors_to_one_file=True, location="model.bin")
    report = client.optimize(tmp_path / "big" / "model.onnx", tmp_path / "out" / "opt.onnx",
                             strategy="chen-sqrt", measure=False)
    assert report.outputs_match
    returned = digest(load_model(tmp_path / "out" / "opt.onnx"))
    # every weight comes back bit for bit; only small constants ORT's graph optimizations left
    # unused (e.g. a Reshape's shape) may be gone
    parameters = {o.name[:-len("_grad")] for o in model.graph.output if o.name.endswith("_grad")}
    assert parameters and parameters <= set(returned)
    assert all(expected[name] == value for name, value in returned.items() if name in expected)
    assert all(name in expected for name in returned), set(returned) - set(expected)


# -- bad input: each gets its status, nothing is left behind, the server goes on ---------------
def _requests(options: pb.OptimizeOptions | None, files: list[tuple[str, bytes]], *,
              declared_sizes: dict | None = None, digests: dict | None = None, cut_at: dict | None = None):
    if options is not None:
        yield pb.OptimizeRequest(options=options)
    for name, data in files:
        size = (declared_sizes or {}).get(name, len(data))
        digest = (digests or {}).get(name, hashlib.sha256(data).hexdigest())
        yield pb.OptimizeRequest(file=pb.FileHeader(path=name, size_bytes=size, sha256=digest))
        data = data[:(cut_at or {}).get(name, len(data))]
        for offset in range(0, len(data), 1 << 16):
            yield pb.OptimizeRequest(chunk=pb.FileChunk(offset=offset, data=data[offset:offset + (1 << 16)]))


def _cyclic_model() -> bytes:
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="first"),
             helper.make_node("Relu", ["a"], ["b"], name="second"),
             helper.make_node("ReduceSum", ["b"], ["loss"], name="loss", keepdims=0)]
    graph = helper.make_graph(nodes, "cycle", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    return helper.make_model(graph).SerializeToString()


def _model_with_external_data_outside() -> bytes:
    tensor = numpy_helper.from_array(np.ones(4, np.float32), "w")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="../../../etc/passwd")
    node = helper.make_node("Mul", ["x", "w"], ["loss"], name="mul")
    graph = helper.make_graph([node], "outside", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [4])], [tensor])
    return helper.make_model(graph).SerializeToString()


def _unsupported_op_model() -> bytes:
    model, _ = training_example("mlp", small=True)
    model.graph.node[0].domain = "com.example.custom"
    model.opset_import.add(domain="com.example.custom", version=1)
    return model.SerializeToString()


def _bad_requests(models) -> dict[str, tuple[grpc.StatusCode, str, list]]:
    good = models["resnet"].read_bytes()
    opts = make_options(measure=False)
    return {
        "truncated stream": (grpc.StatusCode.INVALID_ARGUMENT, "truncated",
                             list(_requests(opts, [("m.onnx", good)], cut_at={"m.onnx": len(good) // 2}))),
        "bad checksum": (grpc.StatusCode.INVALID_ARGUMENT, "checksum",
                         list(_requests(opts, [("m.onnx", good)], digests={"m.onnx": "0" * 64}))),
        "not ONNX": (grpc.StatusCode.INVALID_ARGUMENT, "not",
                     list(_requests(opts, [("m.onnx", b"\xff\xfe certainly not a protobuf \x00" * 50)]))),
        "cyclic graph": (grpc.StatusCode.INVALID_ARGUMENT, "cycle",
                         list(_requests(opts, [("m.onnx", _cyclic_model())]))),
        "external data pointing outside": (grpc.StatusCode.INVALID_ARGUMENT, "outside",
                                           list(_requests(opts, [("m.onnx", _model_with_external_data_outside())]))),
        "file path pointing outside": (grpc.StatusCode.INVALID_ARGUMENT, "outside",
                                       list(_requests(opts, [("m.onnx", good), ("../escape.bin", b"x")]))),
        "over the size limit": (grpc.StatusCode.RESOURCE_EXHAUSTED, "limit",
                                list(_requests(opts, [("m.onnx", good)],
                                               declared_sizes={"m.onnx": MAX_MODEL_BYTES + 1}))),
        "no options first": (grpc.StatusCode.INVALID_ARGUMENT, "options",
                             list(_requests(None, [("m.onnx", good)]))),
        "unknown strategy": (grpc.StatusCode.INVALID_ARGUMENT, "strategy",
                             list(_requests(make_options(strategy="magic"), [("m.onnx", good)]))),
        "unknown objective": (grpc.StatusCode.INVALID_ARGUMENT, "unknown objective 'fastest'",
                              list(_requests(make_options(objective="fastest", measure=False), [("m.onnx", good)]))),
        "negative max overhead": (grpc.StatusCode.INVALID_ARGUMENT, "max overhead",
                                  list(_requests(make_options(max_overhead=-0.5, measure=False),
                                                 [("m.onnx", good)]))),
        "least-peak with a max overhead": (grpc.StatusCode.INVALID_ARGUMENT, "least-peak takes no max overhead",
                                           list(_requests(make_options(objective="least-peak", max_overhead=0.1,
                                                                       measure=False), [("m.onnx", good)]))),
        "unsupported operator": (grpc.StatusCode.UNIMPLEMENTED, "com.example.custom",
                                 list(_requests(opts, [("m.onnx", _unsupported_op_model())]))),
        "budget infeasible": (grpc.StatusCode.FAILED_PRECONDITION, "budget",
                              list(_requests(make_options(budget_bytes=1, measure=False, plan=True), [("m.onnx", good)]))),
    }


def test_every_bad_input_gets_its_status_and_the_server_goes_on(server, models):
    stub_channel = grpc.insecure_channel(server.target)
    stub = pb_grpc.GraphoptStub(stub_channel)
    health = health_pb2_grpc.HealthStub(stub_channel)
    failures = []
    for case, (code, words, requests) in _bad_requests(models).items():
        for method in (stub.Optimize, stub.Analyze):
            try:
                answer = method(iter(requests), timeout=120)
                if method is stub.Optimize:
                    list(answer)
                failures.append(f"{case}: {method._method} succeeded")
            except grpc.RpcError as error:
                if error.code() != code or words.lower() not in error.details().lower():
                    failures.append(f"{case}: {method._method} got {error.code().name}: {error.details()}")
                if str(server.work_dir) in error.details():
                    failures.append(f"{case}: the message shows the server's folders: {error.details()}")
                if case == "budget infeasible" and method is stub.Optimize:
                    metadata = dict(error.trailing_metadata() or ())
                    if int(metadata.get("graphopt-least-feasible-peak-bytes", 0)) <= 0:
                        failures.append(f"{case}: no least feasible peak in the trailing metadata")
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            if status != health_pb2.HealthCheckResponse.SERVING:
                failures.append(f"{case}: health answered {status} afterwards")
    stub_channel.close()
    assert not failures, "\n".join(failures)
    assert server.wait_no_leftovers() == []
    # each call's "call finished" is logged after its status reached the client: wait for them
    for status in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNIMPLEMENTED", "FAILED_PRECONDITION"):
        server.wait_for_log("call finished", status=status)


def _first_progress_after(call, stage: str) -> None:
    for response in call:
        if response.WhichOneof("item") == "progress" and response.progress.stage == stage:
            return
    raise AssertionError(f"the call ended before stage {stage!r}")


def test_a_cancelled_call_stops_its_worker(server, client, models):
    call = client.optimize_call(models["long"], strategy="feng-huang")
    _first_progress_after(call, "plan")
    call.cancel()
    stopped = server.wait_for_log("stopping a worker")
    assert stopped["worker_pid"] > 0
    entry = server.wait_for_log("call finished", status="CANCELLED")
    assert entry["method"] == "Optimize"
    assert client.health() == "SERVING"
    assert server.wait_no_leftovers() == []


def test_an_expired_deadline_stops_the_work(server, client, models, tmp_path):
    before = len([e for e in server.logs() if e.get("message") == "stopping a worker"])
    started = time.monotonic()
    error = _code(client.optimize, models["long"], tmp_path / "never.onnx", timeout_seconds=3.0)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 15
    deadline = time.monotonic() + 15
    while len([e for e in server.logs() if e.get("message") == "stopping a worker"]) == before:
        assert time.monotonic() < deadline, "the server kept working after the deadline"
        time.sleep(0.1)
    assert not (tmp_path / "never.onnx").exists() and list(tmp_path.iterdir()) == []
    assert client.health() == "SERVING"
    # the replacement worker takes new work
    assert client.optimize(models["mlp"], tmp_path / "after.onnx", measure=False).outputs_match


# -- a server of one worker and no queue; SIGTERM drains ----------------------------------------
def test_a_full_queue_is_refused_and_sigterm_drains(tmp_path, models):
    server = ServerProcess(tmp_path / "work", "--workers", "1", "--queue", "0", "--drain-seconds", "60")
    try:
        with Client(server.target) as client:
            results = {}
            busy = threading.Thread(target=lambda: results.update(report=client.optimize(
                models["long"], tmp_path / "slow.onnx", strategy="feng-huang")))
            busy.start()
            server.wait_for_log("call admitted")   # its upload is complete: it holds the one slot
            error = _code(client.optimize, models["mlp"], tmp_path / "refused.onnx", measure=False)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in error.details()

            assert server.proc.poll() is None
            server.proc.send_signal(15)
            server.wait_for_log("draining")
            assert client.health() == "NOT_SERVING"
            error = _code(client.optimize, models["mlp"], tmp_path / "late.onnx", measure=False)
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            busy.join(120)
            assert results["report"].outputs_match        # the call in flight finished
        assert server.proc.wait(60) == 0
        assert not (tmp_path / "work").exists() or server.leftover_files() == []
    finally:
        server.kill()


def test_an_upload_in_progress_at_sigterm_is_finished_and_served(tmp_path, models):
    """A call whose upload began before SIGTERM is in flight: the drain waits for it, and it is
    admitted and served, not refused as new work once its last byte arrives."""
    from graphopt_service.client import upload_messages
    server = ServerProcess(tmp_path / "work", "--workers", "1", "--drain-seconds", "60")
    try:
        def upload():     # the options and the model's header and first bytes, SIGTERM, the rest
            for k, message in enumerate(upload_messages(models["mlp"], make_options(measure=False), 4096)):
                if k == 3:
                    server.wait_for_log("call started", method="Optimize")
                    server.proc.send_signal(signal.SIGTERM)
                    server.wait_for_log("draining")
                yield message
        with Client(server.target) as client:
            responses = list(client.stub.Optimize(upload(), timeout=120))
        assert responses[-1].WhichOneof("item") == "report", responses[-1]
        assert json.loads(responses[-1].report.json)["outputs_match"] is True
        assert server.proc.wait(60) == 0
        assert server.entries("call finished", method="Optimize")[0]["status"] == "OK"
    finally:
        server.kill()


def test_a_stopped_server_exits_though_a_thread_is_still_in_a_call():
    """After its stop, the server's process ends although a (non-daemon) thread is blocked in
    this package's code, as a call's handler that never returned would be: the interpreter's exit
    would join it for ever, and Kubernetes would SIGKILL the pod at the end of its grace period.
    The thread is named in the log, with where it is."""
    script = "\n".join([
        "import logging, threading",
        "from graphopt_service import server",
        "from graphopt_service.logs import configure",
        "configure(logging.INFO)",
        "namespace = {'threading': threading}",
        # a function whose code counts as the server module's, blocked for ever
        "exec(compile('def handler():\\n    threading.Event().wait()\\n', server.__file__, 'exec'), namespace)",
        "threading.Thread(target=namespace['handler'], name='rpc_7').start()",
        "threading.Thread(target=threading.Event().wait, name='elsewhere').start()",
        "server.exit_process(0)",
    ])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    entries = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    (warning,) = [e for e in entries if e["message"] == "threads still in calls at exit"]
    assert [t["thread"] for t in warning["threads"]] == ["rpc_7"], warning
    assert "server.py:2 handler" in warning["threads"][0]["at"], warning


# -- TLS and a bearer token ---------------------------------------------------------------------
def test_tls_and_bearer_token(tmp_path, models):
    import trustme as tm   # in the test extra
    ca = tm.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "token").write_text("s3cret\n")
    server = ServerProcess(tmp_path / "work", "--workers", "1", "--tls-cert", str(tmp_path / "cert.pem"),
                           "--tls-key", str(tmp_path / "key.pem"), "--token-file", str(tmp_path / "token"))
    try:
        with Client(server.target, tls_ca_path=str(tmp_path / "ca.pem")) as anonymous:
            assert anonymous.health() == "SERVING"            # probes need no token
            error = _code(anonymous.list_strategies)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(server.target, token="wrong", tls_ca_path=str(tmp_path / "ca.pem")) as wrong:
            assert _code(wrong.list_strategies).code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(server.target, token="s3cret", tls_ca_path=str(tmp_path / "ca.pem")) as client:
            assert client.list_strategies()
            assert client.optimize(models["mlp"], tmp_path / "opt.onnx", measure=False).outputs_match
        with Client(server.target, token="s3cret") as plaintext:  # no TLS against a TLS port
            assert _code(plaintext.list_strategies, timeout_seconds=5).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.kill()


def test_cli_uses_the_server(server, models, tmp_path):
    result = subprocess.run([sys.executable, "-m", "graphopt.cli", "optimize", str(models["mlp"]), "-o",
                             str(tmp_path / "opt.onnx"), "--server", server.target, "--no-measure",
                             "--strategy", "feng-huang"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"server {server.target}" in result.stdout and (tmp_path / "opt.onnx").is_file()


def test_cli_sends_objective_and_max_overhead_to_the_server(server, models, tmp_path):
    report_path = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "graphopt.cli", "optimize", str(models["mlp"]), "-o",
                             str(tmp_path / "opt.onnx"), "--server", server.target, "--no-measure",
                             "--max-overhead", "0.3", "--report", str(report_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    objective = json.loads(report_path.read_text())["objective"]
    assert objective["name"] == "bounded-overhead" and objective["max_overhead"] == 0.3
    result = subprocess.run([sys.executable, "-m", "graphopt.cli", "optimize", str(models["mlp"]), "-o",
                             str(tmp_path / "no.onnx"), "--server", server.target, "--no-measure",
                             "--objective", "least-peak", "--max-overhead", "0.3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "INVALID_ARGUMENT: objective least-peak takes no max overhead" in result.stderr, result.stderr
    assert not (tmp_path / "no.onnx").exists()


def test_cli_names_a_bad_model_sent_to_a_server(server, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"nope")
    result = subprocess.run([sys.executable, "-m", "graphopt.cli", "optimize", str(bad), "-o",
                             str(tmp_path / "x.onnx"), "--server", server.target],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    # one clear line naming the problem (the client's check or the server's INVALID_ARGUMENT)
    assert "is not a readable ONNX model" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "UNKNOWN" not in result.stderr, result.stderr


def test_message_size_limits_are_configurable_on_both_sides(tmp_path, models):
    # A server and a client that take at most 256 KiB per message still move a multi-MiB model;
    # a client sending bigger chunks than the server takes is refused by gRPC itself.
    assert models["slow"].stat().st_size > 4 << 20
    server = ServerProcess(tmp_path / "work", "--workers", "1", "--max-message-bytes", "256KiB")
    try:
        with Client(server.target, max_message_bytes=256 << 10, chunk_bytes=128 << 10) as client:
            report = client.optimize(models["slow"], tmp_path / "opt.onnx", measure=False,
                                     strategy="chen-sqrt", response_chunk_bytes=128 << 10)
            assert report.outputs_match and (tmp_path / "opt.onnx").stat().st_size > 4 << 20
        with Client(server.target, chunk_bytes=1 << 20) as big_chunks:
            error = _code(big_chunks.optimize, models["slow"], tmp_path / "no.onnx", measure=False)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with Client(server.target, max_message_bytes=64 << 10, chunk_bytes=32 << 10) as small_receiver:
            error = _code(small_receiver.optimize, models["slow"], tmp_path / "no.onnx", measure=False)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED   # the client's own limit
        assert server.wait_no_leftovers() == []
    finally:
        server.kill()


def _children(pid: int, command_part: str) -> list[int]:
    """Child processes of `pid` whose command line contains `command_part` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and command_part in command:
            found.append(int(stat.parent.name))
    return found


def test_a_worker_that_dies_fails_only_its_call(tmp_path, models):
    # what the kernel's out-of-memory killer would do to a worker in the middle of a model
    server = ServerProcess(tmp_path / "work", "--workers", "1")
    try:
        with Client(server.target) as client:
            call = client.optimize_call(models["long"], strategy="feng-huang")
            _first_progress_after(call, "annotate")
            workers = _children(server.proc.pid, "graphopt_service.worker")
            assert len(workers) == 1
            os.kill(workers[0], signal.SIGKILL)
            error = _code(list, call)
            assert error.code() == grpc.StatusCode.INTERNAL and "worker process died" in error.details()
            assert client.health() == "SERVING"
            assert client.optimize(models["mlp"], tmp_path / "after.onnx", measure=False).outputs_match
        assert server.wait_no_leftovers() == []
    finally:
        server.kill()


def test_a_step_that_does_not_fit_comes_back_running_under_the_limit(client, models, tmp_path):
    """`memory_limit_bytes` through the service at 0.9x what the original needs: the original
    fails under it, the returned model runs under it (ONNX Runtime capped, in runs of their own
    here), and the worker annotated it at reduced batches, never running it at full size. A
    limit nothing meets is FAILED_PRECONDITION, as a budget is."""
    from graphopt.inputs import save_inputs, synthesize_inputs
    from graphopt.runtime.limit import initializer_bytes
    from graphopt.runtime.measure import measure, run_within_limit
    from graphopt.runtime.session import DEFAULT_SETTINGS
    model = load_model(models["slow"])
    inputs = synthesize_inputs(model)
    inputs_path = tmp_path / "inputs.npz"
    save_inputs(inputs_path, inputs)
    step = measure(models["slow"], inputs_path, DEFAULT_SETTINGS, timing=False).peak_bytes
    need = initializer_bytes(model) + sum(v.nbytes for v in inputs.values()) + step
    with pytest.raises(grpc.RpcError) as refused:
        client.optimize(models["slow"], tmp_path / "never.onnx", memory_limit_bytes=int(0.5 * need))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "memory limit of" in refused.value.details() and not (tmp_path / "never.onnx").exists()
    limit = int(0.9 * need)
    report = client.optimize(models["slow"], tmp_path / "fits.onnx", memory_limit_bytes=limit)
    assert report.outcome == "optimized" and report.memory_limit.met and report.reduced is not None
    assert max(report.reduced.annotated_batches) < report.reduced.full_batch
    assert not run_within_limit(models["slow"], inputs_path, limit, DEFAULT_SETTINGS).fits
    assert run_within_limit(tmp_path / "fits.onnx", inputs_path, limit).fits
