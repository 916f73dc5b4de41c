"""A training graph's reduced twin (graphopt/reduced.py): the static graph rewritten to a smaller
batch, for annotating and verifying a step that does not fit.

Oracle: the same example built natively at the small batch (same seeded weights) and run on the
first samples of the same inputs: the twin must compute the same loss and gradients, tensor for
tensor. For the real architectures (torchvision, transformers, both exporters), whose exporter
bakes the batch into the graph, the twin must run in ONNX Runtime and every shape it measures
must be the full size's with the batch scaled."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from graphopt.analyze import analyze, fed_back_outputs
from graphopt.examples import example_inputs, forward_example
from graphopt.builder import rules
from graphopt.builder.train_graph import build_training_graph
from graphopt.reduced import TwinError, batch_inputs, extrapolate, full_shapes, make_twin


def _run(model, inputs):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs)))


def _twin(model, inputs, batch):
    return make_twin(model, inputs, batch, state=set(fed_back_outputs(model).values()),
                     keep=set(analyze(model).parameters))


@pytest.mark.parametrize("name,size,batch", [
    ("transformer", {"batch": 6, "seq": 16, "layers": 2, "d_model": 32, "heads": 2, "d_ff": 64, "vocab": 50}, 2),
    ("resnet", {"batch": 8, "image": 8, "widths": (4, 8), "blocks": 2, "classes": 5}, 3),
    ("unet", {"batch": 4, "image": 16, "widths": (4, 8)}, 2),
    ("mlp", {"batch": 12, "width": 16, "depth": 4, "d_in": 12, "classes": 5}, 5),
    # channels and a batch that fill whole blocks: Convs in the blocked layout (blocked_convs.py),
    # the stem's whole-map weight gradient (its batch in the channels) among the eligible shapes
    ("resnet", {"batch": 32, "image": 8, "widths": (16, 32), "blocks": 1, "classes": 5}, 4),
    ("unet", {"batch": 8, "image": 16, "widths": (16, 32)}, 2),
])
def test_twin_computes_what_the_graph_built_at_its_batch_computes(name, size, batch):
    full = forward_example(name, **size)
    feeds = example_inputs(full)
    built = build_training_graph(full)
    if size.get("widths", (0,))[0] >= 16 and rules.conv_block() == 16:
        assert any(n.domain == "com.microsoft.nchwc" for n in built.graph.node)
    twin = _twin(built, feeds, batch)
    native = build_training_graph(forward_example(name, **dict(size, batch=batch)))
    small = {k: v[:batch] for k, v in feeds.items()}
    assert all(np.array_equal(twin.inputs[k], small[k]) for k in small)
    got, want = _run(twin.model, twin.inputs), _run(native, small)
    assert set(got) == set(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5, err_msg=key)
    assert twin.rewritten_constants > 0


def test_shapes_at_two_batches_extrapolate_to_the_full_size():
    """Each dimension affine in the batch: two twins' shapes give the full size's, for every
    tensor shape inference knows at full size."""
    model = build_training_graph(forward_example("transformer", batch=6, seq=16, layers=2, d_model=32, heads=2,
                                                 d_ff=64, vocab=50))
    feeds = example_inputs(model)
    full = full_shapes(model)
    low, high = (full_shapes(_twin(model, feeds, b).model) for b in (2, 3))
    grown = extrapolate(low, high, 2, 3, 6)
    produced = {o for n in model.graph.node for o in n.output if o}
    checked = [n for n in produced if n in full and n in grown]
    assert len(checked) > 0.95 * len(produced)
    assert {n: grown[n] for n in checked} == {n: full[n] for n in checked}


def test_the_batch_is_the_leading_dimension_the_data_inputs_share():
    model = build_training_graph(forward_example("mlp", batch=12, width=16, depth=4, d_in=12, classes=5))
    feeds = example_inputs(model)
    full, names = batch_inputs(model, feeds)
    assert full == 12 and set(names) == set(feeds)
    with pytest.raises(TwinError, match="1..11"):
        _twin(model, feeds, 12)


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", ["resnet50", "bert", "gpt2", "swin_t"])
def test_real_architectures_have_a_twin_whose_shapes_scale(name, exporter):
    """Real exports at their tiny size (batch 2): the twin at batch 1 runs, and every value's
    measured shape (ORT, all exposed) is the full size's with the batch axis scaled."""
    from graphopt_zoo import real_zoo
    model_def = real_zoo.CORPUS[name]("tiny")
    model = build_training_graph(real_zoo.export(model_def, exporter), loss="cross_entropy",
                                 class_axis=model_def.class_axis)
    feeds = real_zoo.model_feeds(model_def)
    full = full_shapes(model)
    twin = _twin(model, feeds, 1)
    from graphopt.annotate import measure_exposed
    produced = [o for n in model.graph.node for o in n.output if o and o in full]
    measured = measure_exposed(twin.model, twin.inputs, produced, chunk=0)
    for name_, array in measured.items():
        pos = twin.positions.get(name_)
        expected = list(full[name_])
        if pos is not None:
            expected[pos[0]] = expected[pos[0]] // twin.full_batch * twin.batch
        assert list(array.shape) == expected, name_


@pytest.mark.parametrize("name,low,high", [("transformer", 2, 4), ("unet", 2, 4), ("transformer", None, 1)])
def test_annotations_at_two_reduced_batches_are_the_full_size_ones(name, low, high):
    """The oracle: annotating the step at full size. Every tensor's bytes and the execution order
    come out the same from two twins (or from one, scaled on the axis it tracked the batch on);
    from batch 1, every node has seconds scaled by its work."""
    from graphopt.annotate import annotate
    from graphopt.examples import training_example
    from graphopt.reduced import full_size_annotations
    from graphopt.runtime.session import UNOPTIMIZED_SETTINGS
    model, feeds = training_example(name)
    full = annotate(model, feeds, UNOPTIMIZED_SETTINGS)
    inferred = full_shapes(model)
    twins = [make_twin(model, feeds, b, keep=set(analyze(model).parameters), shapes=inferred) if b else None
             for b in (low, high)]
    measured = [annotate(t.model, t.inputs, UNOPTIMIZED_SETTINGS) if t else None for t in twins]
    reduced = full_size_annotations(model, measured[0], measured[1], low, high, twins[1].full_batch, inferred,
                                    twins[1].positions)
    assert reduced.tensor_bytes == full.tensor_bytes
    assert reduced.tensor_shapes == full.tensor_shapes
    assert reduced.execution_order == full.execution_order
    if low is None:
        # from batch 1 of 8, every node ORT ran at full size has its seconds scaled up from the
        # twin's. How close their sum comes to the full step's is a timing (it read 0.32 once,
        # with another test's sessions running beside it), so it is not asserted here
        # (test_node_seconds_from_twins_come_near_the_full_steps does, on a step of heavier kernels);
        # each node's scale, by its largest tensor's bytes at full size (the full step's, annotated
        # above) over the twin's, is: 8 wherever the node reads or writes the batch
        assert set(reduced.node_seconds) == set(full.node_seconds)
        twin = measured[1]
        nodes = {n.name: n for n in model.graph.node}
        scale = {name: max([full.tensor_bytes[t] / twin.tensor_bytes[t] for t in [*nodes[name].input,
                                                                                  *nodes[name].output]
                            if twin.tensor_bytes.get(t) and t in full.tensor_bytes], default=1.0)
                 for name in twin.node_seconds if name in nodes}
        assert reduced.node_seconds == pytest.approx({name: seconds * scale.get(name, 1.0)
                                                      for name, seconds in twin.node_seconds.items()})
        assert sum(v == 8 for v in scale.values()) > 0.5 * len(scale), sorted(scale.values())


def test_node_seconds_from_twins_come_near_the_full_steps():
    """The MLP example at batch 512 (Gemms of 256 features), annotated from its twins at 8 and
    16: each node's seconds are the batch-16 twin's scaled to the full batch. Oracle: the step
    annotated natively at 512. Each sum the least of three annotations (a run slowed by a test
    beside it reads high), the twins' scaled sum read 0.51-1.55x the full step's in 16 runs on a
    2-core machine, two at a time; the twin's own, unscaled, 0.017-0.052x. Within 5x either way
    holds the first and not the second."""
    from graphopt.annotate import annotate
    from graphopt.examples import training_example
    from graphopt.reduced import full_size_annotations
    from graphopt.runtime.session import UNOPTIMIZED_SETTINGS
    model, feeds = training_example("mlp", batch=512, width=256, depth=4, d_in=256)
    inferred = full_shapes(model)
    keep = set(analyze(model).parameters)
    twins = {b: make_twin(model, feeds, b, keep=keep, shapes=inferred) for b in (8, 16)}
    full_sums, reduced_sums = [], []
    for _ in range(3):
        full = annotate(model, feeds, UNOPTIMIZED_SETTINGS)
        low, high = (annotate(twins[b].model, twins[b].inputs, UNOPTIMIZED_SETTINGS) for b in (8, 16))
        reduced = full_size_annotations(model, low, high, 8, 16, 512, inferred, twins[16].positions)
        assert set(reduced.node_seconds) == set(full.node_seconds)
        full_sums.append(sum(full.node_seconds.values()))
        reduced_sums.append(sum(reduced.node_seconds.values()))
    ratio = min(reduced_sums) / min(full_sums)
    assert 0.2 < ratio < 5, (reduced_sums, full_sums)


def _masked_forward(batch: int, mask: np.ndarray):
    """x [batch, 4, 6] times a Constant node holding one mask per sample (`mask[:batch]`), flattened
    (the batch in the Reshape's shape), projected, a squared error against `target`."""
    from onnx import TensorProto as T, helper as h, numpy_helper
    rng = np.random.default_rng(1)
    nodes = [h.make_node("Constant", [], ["mask"], name="mask", value=numpy_helper.from_array(mask[:batch], "mask")),
             h.make_node("Mul", ["x", "mask"], ["masked"], name="apply_mask"),
             h.make_node("Reshape", ["masked", "flat_shape"], ["flat"], name="flatten"),
             h.make_node("MatMul", ["flat", "w"], ["proj"], name="proj"),
             h.make_node("Sub", ["proj", "target"], ["diff"], name="diff"),
             h.make_node("Mul", ["diff", "diff"], ["sq"], name="sq"),
             h.make_node("ReduceMean", ["sq"], ["loss"], name="mean", keepdims=0)]
    graph = h.make_graph(nodes, "masked", [h.make_tensor_value_info("x", T.FLOAT, [batch, 4, 6]),
                                           h.make_tensor_value_info("target", T.FLOAT, [batch, 5])],
                         [h.make_tensor_value_info("loss", T.FLOAT, [])],
                         [numpy_helper.from_array(np.array([batch, 24], np.int64), "flat_shape"),
                          numpy_helper.from_array(rng.standard_normal((24, 5)).astype(np.float32), "w")])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_a_constant_node_that_holds_the_batch_is_cut_with_it():
    """A Constant node whose leading axis is the batch (a per-sample mask; issue 47: left uncut, only
    a slow test of real exports failed). The twin at batch 2 of 6 holds the mask's first 2
    samples; oracle: the graph built natively at batch 2 with them, run on the first 2 samples:
    the same loss and gradient."""
    from onnx import numpy_helper
    mask = (np.random.default_rng(2).random((6, 4, 6)) > 0.3).astype(np.float32)
    model = build_training_graph(_masked_forward(6, mask))
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((6, 4, 6)).astype(np.float32),
             "target": rng.standard_normal((6, 5)).astype(np.float32)}
    twin = _twin(model, feeds, 2)
    (constant,) = [n for n in twin.model.graph.node if n.op_type == "Constant" and n.output[0] == "mask"]
    np.testing.assert_array_equal(numpy_helper.to_array(constant.attribute[0].t), mask[:2])
    native = build_training_graph(_masked_forward(2, mask))
    got, want = _run(twin.model, twin.inputs), _run(native, {k: v[:2] for k, v in feeds.items()})
    assert set(got) == set(want) == {"loss", "w_grad"}
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
