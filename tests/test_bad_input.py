"""No bad input prints a traceback: every bad model and option of the test corpus (the ones
test_ingest_analyze, test_cli, test_forms, test_service and test_service_fuzz refuse, and a model
whose IR version or operator set is newer than the installed ONNX Runtime reads) is run through
the `graphopt` command line in a real subprocess, and through a real `graphopt serve`: each ends
with its one-line error (exit 2, or the service's status) and "Traceback" appears nowhere in what
the command printed or in what the server logged."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.examples import forward_example, training_example
from graphopt.optimize import save_model
from test_ingest_analyze import _tiny, _tiny_nodes
from test_service import _cyclic_model, _model_with_external_data_outside, _unsupported_op_model


def _newer(model: onnx.ModelProto, *, ir_version: int | None = None, domain: str | None = None) -> onnx.ModelProto:
    """`model` claiming IR version 99, or operator set 99 of `domain`: newer than any onnxruntime reads."""
    if ir_version is not None:
        model.ir_version = ir_version
    if domain is not None:
        found = [o for o in model.opset_import if o.domain == domain]
        if found:
            found[0].version = 99
        else:
            model.opset_import.append(helper.make_opsetid(domain, 99))
    return model


def _external_data_missing() -> onnx.ModelProto:
    tensor = numpy_helper.from_array(np.ones((3, 2), np.float32), "W")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="missing.bin")
    model = _tiny()
    del model.graph.initializer[:]
    model.graph.initializer.append(tensor)
    return model


def _ghost_tensor() -> onnx.ModelProto:
    nodes = _tiny_nodes()
    nodes[3] = helper.make_node("Mul", ["y", "ghost_tensor"], ["gy"], name="gy")
    return _tiny(nodes)


def _produced_twice() -> onnx.ModelProto:
    nodes = _tiny_nodes()
    nodes[3] = helper.make_node("Neg", ["y"], ["y"], name="again")
    return _tiny(nodes)


def bad_models(folder: Path) -> dict[str, Path]:
    """The corpus's bad model files, written under `folder`, by what is wrong with each."""
    folder.mkdir(parents=True, exist_ok=True)
    good, _ = training_example("mlp", small=True)
    models = {
        "cyclic graph": onnx.load_from_string(_cyclic_model()),
        "external data pointing outside": onnx.load_from_string(_model_with_external_data_outside()),
        "external data missing": _external_data_missing(),
        "unsupported operator": onnx.load_from_string(_unsupported_op_model()),
        "only the loss as output": _tiny(outputs=("loss",)),
        "no outputs": _tiny(outputs=()),
        "a tensor nobody produces": _ghost_tensor(),
        "a tensor produced twice": _produced_twice(),
        "an output nobody produces": _tiny(extra_outputs=("phantom_grad",)),
        "a forward model": forward_example("mlp", small=True),
        "IR version 99": _newer(training_example("mlp", small=True)[0], ir_version=99),
        "ai.onnx operator set 99": _newer(training_example("mlp", small=True)[0], domain=""),
        "ai.onnx.ml operator set 99": _newer(training_example("mlp", small=True)[0], domain="ai.onnx.ml"),
        "com.microsoft operator set 99": _newer(training_example("mlp", small=True)[0], domain="com.microsoft"),
    }
    paths = {}
    for case, model in models.items():
        paths[case] = folder / (case.replace(" ", "_") + ".onnx")
        save_model(model, paths[case])
    written = good.SerializeToString()
    raw = {"not ONNX": b"\x00\x01garbage" * 10, "an empty file": b"",
           "a truncated model": written[:len(written) // 2]}
    for case, data in raw.items():
        paths[case] = folder / (case.replace(" ", "_") + ".onnx")
        paths[case].write_bytes(data)
    paths["a file that does not exist"] = folder / "absent.onnx"
    return paths


# bad training graphs that are good models: `measure` runs any model ONNX Runtime loads
MEASURABLE = ("only the loss as output", "a forward model")


def _graphopt(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphopt.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def _runs(folder: Path) -> dict[str, list]:
    """(what, the command's arguments) for every bad input through the commands that read a model,
    and the bad options on a good model."""
    models = bad_models(folder)
    out = folder / "out.onnx"
    runs = {}
    for case, path in models.items():
        runs[f"optimize, {case}"] = ["optimize", path, "-o", out, "--no-measure"]
        runs[f"analyze, {case}"] = ["analyze", path]
        if case not in MEASURABLE:
            runs[f"measure, {case}"] = ["measure", path, "--repeats", "1"]
    good = folder / "good.onnx"
    save_model(training_example("mlp", small=True)[0], good)
    forward = folder / "forward.onnx"
    save_model(forward_example("mlp", small=True), forward)
    for case in ("IR version 99", "ai.onnx operator set 99", "not ONNX", "cyclic graph"):
        runs[f"train-graph, {case}"] = ["train-graph", models[case], "-o", out]
    runs.update({
        "an infeasible budget": ["optimize", good, "-o", out, "--budget", "1", "--no-measure"],
        "an unknown provider": ["optimize", good, "-o", out, "--provider", "NoSuchExecutionProvider"],
        "an unknown graph optimization level": ["optimize", good, "-o", out, "--graph-optimizations", "all"],
        "an unknown objective": ["optimize", good, "-o", out, "--objective", "fastest"],
        "a negative tolerance": ["optimize", good, "-o", out, "--tolerance", "-1"],
        "an unknown loss": ["train-graph", forward, "-o", out, "--loss", "hinge"],
        "a training graph given to train-graph": ["train-graph", good, "-o", out],
    })
    return runs


def test_no_bad_input_prints_a_traceback_from_the_command_line(tmp_path):
    runs = _runs(tmp_path)
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(runs, pool.map(lambda args: _graphopt(*args), runs.values())))
    failures = []
    for case, proc in done.items():
        if "Traceback" in proc.stdout + proc.stderr:
            failures.append(f"{case}: a traceback:\n{proc.stdout}{proc.stderr}")
        elif proc.returncode != 2:
            failures.append(f"{case}: exit {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    assert not failures, "\n\n".join(failures)
    assert not (tmp_path / "out.onnx").exists()
    # the versions are refused by name, before any work: no stage of optimize was reached
    for case, words in (("IR version 99", ("IR version is 99", "up to")),
                        ("ai.onnx operator set 99", ("'ai.onnx' version 99", "up to"))):
        proc = done[f"optimize, {case}"]
        assert all(w in proc.stderr for w in words), proc.stderr
        assert "graph optimizations" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_no_bad_model_prints_a_traceback_through_the_service(tmp_path):
    """Every bad model of the corpus sent to a real `graphopt serve` (Analyze and Optimize): each
    call ends with its status (or the client's own one-line refusal before any upload), and neither
    its details nor the server's log holds a traceback."""
    import grpc

    from graphopt.errors import GraphoptError
    from graphopt_service.client import Client
    from service_process import ServerProcess

    models = {case: path for case, path in bad_models(tmp_path / "models").items() if path.exists()}
    server = ServerProcess(tmp_path / "work", "--workers", "1")
    failures = []
    try:
        with Client(server.target) as client:
            for case, path in models.items():
                for method, call in (("Analyze", lambda: client.analyze(path, timeout_seconds=120)),
                                     ("Optimize", lambda: client.optimize(path, tmp_path / "out.onnx", measure=False,
                                                                          timeout_seconds=120))):
                    try:
                        call()
                        failures.append(f"{case}: {method} succeeded")
                    except grpc.RpcError as error:
                        if "Traceback" in (error.details() or ""):
                            failures.append(f"{case}: {method}: {error.code().name}: {error.details()}")
                    except GraphoptError as error:      # the client refused it before any upload
                        if "Traceback" in str(error):
                            failures.append(f"{case}: {method}, the client: {error}")
            assert client.health() == "SERVING"
        log = server.log_path.read_text()
    finally:
        server.kill()
    assert not failures, "\n\n".join(failures)
    assert "Traceback" not in log, log[-5000:]
    assert not (tmp_path / "out.onnx").exists()
