"""Convolutions in ONNX Runtime's blocked layout (graphopt/builder/blocked_convs.py), against
independent oracles: ONNX Runtime's own layout transformer (the blocked weight it writes for a
constant weight), torch in float64 (the convolution's values), and the plain Conv in ONNX Runtime."""
from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from graphopt.builder import blocked_convs as bc
from graphopt.builder import rules
from graphopt.builder.deterministic import static_shapes

BLOCK = bc.block_size()
needs_nchwc = pytest.mark.skipif(BLOCK is None, reason="this onnxruntime has no NCHWc kernels on this machine")


@pytest.fixture(autouse=True)
def any_size(request, monkeypatch):
    """The cases here are small: every size written blocked (bc.MIN_OUTPUT_PIXELS), but where a
    test is about that threshold."""
    if "threshold" not in request.node.name:
        monkeypatch.setattr(bc, "MIN_OUTPUT_PIXELS", 0)


def _conv_model(x_shape, w_shape, attrs, bias=False, weight_fed=False, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(w_shape).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    # a fed weight: an initializer that is also a graph input, as a built graph's parameters are
    # when a training loop feeds them (a default ONNX Runtime overrides with the value fed)
    # (its stored value other than the one fed: what the graph computes must be the fed one's)
    inits = [numpy_helper.from_array(-0.5 * w if weight_fed else w, "w")]
    if bias:
        inits.append(numpy_helper.from_array(b, "b"))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))]
    if weight_fed:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, list(w_shape)))
    node = helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["y"], name="conv", **attrs)
    relu = helper.make_node("Relu", ["y"], ["z"], name="relu")
    z_shape = list(_torch64(np.zeros(x_shape, np.float32), w, None, attrs).shape) if "auto_pad" not in attrs else None
    graph = helper.make_graph([node, relu], "g", inputs, [helper.make_tensor_value_info("z", TensorProto.FLOAT, z_shape)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    if weight_fed:
        feeds["w"] = w
    return model, feeds, w, (b if bias else None)


def _run(model, feeds, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(["z"], feeds)[0]


def _torch64(x, w, b, attrs):
    pads = attrs.get("pads", [0] * (2 * (x.ndim - 2)))
    widths = []
    for axis in reversed(range(x.ndim - 2)):   # F.pad: the last axis first
        widths += [pads[axis], pads[x.ndim - 2 + axis]]
    xt = F.pad(torch.from_numpy(x).double(), widths)
    conv = F.conv2d if x.ndim == 4 else F.conv1d
    y = conv(xt, torch.from_numpy(w).double(), None if b is None else torch.from_numpy(b).double(),
                 stride=attrs.get("strides", 1), dilation=attrs.get("dilations", 1),
                 groups=attrs.get("group", 1))
    return torch.relu(y).numpy()


def _blocked(model):
    blocked = onnx.ModelProto()
    blocked.CopyFrom(model)
    count = bc.blocked_convs(blocked, static_shapes(blocked), BLOCK)
    return blocked, count


# name: x shape, w shape, attributes, bias
CASES = {
    "dense_3x3": ([2, 32, 9, 7], [24, 32, 3, 3], dict(pads=[1, 1, 1, 1]), True),
    "dense_strided": ([2, 32, 9, 8], [32, 32, 3, 3], dict(strides=[2, 2], pads=[1, 0, 1, 1]), False),
    "dense_dilated": ([1, 48, 10, 10], [40, 48, 3, 2], dict(dilations=[2, 1], pads=[2, 0, 2, 1]), True),
    "dense_5x5_few_filters": ([1, 16, 8, 8], [3, 16, 5, 5], dict(pads=[2, 2, 2, 2]), True),
    "depthwise": ([2, 32, 7, 7], [32, 1, 3, 3], dict(group=32, pads=[1, 1, 1, 1]), True),
    "depthwise_strided": ([2, 48, 9, 9], [48, 1, 3, 3], dict(group=48, strides=[2, 2], pads=[1, 1, 1, 1]), False),
    "depthwise_5x5": ([1, 32, 8, 8], [32, 1, 5, 5], dict(group=32, pads=[2, 2, 2, 2]), False),
}
# left as they are: a 1 x 1 Conv, channels not a multiple of the block, other groups, auto_pad, 1-D
UNTOUCHED = {
    "pointwise": ([2, 32, 5, 5], [24, 32, 1, 1], dict()),
    "few_channels": ([2, 3, 8, 8], [16, 3, 3, 3], dict(pads=[1, 1, 1, 1])),
    # input channels a multiple of neither block (8 with AVX2, 16 with AVX-512)
    "odd_channels": ([2, 36, 8, 8], [16, 36, 3, 3], dict(pads=[1, 1, 1, 1])),
    "grouped": ([2, 32, 8, 8], [32, 16, 3, 3], dict(group=2, pads=[1, 1, 1, 1])),
    "depthwise_multiplier": ([2, 32, 8, 8], [64, 1, 3, 3], dict(group=32, pads=[1, 1, 1, 1])),
    "auto_pad": ([2, 32, 8, 8], [16, 32, 3, 3], dict(auto_pad="SAME_UPPER")),
    "one_dimensional": ([2, 32, 9], [16, 32, 3], dict(pads=[1, 1])),
}


@needs_nchwc
def test_block_size_is_what_onnx_runtime_writes():
    """The block and both weight layouts against ONNX Runtime's own layout transformer: a Conv with a
    constant weight optimized at level ALL, its blocked initializer against this module's reorder of
    the same weight, run in the graph (filters not a multiple of the block: padded)."""
    for name, (x_shape, w_shape, attrs, _) in CASES.items():
        model, feeds, w, _ = _conv_model(x_shape, w_shape, attrs)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        with tempfile.TemporaryDirectory() as tmp:
            options.optimized_model_filepath = os.path.join(tmp, "all.onnx")
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            optimized = onnx.load(options.optimized_model_filepath)
        (conv,) = [n for n in optimized.graph.node if n.domain == bc.NCHWC_DOMAIN and n.op_type == "Conv"]
        expected = numpy_helper.to_array(next(t for t in optimized.graph.initializer if t.name == conv.input[1]))
        blocked, count = _blocked(model)
        assert count == 1, name
        (mine,) = [n for n in blocked.graph.node if n.domain == bc.NCHWC_DOMAIN and n.op_type == "Conv"]
        # the blocked weight as a graph output of its own
        probe = onnx.ModelProto()
        probe.CopyFrom(blocked)
        probe.graph.output.append(helper.make_tensor_value_info(mine.input[1], TensorProto.FLOAT, None))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
        written = session.run([mine.input[1]], feeds)[0]
        assert written.shape == expected.shape, name
        assert np.array_equal(written, expected), name


@needs_nchwc
@pytest.mark.parametrize("weight_fed", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_blocked_convolutions_compute_the_convolution(name, weight_fed):
    """Each case written blocked (one Conv, its ReorderInput / ReorderOutput pair) computes what torch
    computes in float64, at ONNX Runtime's level off and its default level, the weight a constant or
    fed, as close as the plain Conv does."""
    x_shape, w_shape, attrs, bias = CASES[name]
    model, feeds, w, b = _conv_model(x_shape, w_shape, attrs, bias, weight_fed)
    blocked, count = _blocked(model)
    assert count == 1
    ops = [(n.domain, n.op_type) for n in blocked.graph.node]
    assert ops.count((bc.NCHWC_DOMAIN, "Conv")) == 1 and ("", "Conv") not in ops
    assert ops.count((bc.NCHWC_DOMAIN, "ReorderOutput")) == 1
    onnx.checker.check_model(blocked)
    expected = _torch64(feeds["x"], w, b, attrs)
    plain = _run(model, feeds)
    scale = float(np.abs(expected).max())
    plain_error = float(np.abs(plain - expected).max()) / scale
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        got = _run(blocked, feeds, level)
        assert got.shape == expected.shape
        assert float(np.abs(got - expected).max()) / scale <= max(4 * plain_error, 1e-6), (name, level)


@needs_nchwc
@pytest.mark.parametrize("name", list(UNTOUCHED))
def test_other_convolutions_are_left_as_they_are(name):
    x_shape, w_shape, attrs = UNTOUCHED[name]
    model, _, _, _ = _conv_model(x_shape, w_shape, attrs)
    before = model.SerializeToString()
    blocked, count = _blocked(model)
    assert count == 0
    assert blocked.SerializeToString() == before


@needs_nchwc
def test_a_run_on_a_machine_with_another_block_fails_loudly():
    """The graph records its block; written for another block than this machine's, a run fails at
    the check (the Reshape named for the block) instead of computing with a misread weight."""
    other = 8 if BLOCK != 8 else 16
    model, feeds, _, _ = _conv_model([2, 32, 6, 6], [32, 32, 3, 3], dict(pads=[1, 1, 1, 1]))
    blocked = onnx.ModelProto()
    blocked.CopyFrom(model)
    assert bc.blocked_convs(blocked, static_shapes(blocked), other) == 1
    assert {p.key: p.value for p in blocked.metadata_props}[bc.BLOCK_KEY] == str(other)
    # the check is on every blocked weight's path: graphopt's dead-code removal keeps it
    from graphopt.builder.train_graph import cleanup_graph
    for graph in (blocked, cleanup_graph(blocked)):
        for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
            with pytest.raises(Exception, match=f"nchwc_block_{other}_check"):
                _run(graph, feeds, level)
    mine, _ = _blocked(model)
    assert {p.key: p.value for p in mine.metadata_props}[bc.BLOCK_KEY] == str(BLOCK)
    _run(mine, feeds)


@needs_nchwc
def test_the_builder_writes_them_and_its_gradients_match_torch():
    """A CNN's training graph built with blocked convolutions (3 x 3 forward Convs and their input
    gradients as Convs) against torch float64, and the same graph built without them."""
    from graphopt.builder.train_graph import build_training_graph

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 16, 3, padding=1)
            self.body = torch.nn.Conv2d(16, 16, 3, padding=1)
            self.down = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1)
            self.dw = torch.nn.Conv2d(32, 32, 3, padding=1, groups=32)
            self.head = torch.nn.Linear(32, 5)

        def forward(self, x):
            x = torch.relu(self.stem(x))
            x = torch.relu(self.body(x)) + x
            x = torch.relu(self.dw(torch.relu(self.down(x))))
            return self.head(x.mean(dim=(2, 3))).square().mean()

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 3, 12, 12)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "net.onnx")
        torch.onnx.export(net, (x,), path, input_names=["x"], output_names=["loss"], dynamo=False)
        forward = onnx.load(path)
    exact = {name: p.double() for name, p in net.named_parameters()}
    loss = torch.func.functional_call(net.double(), exact, (x.double(),))
    grads = dict(zip(exact, torch.autograd.grad(loss, list(exact.values()))))
    built = {}
    for on in (True, False):
        with rules.blocked_layout(on):
            built[on] = build_training_graph(forward)
    ops = {on: [(n.domain, n.op_type) for n in m.graph.node] for on, m in built.items()}
    # body, down and dw forward; the input gradients of body and dw (stride 1); not the stem (3 channels)
    assert ops[True].count((bc.NCHWC_DOMAIN, "Conv")) == 5
    assert (bc.NCHWC_DOMAIN, "Conv") not in ops[False]
    assert ops[True].count(("", "ConvTranspose")) < ops[False].count(("", "ConvTranspose"))
    for on, model in built.items():
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        names = [o.name for o in model.graph.output if o.name.endswith("_grad")]
        got = dict(zip(names, session.run(names, {"x": x.numpy()})))
        for name, g in grads.items():
            expected = g.numpy()
            error = float(np.abs(got[name + "_grad"] - expected).max()) / max(float(np.abs(expected).max()), 1e-12)
            assert error < 1e-4, (on, name, error)


def _forward_convs(path, batch=8):
    """A forward of two 3 x 3 Convs over 16 channels (at batch 8, 2048 pixels each:
    bc.MIN_OUTPUT_PIXELS) and a scalar output, saved at `path`."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 16, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((16, 16, 3, 3)).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("ReduceMean", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16, 16, 16])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


@needs_nchwc
def test_train_graph_writes_them_unless_told_plain(tmp_path):
    import subprocess
    import sys
    _forward_convs(tmp_path / "forward.onnx")
    domains = {}
    for flag in ([], ["--plain-convs"]):
        out = tmp_path / f"train{len(flag)}.onnx"
        run = subprocess.run([sys.executable, "-m", "graphopt.cli", "train-graph", str(tmp_path / "forward.onnx"),
                              "-o", str(out)] + flag, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        model = onnx.load(out)
        domains[bool(flag)] = {n.domain for n in model.graph.node}
        assert ({p.key for p in model.metadata_props} >= {bc.BLOCK_KEY}) is not bool(flag)
    assert bc.NCHWC_DOMAIN in domains[False] and bc.NCHWC_DOMAIN not in domains[True]


@needs_nchwc
def test_a_graph_written_for_another_block_is_refused_on_load(tmp_path):
    """graphopt's entry points refuse, naming both blocks, a graph written for another block."""
    from graphopt.errors import InvalidModelError
    from graphopt.ingest import load_model, parse_model
    model, _, _, _ = _conv_model([2, 32, 6, 6], [32, 32, 3, 3], dict(pads=[1, 1, 1, 1]))
    other = 8 if BLOCK != 8 else 16
    for block, refused in ((BLOCK, False), (other, True)):
        blocked = onnx.ModelProto()
        blocked.CopyFrom(model)
        bc.blocked_convs(blocked, static_shapes(blocked), block)
        onnx.save(blocked, tmp_path / f"b{block}.onnx")
        for load in (lambda: parse_model(blocked.SerializeToString()), lambda: load_model(tmp_path / f"b{block}.onnx")):
            if refused:
                with pytest.raises(InvalidModelError, match=f"blocks of {other} channels.*uses blocks of {BLOCK}"):
                    load()
            else:
                load()


@needs_nchwc
def test_the_pixel_threshold(tmp_path):
    """A Conv is written blocked where its output has at least bc.MIN_OUTPUT_PIXELS pixels (batch x
    height x width), or bc.MIN_OUTPUT_PIXELS_COMPUTED_WEIGHT where its weight is computed in the
    graph: an input gradient's Conv of the flipped weight, written (for a constant weight) on
    that condition. Between the two a training graph's forward Convs stay plain and the input
    gradient's Conv is blocked; below both it is a ConvTranspose."""
    from graphopt.builder.train_graph import build_training_graph
    assert (bc.MIN_OUTPUT_PIXELS, bc.MIN_OUTPUT_PIXELS_COMPUTED_WEIGHT) == (2048, 512)
    attrs = {"group": 1, "strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1]}
    for batch, blocked in ((8, True), (7, False)):   # 8 x 16 x 16 = 2048 output pixels
        model, _, _, _ = _conv_model([batch, 32, 16, 16], [32, 32, 3, 3], dict(pads=[1, 1, 1, 1]))
        assert _blocked(model)[1] == int(blocked)
        assert rules.conv_input_gradient_applies(attrs, [32, 32, 3, 3], [batch, 32, 16, 16]) is True
    for shape, applies in (([2, 32, 16, 16], True), ([2, 32, 16, 15], False)):   # 512 pixels, 480
        assert rules.conv_input_gradient_applies(attrs, [32, 32, 3, 3], shape) is applies
    for batch, input_gradient in ((2, (bc.NCHWC_DOMAIN, "Conv")), (1, ("", "ConvTranspose"))):   # 512, 256 pixels
        _forward_convs(str(tmp_path / "convs.onnx"), batch)
        training = build_training_graph(onnx.load(str(tmp_path / "convs.onnx")))
        ops = [(n.domain, n.op_type) for n in training.graph.node]
        plain = [n for n in training.graph.node if n.op_type == "Conv" and n.domain != bc.NCHWC_DOMAIN]
        assert sorted(n.input[1] for n in plain) == ["w1", "w2"], "the forward Convs, their weights as they are"
        assert ops.count(input_gradient) == 1 and (bc.NCHWC_DOMAIN, "Conv") not in set(ops) - {input_gradient}