"""graphopt/weights.py: models written one tensor at a time, the data of their stubs read from
where it is (a folder's external data, tensors held in the process, zeros), against onnx's own
writer and reader as the oracle; and the builder working on stubs gives the model it gives with
the weights in memory."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from graphopt.builder.optimizer import OptimizerSpec
from graphopt.builder.train_graph import build_training_graph
from graphopt.examples import example_inputs, forward_example
from graphopt.ingest import load_model
from graphopt.runtime.weights import HELD, ZEROS, Weights, is_stub, save_model, stub_location, zeros_stub


def _arrays(path):
    model = onnx.load(str(path))          # onnx's reader, external data included
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}, model


@pytest.mark.parametrize("limit_bytes", [None, 4096], ids=["inline", "external"])
def test_a_model_with_every_kind_of_stub_is_written_as_onnx_reads_it(tmp_path, limit_bytes):
    """A model whose initializers are inline, a reference to another folder's file, held, and
    zeros: written inline (under the limit) or with its data in <name>.data (over it), it loads
    with onnx's reader to exactly the arrays it stands for."""
    forward = forward_example("mlp", depth=3, batch=64)       # one 512x512 weight: 1 MiB
    large = [t.name for t in forward.graph.initializer if len(t.raw_data) >= 1 << 20]
    source = tmp_path / "source"
    source.mkdir()
    onnx.save(forward, source / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.bin", size_threshold=0)      # (converts `forward` to references in place)
    want, _ = _arrays(source / "m.onnx")
    model = load_model(source / "m.onnx", weights_on_disk=True)
    # the large ones stay on disk; the small ones (shapes, axes: what graph work reads) come inline
    assert [t.name for t in model.graph.initializer if is_stub(t)] == large and large
    weights = Weights(folder=str(source))
    light = weights.detach(model, min_bytes=0)       # the inline ones held too
    assert any(stub_location(t) == HELD for t in light.graph.initializer)
    light.graph.initializer.append(zeros_stub("state", TensorProto.FLOAT, [300, 7]))
    want["state"] = np.zeros((300, 7), np.float32)
    out = tmp_path / "out" / "w.onnx"
    kwargs = {} if limit_bytes is None else {"limit_bytes": limit_bytes}
    save_model(light, out, weights, **kwargs)
    got, saved = _arrays(out)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    externals = [t for t in onnx.load(str(out), load_external_data=False).graph.initializer if is_stub(t)]
    assert bool(externals) == (limit_bytes is not None)
    assert all(stub_location(t) == "w.onnx.data" for t in externals)
    onnx.checker.check_model(str(out))
    assert [n.SerializeToString() for n in saved.graph.node] == [n.SerializeToString() for n in forward.graph.node]
    # the model it was written from still holds its stubs (written from, never converted in place)
    assert any(stub_location(t) == HELD for t in light.graph.initializer)


def test_the_builder_on_stubs_writes_the_model_it_builds_in_memory(tmp_path):
    """build_training_graph with `weights` (the graph alone, the weights written from the
    forward's folder and AdamW's state made when written) writes the same model as the
    in-memory build written by onnx, and ONNX Runtime computes the same step from both."""
    forward = forward_example("mlp", depth=3, batch=64)     # a 512x512 weight: 1 MiB, AdamW's state made when written
    onnx.save(forward, tmp_path / "f.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="f.bin", size_threshold=1024)
    spec = OptimizerSpec("adamw", lr=1e-3)
    whole = build_training_graph(load_model(tmp_path / "f.onnx"), loss=None, optimizer=spec)
    onnx.save(whole, tmp_path / "whole.onnx")
    weights = Weights(folder=str(tmp_path))
    lazily = build_training_graph(load_model(tmp_path / "f.onnx", weights_on_disk=True), loss=None,
                                  optimizer=spec, weights=weights)
    assert any(is_stub(t) for t in lazily.graph.initializer)
    assert any(stub_location(t) == ZEROS for t in lazily.graph.initializer)
    save_model(lazily, tmp_path / "out" / "lazy.onnx", weights, limit_bytes=4096)
    a, model_a = _arrays(tmp_path / "whole.onnx")
    b, model_b = _arrays(tmp_path / "out" / "lazy.onnx")
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert [n.SerializeToString() for n in model_a.graph.node] == [n.SerializeToString() for n in model_b.graph.node]
    inputs = example_inputs(forward)
    run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, inputs)
    for x, y in zip(run(tmp_path / "whole.onnx"), run(tmp_path / "out" / "lazy.onnx")):
        np.testing.assert_array_equal(x, y)
