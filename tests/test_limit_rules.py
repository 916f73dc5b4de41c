"""The memory limit's parts one at a time (graphopt/runtime/limit.py, and the worker that runs a
step under a limit, graphopt/runtime/_limit_worker.py, called here in this process as its command
line would): ONNX Runtime's refusals recognised and their shortfall read, initializers' bytes
against numpy's, the providers a capped session is opened with, ONNX Runtime's arena refusing
past the cap by the bytes its message names, and the worker's accounting of what it holds outside
the cap (weights, inputs, the state a trainer binds: against the arrays' own nbytes). Seconds in
all; tests/test_memory_limit.py shows the same on the examples through `run_within_limit`."""
from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.inputs import save_inputs
from graphopt.runtime import _limit_worker
from graphopt.runtime.limit import (
    LIMIT_SESSION_CONFIG,
    initializer_bytes,
    out_of_memory,
    providers_within,
    shortfall_bytes,
)
from graphopt.runtime.session import UNOPTIMIZED_SETTINGS, SessionSettings, open_session

MIB = 1 << 20
REFUSAL = ("/onnxruntime/core/framework/bfc_arena.cc:360 void* onnxruntime::BFCArena::AllocateRawInternal"
           "(size_t, bool, onnxruntime::Stream*) Available memory of 1048576 is smaller than requested bytes of 4194304")


def test_the_refusals_of_an_allocation_are_recognised():
    for message in (REFUSAL, "CUDA failure 2: Failed to allocate memory for requested buffer",
                    "CUDA error: out of memory", "std::bad_alloc"):
        assert out_of_memory(message) and out_of_memory(RuntimeError("x\n" + message + "\ny")), message
    for message in ("", "Invalid input name: x", "available memory of", "Out Of Memory"):
        assert not out_of_memory(message) and not out_of_memory(RuntimeError(message)), message


def test_the_shortfall_is_what_was_asked_past_what_was_available():
    assert shortfall_bytes(REFUSAL) == 4194304 - 1048576
    assert shortfall_bytes(RuntimeError("before\n" + REFUSAL.replace("1048576", "0") + "\nafter")) == 4194304
    assert shortfall_bytes("Available memory of 7 is smaller than requested bytes of") is None
    assert shortfall_bytes("CUDA error: out of memory") is None


def test_initializer_bytes_are_numpys_from_the_declared_dims_and_types():
    arrays = {"w": np.ones((3, 4), np.float32), "i": np.arange(5, dtype=np.int64),
              "h": np.ones((2, 2), np.float16), "s": np.array(1.5, np.float64), "b": np.ones(7, np.bool_),
              "e": np.ones((0, 3), np.float32)}
    graph = helper.make_graph([], "g", [], [], [numpy_helper.from_array(v, k) for k, v in arrays.items()])
    model = helper.make_model(graph)
    assert initializer_bytes(model) == sum(v.nbytes for v in arrays.values()) == 48 + 40 + 8 + 8 + 7
    assert initializer_bytes(model, {"i", "h", "absent"}) == 48
    assert initializer_bytes(model, set()) == 0
    # the bytes are the declared ones: an initializer whose data lies elsewhere counts alike
    outside = onnx.TensorProto()
    outside.CopyFrom(model.graph.initializer[0])
    outside.ClearField("raw_data")
    outside.data_location = onnx.TensorProto.EXTERNAL
    outside.external_data.add(key="location", value="nowhere.bin")
    del model.graph.initializer[0]
    model.graph.initializer.append(outside)
    assert initializer_bytes(model) == 111
    assert type(initializer_bytes(model)) is int


def test_the_providers_of_a_capped_session():
    assert providers_within("CUDAExecutionProvider", 3 * MIB + 0.5) == [
        ("CUDAExecutionProvider", {"device_id": "0", "gpu_mem_limit": str(3 * MIB),
                                   "arena_extend_strategy": "kNextPowerOfTwo"}), "CPUExecutionProvider"]
    assert providers_within("CUDAExecutionProvider", 1, device_id=2)[0][1]["device_id"] == "2"
    assert providers_within("CPUExecutionProvider", 1) == ["CPUExecutionProvider"]
    for cap in (0, -1):
        with pytest.raises(ValueError, match=f"cannot be capped at {cap} bytes"):
            providers_within("CPUExecutionProvider", cap)
    with pytest.raises(ValueError, match="DmlExecutionProvider is not supported"):
        providers_within("DmlExecutionProvider", MIB)
    assert dict(LIMIT_SESSION_CONFIG) == {"session.disable_prepacking": "1", "session.use_env_allocators": "1",
                                          "session.use_device_allocator_for_initializers": "1"}


def _chain(n: int = 1 << 20) -> onnx.ModelProto:
    """x (4 MiB, fed from outside the arena) -> Relu -> Neg -> Abs: each step a 4 MiB buffer."""
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="r"), helper.make_node("Neg", ["a"], ["b"], name="n"),
             helper.make_node("Abs", ["b"], ["y"], name="abs")]
    graph = helper.make_graph(nodes, "chain", [vi("x", TensorProto.FLOAT, [n])], [vi("y", TensorProto.FLOAT, [n])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_cpu_arena_is_one_region_of_the_whole_cap():
    """ONNX Runtime's own refusal says what its arena had: under a 1 MiB cap the first 4 MiB
    buffer finds 1 MiB available (nothing allocated yet); under 5 MiB the one region is the whole
    cap, so the second 4 MiB buffer finds nothing available (no region may be added); under 9 MiB
    (two buffers live at once, and the arena's bookkeeping) the step runs."""
    x = {"x": np.ones(1 << 20, np.float32)}
    expected = {1 * MIB: "Available memory of 1048576 is smaller than requested bytes of 4194304",
                5 * MIB: "Available memory of 0 is smaller than requested bytes of 4194304"}
    for cap, refusal in expected.items():
        session = open_session(_chain(), UNOPTIMIZED_SETTINGS, providers=["CPUExecutionProvider"], cap_bytes=cap)
        with pytest.raises(Exception) as refused:
            session.run(None, x)
        assert out_of_memory(refused.value) and refusal in str(refused.value), (cap, str(refused.value)[-200:])
    session = open_session(_chain(), UNOPTIMIZED_SETTINGS, providers=["CPUExecutionProvider"], cap_bytes=9 * MIB)
    assert np.array_equal(session.run(None, x)[0], x["x"])


# -- the worker, in this process ------------------------------------------------------------
def _worker(tmp_path, model, inputs, limit, *extra) -> dict:
    path, inputs_path = tmp_path / "model.onnx", tmp_path / "inputs.npz"
    onnx.save(model, path)
    save_inputs(inputs_path, inputs)
    return _run(path, inputs_path, limit, *extra)


def _run(path, inputs_path, limit, *extra) -> dict:
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _limit_worker.main([str(path), str(inputs_path), "--limit", str(limit), *map(str, extra)]) == 0
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("{") and lines[-2] == ""
    return json.loads(lines[-1])


def _stateful(n: int = 1 << 18) -> tuple[onnx.ModelProto, dict]:
    """A trainer's step of its own: w_updated = w - x (1 MiB each) and a step count fed back (w
    and the count are inputs with initializers, as graphopt's training graphs have them), with an
    input the graph does not take among the inputs given."""
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Sub", ["w", "x"], ["w_updated"], name="update"),
             helper.make_node("Add", ["optimizer.step", "one"], ["optimizer.step_updated"], name="count"),
             helper.make_node("Relu", ["x"], ["r"], name="relu")]
    graph = helper.make_graph(
        nodes, "step", [vi("x", TensorProto.FLOAT, [n]), vi("w", TensorProto.FLOAT, [n]),
                        vi("optimizer.step", TensorProto.INT64, [])],
        [vi("w_updated", TensorProto.FLOAT, [n]), vi("optimizer.step_updated", TensorProto.INT64, []),
         vi("r", TensorProto.FLOAT, [n])],
        [numpy_helper.from_array(np.zeros(n, np.float32), "w"),
         numpy_helper.from_array(np.array(0, np.int64), "optimizer.step"),
         numpy_helper.from_array(np.array(1, np.int64), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, {"x": np.ones(n, np.float32), "unused": np.ones(1 << 16, np.float32)}


def test_the_worker_counts_weights_inputs_and_the_state_it_binds_outside_the_cap(tmp_path):
    """Oracle: the state a trainer binds (runtime.step_state.fed_back_outputs, here w and the step
    count) as numpy's nbytes of the arrays they replace, the weights as their arrays' nbytes,
    the inputs the graph takes (not the unused one)."""
    from graphopt.runtime.step_state import fed_back_outputs
    model, inputs = _stateful()
    assert sorted(fed_back_outputs(model).values()) == ["optimizer.step", "w"]
    weights = {t.name: numpy_helper.to_array(t).nbytes for t in model.graph.initializer}
    state = weights["w"] + weights["optimizer.step"]
    outside = sum(weights.values()) + inputs["x"].nbytes + state
    assert _limit_worker._fed_back_bytes(model) == state
    short = _worker(tmp_path, model, inputs, outside - 5)
    assert short == {"provider": "CPUExecutionProvider", "limit_bytes": outside - 5, "outside_bytes": outside,
                     "cap_bytes": -5, "steps": 0, "fits": False, "shortfall_bytes": 5,
                     "error": f"the weights, inputs and state buffers alone take {outside} bytes"}
    assert _run(tmp_path / "model.onnx", tmp_path / "inputs.npz", outside)["cap_bytes"] == 0
    for steps in ((), ("--steps", 1), ("--steps", 3)):
        room = _run(tmp_path / "model.onnx", tmp_path / "inputs.npz", outside + 8 * MIB, *steps,
                    "--device-id", 0, "--threads", 2)
        assert (room["fits"], room["error"], room["shortfall_bytes"]) == (True, None, None)
        assert (room["outside_bytes"], room["cap_bytes"], room["limit_bytes"]) == (outside, 8 * MIB, outside + 8 * MIB)
        assert room["steps"] == (steps[1] if steps else 2)       # two by default
        assert 0 < room["step_seconds"] < 10
        # the memory figures: the kernel's kB as bytes, growths of a few MiB (this process alone
        # is over 100 MiB: a figure that added it would be over 64 MiB)
        for key in ("rss_bytes", "session_rss_bytes", "steps_rss_bytes", "session_bytes"):
            assert isinstance(room[key], int) and room[key] % 1024 == 0 and 0 <= room[key] < 64 * MIB, (key, room)
        assert room["start_bytes"] > 64 * MIB
        assert room["session_bytes"] == room["rss_bytes"]         # both from the session's start
        assert room["process_peak_bytes"] > 0 and room["start_bytes"] > 0
        assert "steps_hwm_reset" not in room


def test_the_worker_takes_a_limit(capsys):
    with pytest.raises(SystemExit):
        _limit_worker.main(["model.onnx", "inputs.npz"])
    assert "--limit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _limit_worker.main(["-h"])
    assert re.search(r"\sSessionSettings JSON; absent: model metadata, else default\s",
                     " ".join(capsys.readouterr().out.split()) + " ")


def test_a_state_of_unknown_size_is_not_counted():
    model, _ = _stateful()
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "n"
    assert _limit_worker._fed_back_bytes(model) == 8      # the step count alone


def test_the_worker_reports_onnx_runtimes_refusal_and_its_shortfall(tmp_path):
    """The chain's 4 MiB buffers under a 1 MiB cap (the limit: 1 MiB over the 4 MiB input):
    ONNX Runtime's refusal, its last line, and the shortfall it names (4 MiB asked, 1 MiB there)."""
    x = {"x": np.ones(1 << 20, np.float32)}
    refused = _worker(tmp_path, _chain(), x, 5 * MIB, "--settings", UNOPTIMIZED_SETTINGS.to_json())
    assert (refused["fits"], refused["cap_bytes"], refused["outside_bytes"]) == (False, MIB, 4 * MIB)
    assert refused["shortfall_bytes"] == 3 * MIB and refused["steps"] == 0
    assert refused["error"].endswith("Available memory of 1048576 is smaller than requested bytes of 4194304")
    assert "\n" not in refused["error"]
    # a cap of one byte is ONNX Runtime's to refuse too
    one = _run(tmp_path / "model.onnx", tmp_path / "inputs.npz", 4 * MIB + 1, "--settings", UNOPTIMIZED_SETTINGS.to_json())
    assert (one["fits"], one["cap_bytes"], one["shortfall_bytes"]) == (False, 1, 4 * MIB), one
    assert "Available memory of 0" in one["error"]


def test_the_worker_runs_the_settings_it_is_given_else_the_models(tmp_path):
    """The chain at a cap where ONNX Runtime's default settings (its memory pattern: one block for
    the step's buffers, planned on the first step, allocated on the second) need more than the
    step without them: refused under the defaults on the second step, run without them, and the
    model's own metadata (UNOPTIMIZED_SETTINGS written into it) read when no settings are given."""
    from graphopt.runtime.session import write_settings
    x = {"x": np.ones(1 << 20, np.float32)}
    limit = 4 * MIB + 9 * MIB
    plain = _worker(tmp_path, _chain(), x, limit, "--settings", SessionSettings().to_json())
    assert not plain["fits"] and plain["steps"] == 1, plain
    assert _worker(tmp_path, _chain(), x, limit, "--settings", UNOPTIMIZED_SETTINGS.to_json())["fits"]
    model = _chain()
    write_settings(model, UNOPTIMIZED_SETTINGS)
    assert _worker(tmp_path, model, x, limit)["fits"]
    assert not _worker(tmp_path, model, x, limit, "--settings", SessionSettings().to_json())["fits"]
