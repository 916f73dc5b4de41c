"""The gradient rules graphopt adds to onnx-ad (graphopt/builder/rules.py), one operator at a time.

Each case is a one-node ONNX graph made here with onnx.helper, differentiated as
build_training_graph does it (`rules.register()`, then `onnx_ad.reverse(..., prefix="adj_",
dim="nadj", layout="onnx")`, the seed a random adjoint of the output), run in ONNX Runtime, and
compared with torch autograd in float64 on the same numbers: the output and the gradient of
every input asked for. Where a rule and onnx-ad's default give the same numbers (the weight
gradient per kernel tap or as one convolution, the input gradient as a Conv or a ConvTranspose,
MatMul's weight as one Gemm, Relu's derivative from the output, Gather's adjoint as a Pad), the
gradient graph's operators say which one was written. The pure helpers (`per_tap_applies`,
`conv_input_gradient_applies`, `slice_positions`, `weights_fed`) are checked against their
docstrings' rules worked out here. One small model goes through build_training_graph itself.

Tolerance: float32 against float64 on sums of at most a few hundred products of numbers near 1:
max|got - torch| <= TOL (2e-5) * max|torch| per tensor. Measured: at most 4.2e-6 of the scale,
in BatchNormalization's narrowest channel (0.01 wide around a mean near 1: float32's 6e-8 over
0.01), under 5e-7 everywhere else; so a wrong element anywhere near the scale fails.

Fast (no model export; about a second per dozen cases): the mutation selection of
builder.rules (tests/mutation.py).
"""
from __future__ import annotations

import gc
import itertools

import numpy as np
import onnx
import onnx_ad
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ad import rules as onnx_ad_rules
from onnx_ad._build import UnsupportedOperator

from graphopt.builder import rules
from graphopt.builder.graph_util import attribute
from graphopt.builder.train_graph import build_training_graph

torch = pytest.importorskip("torch")
F = torch.nn.functional
# torch's OpenMP pool is not fork-safe: in mutmut's children, forked from a process that ran these
# tests, a convolution waited forever on the parent's threads (every such mutant a timeout)
torch.set_num_threads(1)

TOL = 2e-5
OPSET = 17
# onnx-ad's own rules, put back before each case so that `register` must install graphopt's
ONNX_AD_OWN = {("REVERSE", "BatchNormalization"): rules._INFERENCE_BATCH_NORM,
               ("REVERSE", "Conv"): rules._CONV, ("REVERSE", "MatMul"): rules._MATMUL,
               ("REVERSE", "ConvTranspose"): rules._CONV_TRANSPOSE, ("REVERSE", "Slice"): rules._SLICE,
               ("REVERSE", "Gather"): rules._GATHER,
               ("DERIVATIVE", "Relu"): onnx_ad_rules._d_relu, ("DERIVATIVE", "LeakyRelu"): rules._LEAKY_RELU}


def _register_fresh():
    for (table, op), rule in ONNX_AD_OWN.items():
        getattr(onnx_ad_rules, table)[op] = rule
    rules.register()


def _one_thread() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), _one_thread(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def _model(nodes, arrays, output_shape, constants=(), dynamic=(), output_type=TensorProto.FLOAT):
    """Graph inputs `arrays` (name -> array; dims in `dynamic` (name -> axis) left symbolic),
    constant initializers `constants`, the single output ``y``."""
    inputs = []
    for name, value in arrays.items():
        shape = list(value.shape)
        if name in dict(dynamic):
            shape[dict(dynamic)[name]] = "n"
        inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), shape))
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(constants).items()]
    graph = helper.make_graph(nodes, "one_op", inputs,
                              [helper.make_tensor_value_info("y", output_type, list(output_shape))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def _reverse(model, wrt):
    _register_fresh()
    return onnx_ad.reverse(model, inputs=list(wrt), outputs=["y"], prefix="adj_", dim="nadj", layout="onnx")


def _torch_reference(fn, arrays, wrt, seed):
    """fn's output and the gradients of sum(fn * seed) with respect to `wrt`, in float64."""
    tensors = {k: torch.tensor(np.asarray(v, np.float64) if v.dtype.kind == "f" else v,
                               requires_grad=k in wrt) for k, v in arrays.items()}
    y = fn(**tensors)
    (y * torch.tensor(seed, dtype=torch.float64)).sum().backward()
    grads = {k: (tensors[k].grad.numpy() if tensors[k].grad is not None else np.zeros(arrays[k].shape))
             for k in wrt}
    return y.detach().numpy(), grads


def _assert_close(got, expected, what):
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    scale = np.abs(expected).max() if expected.size else 0.0
    error = np.abs(got.astype(np.float64) - expected).max() if expected.size else 0.0
    assert error <= TOL * scale, f"{what}: max error {error:.3g} against a scale of {scale:.3g}"


def _check(nodes, arrays, wrt, fn, constants=(), dynamic=(), fed=(), seed_rng=1):
    """`nodes` differentiated with respect to `wrt` (graph inputs), run in ONNX Runtime and
    compared with torch: returns the gradient graph, for its operators."""
    output_shape = fn(**{k: torch.tensor(np.asarray(v, np.float64) if v.dtype.kind == "f" else v)
                         for k, v in arrays.items()}).shape
    seed = np.random.default_rng(seed_rng).standard_normal(tuple(output_shape)).astype(np.float32)
    model = _model(nodes, arrays, output_shape, constants, dynamic)
    with rules.weights_fed(fed):
        gradient_graph = _reverse(model, wrt)
    got = _run(gradient_graph, {**arrays, "adj_y": seed[..., None]})
    expected_y, expected = _torch_reference(fn, arrays, wrt, seed)
    _assert_close(got["y"], expected_y, "y")
    for name in wrt:
        assert got[f"adj_{name}"].shape[-1] == 1
        _assert_close(got[f"adj_{name}"][..., 0], expected[name], f"d{name}")
    return gradient_graph


def _added_ops(gradient_graph, forward_ops=1):
    """Operator types of the gradient graph, without the forward's nodes (written first)."""
    return [n.op_type for n in gradient_graph.graph.node[forward_ops:]]


def _random(*shape, rng=None, scale=1.0):
    rng = rng or np.random.default_rng(sum(shape) * 7 + len(shape))
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---- the pure helpers, against their docstrings' rules ------------------------------------------

def test_per_tap_applies_follows_its_docstring():
    """Ungrouped or depthwise (one filter per channel), static shapes, at least
    PER_TAP_MIN_CHANNELS (8) channels or a 1 x 1 kernel; a depthwise one up to
    DEPTHWISE_MAX_TAPS (9) taps and 8 channels whatever its kernel."""
    cases = [
        # (source_shape, adjoint_shape, kernel, group): applies
        (([2, 8, 5, 5], [2, 4, 5, 5], [3, 3], 1), True),     # ungrouped, 8 channels
        (([2, 7, 5, 5], [2, 4, 5, 5], [3, 3], 1), False),    # 7 channels, 3 x 3
        (([2, 7, 5, 5], [2, 4, 5, 5], [1, 1], 1), True),     # 1 x 1 over any channels
        (([2, 3, 5, 5], [2, 16, 5, 5], [1, 1], 1), True),
        (([2, 3, 5, 5], [2, 16, 5, 5], [1, 2], 1), False),   # 1 x 2 is not 1 x 1
        (([2, 3, 5, 5], [2, 16, 5, 5], [2, 1], 1), False),
        (([2, 3, 9], [2, 16, 9], [1], 1), True),             # 1-D 1 x 1
        (([2, 64, 9], [2, 16, 9], [5], 1), True),
        (([2, 8, 5, 5], [2, 8, 5, 5], [3, 3], 8), True),     # depthwise, 9 taps, 8 channels
        (([2, 7, 5, 5], [2, 7, 5, 5], [3, 3], 7), False),    # 7 channels
        (([2, 7, 5, 5], [2, 7, 5, 5], [1, 1], 7), False),    # depthwise 1 x 1 still needs 8
        (([2, 8, 5, 5], [2, 8, 5, 5], [2, 5], 8), False),    # 10 taps
        (([2, 8, 5, 5], [2, 8, 5, 5], [3, 4], 8), False),
        (([2, 32, 5, 5], [2, 32, 5, 5], [9, 1], 32), True),  # 9 taps
        (([2, 8, 5, 5], [2, 16, 5, 5], [3, 3], 8), False),   # two filters per channel: grouped
        (([2, 8, 5, 5], [2, 4, 5, 5], [3, 3], 4), False),    # grouped, not depthwise
        (([2, 8, 5, 5], [2, 8, 5, 5], [3, 3], 2), False),
        (([2, 16, 5, 5], [2, 16, 5, 5], [1, 1], 2), False),
        ((None, [2, 4, 5, 5], [1, 1], 1), False),            # shapes unknown
        (([2, 8, 5, 5], None, [1, 1], 1), False),
        (([2, 8, None, 5], [2, 4, 5, 5], [1, 1], 1), False),
        (([2, 8, 5, 5], [None, 4, 5, 5], [1, 1], 1), False),
        (([2, 8, 5, 5], [2, 4, 5, 5], [1, None], 1), False),
        (([2, 8, 5, 5], [2, 4, 5, 5], None, 1), False),
        (([2, 8, 5, 5], [2, 8, 5, 5], None, 8), False),
    ]
    for arguments, applies in cases:
        assert rules.per_tap_applies(*arguments) is applies, arguments


def test_per_tap_switched_off(monkeypatch):
    monkeypatch.setattr(rules, "PER_TAP_WEIGHT_GRADIENTS", False)
    assert not rules.per_tap_applies([2, 8, 5, 5], [2, 4, 5, 5], [1, 1], 1)
    assert not rules.conv_input_gradient_applies(_attrs(), [4, 8, 1, 1], [2, 8, 5, 5])


def _attrs(group=1, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1)):
    return {"group": group, "strides": list(strides), "pads": list(pads), "dilations": list(dilations)}


def test_conv_input_gradient_applies_follows_its_docstring(monkeypatch):
    """Ungrouped, stride 1, and either 1 x 1 without pads, or no dilation, pads within kernel - 1
    on every side, and at least as many input channels as output ones where the weights are fed
    or LARGER_INPUT_GRADIENTS_AS_CONV is on, else WIDE_INPUT_CHANNELS_FACTOR times as many; or
    depthwise with fed weights at stride 1, no dilation, pads within kernel - 1, at most
    DEPTHWISE_INPUT_GRADIENT_MAX_TAPS taps; and, with convolutions in the blocked layout
    (rules.conv_block), those of constant weights too where the filters fill whole blocks."""
    assert rules.WIDE_INPUT_CHANNELS_FACTOR == 3 and rules.DEPTHWISE_INPUT_GRADIENT_MAX_TAPS == 9
    assert rules.BLOCKED_DEPTHWISE_INPUT_GRADIENT_MAX_TAPS == 49
    # the plain layout first, whatever the machine's block (8 channels with AVX2, 16 with AVX-512)
    monkeypatch.setattr(rules, "conv_block", lambda: None)
    a = _attrs
    x = [2, 8, 6, 6]
    cases = [
        # (attrs, kernel (the weight's shape), input shape, fed): applies
        ((a(), [4, 8, 1, 1], x, False), True),
        ((a(), [16, 8, 1, 1], x, False), True),               # 1 x 1: any channels
        ((a(dilations=(2, 2)), [16, 8, 1, 1], x, False), True),
        ((a(pads=(0, 0, 0, 1)), [4, 8, 1, 1], x, True), False),   # 1 x 1 with pads
        ((a(pads=(1, 0, 0, 0)), [4, 8, 1, 1], x, False), False),
        ((a(strides=(1, 2)), [4, 8, 1, 1], x, False), False),
        ((a(strides=(2, 1)), [4, 8, 1, 1], x, True), False),
        ((a(group=2), [4, 4, 1, 1], x, True), False),
        ((a(), [4, 8, 3, 3], x, False), False),                # larger: only fed ...
        ((a(), [2, 8, 3, 3], x, False), True),                 # ... or 3x as many input channels
        ((a(), [3, 8, 3, 3], x, False), False),                # 8 < 3 x 3
        ((a(pads=(3, 0, 0, 0)), [2, 8, 3, 3], x, False), False),   # wide, but pads past the reach
        ((a(dilations=(1, 2)), [2, 8, 3, 3], x, False), False),   # wide, but dilated
        ((a(strides=(2, 1)), [2, 8, 3, 3], x, False), False),     # wide, but strided
        ((a(group=2), [2, 4, 3, 3], x, False), False),            # wide, but grouped
        ((a(), [4, 8, 3, 3], x, True), True),
        ((a(), [8, 8, 3, 3], x, True), True),                  # as many input channels as output
        ((a(), [9, 8, 3, 3], x, True), False),                 # fewer
        ((a(), [4, 8, 1, 3], x, True), True),
        ((a(pads=(1, 1, 1, 1)), [4, 8, 3, 3], x, True), True),
        ((a(pads=(2, 2, 2, 2)), [4, 8, 3, 3], x, True), True),   # kernel - 1
        ((a(pads=(3, 0, 0, 0)), [4, 8, 3, 3], x, True), False),
        ((a(pads=(0, 3, 0, 0)), [4, 8, 3, 3], x, True), False),
        ((a(pads=(0, 0, 3, 0)), [4, 8, 3, 3], x, True), False),
        ((a(pads=(0, 0, 0, 3)), [4, 8, 3, 3], x, True), False),
        ((a(pads=(0, 0, 0, 2)), [4, 8, 3, 3], x, True), True),
        ((a(pads=(0, 1, 0, 1)), [4, 8, 3, 2], x, True), True),   # reach 1 on the second axis
        ((a(pads=(0, 2, 0, 0)), [4, 8, 3, 2], x, True), False),
        ((a(pads=(0, 0, 0, 2)), [4, 8, 3, 2], x, True), False),
        ((a(pads=(2, 0, 0, 0)), [4, 8, 2, 3], x, True), False),
        ((a(pads=(0, 0, 2, 0)), [4, 8, 2, 3], x, True), False),
        ((a(pads=(-1, 0, 0, 0)), [4, 8, 3, 3], x, True), False),  # negative pads (a crop)
        ((a(pads=(0, 0, 0, -1)), [4, 8, 3, 3], x, True), False),
        ((a(pads=(0, 0, -1, 0)), [4, 8, 3, 3], x, True), False),
        ((a(pads=(0, -1, 0, 0)), [4, 8, 3, 3], x, True), False),
        ((a(dilations=(1, 2)), [4, 8, 3, 3], x, True), False),
        ((a(dilations=(2, 1)), [4, 8, 3, 3], x, True), False),
        ((a(strides=(1, 2)), [4, 8, 3, 3], x, True), False),
        ((a(), None, x, True), False),
        ((a(), [4, 8, None, 3], x, True), False),
        ((a(), [4, 8, 1, 1], None, True), False),
        ((a(), [4, 8, 1, 1], [2, None, 6, 6], False), False),
        ((a(), [4, 8, 1, 1], [None, 8, 6, 6], False), True),     # the batch need not be known
        (({"group": 1, "strides": [1], "pads": [1, 2], "dilations": [1]}, [4, 8, 3], [2, 8, 9], True), True),
        (({"group": 1, "strides": [1], "pads": [1, 3], "dilations": [1]}, [4, 8, 3], [2, 8, 9], True), False),
        (({"group": 1, "strides": [1] * 3, "pads": [0, 1, 0, 1, 0, 1], "dilations": [1] * 3},
          [4, 8, 2, 2, 2], [1, 8, 3, 3, 3], True), True),
        # depthwise (a filter per channel), fed weights only, stride 1, no dilation, pads within
        # the reach, at most DEPTHWISE_INPUT_GRADIENT_MAX_TAPS taps
        ((a(group=8, pads=(1, 1, 1, 1)), [8, 1, 3, 3], x, False), False),   # constant weights
        ((a(group=8, pads=(1, 1, 1, 1)), [8, 1, 3, 3], x, True), True),
        ((a(group=8), [8, 1, 3, 3], x, True), True),
        ((a(group=8, pads=(2, 2, 2, 2)), [8, 1, 3, 3], x, True), True),
        ((a(group=8, pads=(3, 1, 1, 1)), [8, 1, 3, 3], x, True), False),
        ((a(group=8, pads=(1, 1, 1, -1)), [8, 1, 3, 3], x, True), False),
        ((a(group=8), [8, 1, 1, 1], x, True), True),
        ((a(group=8), [8, 1, 1, 1], x, False), False),
        ((a(group=8, pads=(0, 4, 0, 4)), [8, 1, 1, 9], x, True), True),     # 9 taps
        ((a(group=8, pads=(2, 2, 2, 2)), [8, 1, 5, 5], x, True), False),    # 25 taps
        ((a(group=8, pads=(0, 4, 0, 5)), [8, 1, 1, 10], x, True), False),   # 10 taps
        ((a(group=8, strides=(2, 2), pads=(1, 1, 1, 1)), [8, 1, 3, 3], x, True), False),
        ((a(group=8, strides=(1, 2), pads=(1, 1, 1, 1)), [8, 1, 3, 3], x, True), False),
        ((a(group=8, dilations=(2, 2), pads=(2, 2, 2, 2)), [8, 1, 3, 3], x, True), False),
        ((a(group=8, pads=(1, 1, 1, 1)), [16, 1, 3, 3], x, True), False),    # two filters per channel
        ((a(group=4, pads=(1, 1, 1, 1)), [8, 2, 3, 3], x, True), False),     # grouped, not depthwise
        ((a(group=8, pads=(1, 1, 1, 1)), [8, 1, 3, 3], [2, None, 6, 6], True), False),
        (({"group": 8, "strides": [1], "pads": [1, 1], "dilations": [1]}, [8, 1, 3], [2, 8, 9], True), True),
    ]
    for (attrs, kernel, shape, fed), applies in cases:
        assert rules.conv_input_gradient_applies(attrs, kernel, shape, fed) is applies, (attrs, kernel, shape, fed)
    assert rules.conv_input_gradient_applies(a(), [4, 8, 3, 3], x) is False   # fed defaults to False
    monkeypatch.setattr(rules, "LARGER_INPUT_GRADIENTS_AS_CONV", True)
    assert rules.conv_input_gradient_applies(a(), [4, 8, 3, 3], x) is True
    assert rules.conv_input_gradient_applies(a(), [9, 8, 3, 3], x) is False
    # with the convolutions written in a blocked layout (`rules.conv_block`): constant weights too,
    # two spatial axes, where the gradient Conv's input channels (the filters) fill whole blocks
    monkeypatch.setattr(rules, "LARGER_INPUT_GRADIENTS_AS_CONV", False)
    monkeypatch.setattr(rules, "conv_block", lambda: 16)
    x32 = [8, 32, 16, 16]
    blocked_cases = [
        ((a(pads=(1, 1, 1, 1)), [16, 32, 3, 3], x32), True),
        ((a(pads=(1, 1, 1, 1)), [32, 32, 3, 3], x32), True),
        ((a(pads=(1, 1, 1, 1)), [24, 32, 3, 3], x32), False),      # the filters not whole blocks
        ((a(pads=(1, 1, 1, 1)), [48, 32, 3, 3], x32), False),      # fewer input channels than filters
        ((a(strides=(2, 2), pads=(1, 1, 1, 1)), [16, 32, 3, 3], x32), False),
        ((a(dilations=(2, 2), pads=(2, 2, 2, 2)), [16, 32, 3, 3], x32), False),
        ((a(group=32, pads=(1, 1, 1, 1)), [32, 1, 3, 3], x32), True),
        ((a(group=8, pads=(1, 1, 1, 1)), [8, 1, 3, 3], [8, 8, 16, 16]), False),   # 8 channels: not a whole block
        ((a(pads=(1, 1, 1, 1)), [16, 32, 3, 3], [2, 32, 16, 16]), True),    # 512 pixels: the least written
        ((a(pads=(1, 1, 1, 1)), [16, 32, 3, 3], [2, 32, 16, 15]), False),   # blocked for a computed weight
        ((a(group=32, strides=(2, 2), pads=(1, 1, 1, 1)), [32, 1, 3, 3], x32), False),
        ((a(group=32, pads=(2, 2, 2, 2)), [32, 1, 5, 5], x32), True),       # blocked: up to 7 x 7
        ((a(group=32, pads=(3, 3, 3, 3)), [32, 1, 7, 7], x32), True),
        ((a(group=32, pads=(4, 4, 4, 4)), [32, 1, 9, 9], x32), False),      # 81 taps
        (({"group": 1, "strides": [1], "pads": [1, 1], "dilations": [1]}, [16, 32, 3], [2, 32, 9]), False),
    ]
    for (attrs, kernel, shape), applies in blocked_cases:
        assert rules.conv_input_gradient_applies(attrs, kernel, shape) is applies, (attrs, kernel, shape)
    monkeypatch.setattr(rules, "conv_block", lambda: None)
    for (attrs, kernel, shape), _ in blocked_cases:
        assert rules.conv_input_gradient_applies(attrs, kernel, shape) is False, (attrs, kernel, shape)


def test_transposed_pads_lost_follows_its_docstring():
    """ONNX's ConvTranspose given output_shape pads total = stride * (out - 1) + (kernel - 1) *
    dilation + 1 - in (at least 0), the larger half first; lost where that first half is not the
    Conv's first pad. Worked out per case: (pads, stride, dilation, kernel, in) -> out, total."""
    def lost(pads, strides, kernel, x, dilations=None):
        spatial = len(kernel) - 2
        dilations = dilations or [1] * spatial
        y = [x[0], kernel[0]] + [(x[2 + i] + pads[i] + pads[spatial + i] - (kernel[2 + i] - 1) * dilations[i] - 1)
                                 // strides[i] + 1 for i in range(spatial)]
        attrs = {"group": 1, "strides": strides, "pads": pads, "dilations": dilations}
        return rules.transposed_pads_lost(attrs, kernel, x, y)

    assert lost([0, 1], [2], [4, 3, 3], [2, 3, 6])          # out 3, total 1: first half 1, pad 0
    assert not lost([1, 1], [2], [4, 3, 3], [2, 3, 6])      # out 3, total 1: 1 = pad
    assert not lost([1, 1], [1], [4, 3, 3], [2, 3, 5])      # out 5, total 2: 1 = pad
    assert lost([2, 2], [3], [4, 3, 1], [2, 3, 5])          # out 3, total 2: 1, pad 2
    assert not lost([0, 0], [2], [4, 3, 3], [2, 3, 6])      # out 2, total -1 -> 0
    assert not lost([1, 0], [1], [4, 3, 2], [2, 3, 5])      # out 5, total 1: 1 = pad
    assert lost([0, 1], [1], [4, 3, 2], [2, 3, 5])          # out 5, total 1: 1, pad 0
    assert lost([2, 0], [1], [4, 3, 3], [2, 3, 5])          # out 5, total 2: 1, pad 2
    assert not lost([2, 2], [1], [4, 3, 3], [2, 3, 5], [2])  # dilation 2: out 5, total 4: 2 = pad
    assert not lost([1, 1], [1], [4, 3, 3], [2, 3, 5], [2])  # out 3, total 2: 1 = pad
    assert lost([0, 2], [1], [4, 3, 3], [2, 3, 5], [2])      # out 3, total 2: 1, pad 0
    assert not lost([1, 1, 1, 1], [2, 1], [4, 3, 3, 3], [2, 3, 6, 5])
    # pads are [first of each axis, then last of each axis]
    assert lost([1, 0, 1, 1], [1, 1], [4, 3, 3, 3], [2, 3, 6, 5])   # the second axis: out 4, total 1, first pad 0
    assert not lost([1, 1, 0, 1], [2, 2], [4, 3, 3, 3], [2, 3, 6, 6])   # totals 1 and 1, first pads 1 and 1
    assert lost([1, 0, 1, 1], [2, 2], [4, 3, 3, 3], [2, 3, 6, 6])       # the second axis: total 1, first pad 0
    # each axis its own kernel size: [4, 5, 3, 2] (5 input channels)
    assert not lost([1, 1, 1, 0], [1, 1], [4, 5, 3, 2], [2, 5, 6, 6])   # out 6, 6: totals 2, 1 -> 1, 1
    assert lost([1, 0, 1, 1], [1, 1], [4, 5, 3, 2], [2, 5, 6, 6])       # the second: total 1, first pad 0
    attrs = {"group": 1, "strides": [2], "pads": [0, 1], "dilations": [1]}
    assert not rules.transposed_pads_lost(attrs, None, [2, 3, 6], [2, 4, 3])   # unknown: onnx-ad's rule
    assert not rules.transposed_pads_lost(attrs, [4, 3, 3], None, [2, 4, 3])
    assert not rules.transposed_pads_lost(attrs, [4, 3, 3], [2, 3, 6], None)
    assert not rules.transposed_pads_lost(attrs, [4, 3, None], [2, 3, 6], [2, 4, 3])
    assert not rules.transposed_pads_lost(attrs, [4, 3, 3], [2, 3, None], [2, 4, 3])
    assert not rules.transposed_pads_lost(attrs, [4, 3, 3], [2, 3, 6], [2, 4, None])
    assert rules.transposed_pads_lost(attrs, [4, 3, 3], [2, 3, 6], [2, 4, 3])


def _slices_in_onnx_runtime(extent, bounds):
    """ONNX Runtime's Slice of range(extent) for every (start, end, step) in `bounds`: the
    positions each reads (one model, a Slice node per triple)."""
    nodes, inits, outputs = [], [], []
    for k, triple in enumerate(bounds):
        for name, value in zip("set", triple):
            inits.append(numpy_helper.from_array(np.array([value], np.int64), f"{name}{k}"))
        nodes.append(helper.make_node("Slice", ["x", f"s{k}", f"e{k}", "", f"t{k}"], [f"y{k}"]))
        outputs.append(helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "slices", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [extent])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    read = _run(model, {"x": np.arange(extent, dtype=np.float32)})
    return [read[f"y{k}"].astype(int).tolist() for k in range(len(bounds))]


def test_slice_positions_reads_what_onnx_runtime_reads():
    """Against ONNX Runtime's own Slice (which, unlike Python's slicing, clamps a start before
    the first element to the first element when stepping backwards: [-9::-1] of 6 reads [0])."""
    values = [-(1 << 62), -9, -7, -6, -5, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7, 1 << 62]
    for extent in (1, 2, 5, 6):
        bounds = list(itertools.product(values, values, [-4, -3, -2, -1, 1, 2, 3, 7]))
        for (start, end, step), read in zip(bounds, _slices_in_onnx_runtime(extent, bounds)):
            first, count = rules.slice_positions(extent, start, end, step)
            assert count == len(read), (extent, start, end, step)
            if read:
                assert first == read[0], (extent, start, end, step)


def test_slice_positions_refuses_a_zero_step():
    with pytest.raises(UnsupportedOperator, match="^Slice with a step of 0$"):
        rules.slice_positions(5, 0, 5, 0)


def test_weights_fed_sets_and_restores_the_fed_weights():
    assert rules.FED_WEIGHTS == frozenset()
    with rules.weights_fed(["a", "b"]):
        assert rules.FED_WEIGHTS == frozenset({"a", "b"})
        with rules.weights_fed(("c",)):
            assert rules.FED_WEIGHTS == frozenset({"c"})
        assert rules.FED_WEIGHTS == frozenset({"a", "b"})
    assert rules.FED_WEIGHTS == frozenset()
    with pytest.raises(KeyError):
        with rules.weights_fed(["a"]):
            raise KeyError("inside")
    assert rules.FED_WEIGHTS == frozenset()


def test_register_installs_every_rule():
    _register_fresh()
    rules.register()   # idempotent
    assert onnx_ad_rules.REVERSE["BatchNormalization"] is rules._batch_norm_reverse
    assert onnx_ad_rules.REVERSE["Conv"] is rules._conv_reverse
    assert onnx_ad_rules.REVERSE["MatMul"] is rules._matmul_reverse
    assert onnx_ad_rules.REVERSE["ConvTranspose"] is rules._conv_transpose_reverse
    assert onnx_ad_rules.REVERSE["Slice"] is rules._slice_reverse
    assert onnx_ad_rules.REVERSE["Gather"] is rules._gather_reverse
    assert onnx_ad_rules.DERIVATIVE["Relu"] is rules._d_relu
    assert onnx_ad_rules.DERIVATIVE["LeakyRelu"] is rules._d_leaky_relu


# ---- Conv -----------------------------------------------------------------------------------------

def _torch_conv(x, w, b=None, *, group=1, strides=None, pads=None, dilations=None):
    spatial = x.dim() - 2
    pads = pads or [0] * (2 * spatial)
    widths = []
    for axis in reversed(range(spatial)):   # F.pad: the last axis first
        widths += [pads[axis], pads[spatial + axis]]
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spatial]
    return conv(F.pad(x, widths), w, b, stride=strides or 1, dilation=dilations or 1, groups=group)


# name: x shape, w shape, attributes, with a bias; the weight gradient's form (whole: one
# convolution, per_tap: a Gemm per tap, depthwise: a Mul and a ReduceSum per tap, onnx_ad: onnx-ad's)
CONV_CASES = {
    "grouped": ([2, 4, 5, 6], [6, 2, 3, 2], dict(group=2, strides=[2, 1], dilations=[1, 2], pads=[1, 0, 2, 1]),
                True, "whole"),
    "grouped_3d": ([1, 4, 3, 4, 4], [4, 2, 2, 2, 2], dict(group=2, pads=[0, 1, 0, 1, 0, 1]), False, "whole"),
    "grouped_1d": ([2, 6, 9], [6, 2, 3], dict(group=3, strides=[2], pads=[1, 0]), True, "whole"),
    "depthwise": ([2, 8, 5, 5], [8, 1, 3, 3], dict(group=8, pads=[1, 1, 1, 1]), True, "depthwise"),
    "depthwise_strided": ([2, 8, 7, 6], [8, 1, 3, 2], dict(group=8, strides=[2, 2], dilations=[2, 1],
                                                           pads=[1, 0, 0, 1]), False, "depthwise"),
    "depthwise_1d": ([2, 8, 7], [8, 1, 3], dict(group=8, strides=[2]), False, "depthwise"),
    # over rules.TAPS_GATHERED_MIN_CHANNELS channels: channels last, a tap's rows gathered
    "depthwise_gathered": ([2, 32, 7, 6], [32, 1, 3, 2], dict(group=32, strides=[2, 2], dilations=[2, 1],
                                                             pads=[1, 0, 0, 1]), True, "depthwise"),
    "depthwise_gathered_1d": ([2, 40, 9], [40, 1, 3], dict(group=40, strides=[2], pads=[1, 1]), False, "depthwise"),
    "depthwise_few_channels": ([2, 3, 5, 5], [3, 1, 3, 3], dict(group=3, pads=[1, 1, 1, 1]), False, "whole"),
    "depthwise_large_kernel": ([1, 8, 6, 6], [8, 1, 5, 5], dict(group=8, pads=[2, 2, 2, 2]), False, "whole"),
    "depthwise_multiplier": ([2, 4, 5, 5], [8, 1, 3, 3], dict(group=4), False, "whole"),
    "fewer_filters": ([2, 8, 5, 6], [4, 8, 3, 3], dict(pads=[1, 1, 1, 1]), True, "per_tap"),
    "fewer_filters_dilated": ([2, 8, 7, 6], [4, 8, 3, 2], dict(dilations=[2, 1], pads=[0, 1, 2, 0]), False,
                              "per_tap"),
    "fewer_filters_1d": ([2, 8, 9], [4, 8, 3], dict(dilations=[2], pads=[1, 2]), False, "per_tap"),
    "fewer_filters_3d": ([1, 8, 3, 4, 4], [4, 8, 2, 2, 2], dict(pads=[0, 1, 0, 1, 0, 0]), False, "per_tap"),
    "fewer_filters_strided": ([2, 8, 6, 7], [4, 8, 3, 3], dict(strides=[2, 2], pads=[1, 1, 0, 1]), True, "per_tap"),
    "pointwise": ([2, 8, 4, 5], [4, 8, 1, 1], dict(), True, "per_tap"),
    "pointwise_more_filters": ([2, 3, 4, 5], [6, 3, 1, 1], dict(), True, "per_tap"),
    "pointwise_padded": ([2, 8, 4, 4], [4, 8, 1, 1], dict(pads=[1, 0, 0, 1]), False, "per_tap"),
    "pointwise_strided": ([2, 3, 5, 5], [6, 3, 1, 1], dict(strides=[2, 2]), False, "per_tap"),
    "pointwise_1d": ([2, 3, 7], [5, 3, 1], dict(), False, "per_tap"),
    "same_channels_strided": ([2, 8, 5, 5], [8, 8, 3, 3], dict(strides=[2, 2], pads=[1, 1, 1, 1]), True, "per_tap"),
    "more_filters": ([2, 8, 5, 5], [12, 8, 3, 3], dict(pads=[1, 1, 1, 1]), False, "per_tap"),
    "more_filters_strided": ([2, 8, 6, 5], [12, 8, 2, 3], dict(strides=[2, 1], dilations=[1, 2]), False, "per_tap"),
    "few_channels": ([2, 3, 5, 5], [4, 3, 3, 3], dict(pads=[1, 1, 1, 1]), True, "onnx_ad"),
    "few_channels_1d": ([2, 3, 9], [4, 3, 3], dict(pads=[1, 1]), False, "onnx_ad"),
    "few_channels_3x1": ([2, 3, 5, 5], [4, 3, 3, 1], dict(pads=[1, 0, 1, 0]), False, "onnx_ad"),
    "same_channels": ([2, 8, 5, 5], [8, 8, 3, 3], dict(pads=[1, 1, 1, 1]), False, "per_tap"),
    # the source moving channels last (rules._channels_last_taps) over one and three spatial axes
    "same_channels_1d": ([3, 8, 8], [8, 8, 3], dict(pads=[1, 1]), False, "per_tap"),
    "same_channels_3d": ([3, 8, 4, 3, 3], [8, 8, 3, 3, 3], dict(pads=[1, 1, 1, 1, 1, 1]), False, "per_tap"),
    "two_taps": ([2, 8, 5, 6], [4, 8, 1, 2], dict(pads=[0, 1, 0, 0]), False, "per_tap"),
    # ... its products per image over large maps (rules.TAPS_PER_IMAGE_MIN_PIXELS), rows sliced or gathered
    "per_image": ([2, 32, 32, 33], [40, 32, 3, 3], dict(pads=[1, 1, 1, 1]), True, "per_tap"),
    "per_image_1d": ([3, 8, 1100], [12, 8, 3], dict(pads=[1, 1]), False, "per_tap"),
    # ... and its rows gathered (rules.TAPS_GATHERED_MIN_CHANNELS channels or more)
    "gathered": ([2, 32, 5, 6], [40, 32, 3, 2], dict(strides=[2, 1], dilations=[1, 2], pads=[1, 0, 1, 1]), True,
                 "per_tap"),
    "gathered_1d": ([3, 32, 9], [32, 32, 3], dict(pads=[1, 1]), False, "per_tap"),
    "gathered_3d": ([1, 32, 3, 4, 3], [32, 32, 2, 2, 3], dict(strides=[1, 2, 1], pads=[0, 1, 0, 1, 0, 1]), False,
                    "per_tap"),
    "stride_remainder": ([2, 3, 5, 7], [4, 3, 2, 2], dict(strides=[3, 3], pads=[1, 1, 1, 1]), True, "onnx_ad"),
    "tf_same": ([2, 3, 6, 6], [4, 3, 3, 3], dict(strides=[2, 2], pads=[0, 0, 1, 1]), False, "onnx_ad"),
}


def _conv_arrays(x_shape, w_shape, bias, name="conv"):
    rng = np.random.default_rng(len(name) * 31 + sum(x_shape) + sum(w_shape))
    arrays = {"x": _random(*x_shape, rng=rng), "w": _random(*w_shape, rng=rng)}
    if bias:
        arrays["b"] = _random(w_shape[0], rng=rng)
    return arrays


def _conv_node(attrs, bias, op="Conv"):
    return helper.make_node(op, ["x", "w"] + (["b"] if bias else []), ["y"], **attrs)


def _weight_gradient_form(ops):
    """Which rule wrote the weight gradient, from the gradient graph's operators."""
    convs = ops.count("Conv")
    if "Gemm" in ops or "MatMul" in ops:
        return "per_tap"
    if "ReduceSum" in ops and convs == 0 and "Mul" in ops:
        return "depthwise"
    return {1: "whole_or_onnx_ad"}.get(convs, f"{convs} convolutions")


@pytest.mark.parametrize("name", list(CONV_CASES))
def test_conv_gradients_against_torch(name):
    x_shape, w_shape, attrs, bias, form = CONV_CASES[name]
    arrays = _conv_arrays(x_shape, w_shape, bias, name)
    wrt = list(arrays)
    gradient_graph = _check([_conv_node(attrs, bias)], arrays, wrt,
                            lambda x, w, b=None: _torch_conv(x, w, b, **attrs))
    ops = _added_ops(gradient_graph)
    written = _weight_gradient_form([op for op in ops if op != "ConvTranspose"])
    spatial = len(x_shape) - 2
    full = {"group": attrs.get("group", 1), "strides": attrs.get("strides", [1] * spatial),
            "pads": attrs.get("pads", [0] * 2 * spatial), "dilations": attrs.get("dilations", [1] * spatial)}
    # a Conv where the rule says so: 1 x 1 kernels, and with convolutions blocked (rules.conv_block:
    # 8 channels on an AVX2 machine, 16 on an AVX-512 one) a depthwise one whose channels fill blocks
    if rules.conv_input_gradient_applies(full, w_shape, x_shape):   # one more Conv, not a ConvTranspose
        assert "ConvTranspose" not in ops, ops
        ops.remove("Conv")
        written = _weight_gradient_form([op for op in ops])
    else:
        assert ops.count("ConvTranspose") == 1, ops
    taps = int(np.prod(w_shape[2:]))
    if form == "per_tap":
        assert written == "per_tap" and ops.count("Gemm") + ops.count("MatMul") == taps, ops
    elif form == "depthwise":
        assert written == "depthwise" and ops.count("ReduceSum") >= taps, ops
    else:   # one convolution: graphopt's (a grouped weight; onnx-ad refuses it) or onnx-ad's own
        assert written == "whole_or_onnx_ad", ops
        if form == "onnx_ad":
            assert any(o.startswith("a_conv_w") for n in gradient_graph.graph.node for o in n.output)
        else:
            assert not any(o.startswith("a_conv_w") for n in gradient_graph.graph.node for o in n.output)


def _initializers(gradient_graph):
    return {t.name: numpy_helper.to_array(t) for t in gradient_graph.graph.initializer}


@pytest.mark.parametrize("name", [n for n, case in CONV_CASES.items() if case[4] in ("per_tap", "depthwise")])
def test_per_tap_layout_follows_its_docstring(name):
    """per_tap_weight_gradient's docstring, on the gradient graph: one product per tap (or,
    depthwise, a Mul and a ReduceSum). At stride 1 with fewer filters than channels (ungrouped)
    the adjoint moves: a Gemm per tap taking the larger operand first, one flattened copy of the
    adjoint with `lead` whole rows of zeros before each image (in the Pad that places it on the
    padded grid), at least reach = sum((k - 1) * dilation * grid) over the padded grid's row
    sizes, and per tap a Slice of it at those zeros minus the tap's flat offset; the
    source rows are shared by every tap. Otherwise (ungrouped, _channels_last_taps) the (padded)
    source is transposed channels last (then padded) and read per tap at the tap's offset with the
    strides as steps, a Gemm per tap of the shared adjoint rows [F, K] by the source rows [K, C], neither
    transposed. A 1 x 1 kernel at stride 1 without pads moves nothing (no Slice, no Pad, no
    Concat)."""
    x_shape, w_shape, attrs, bias, form = CONV_CASES[name]
    arrays = _conv_arrays(x_shape, w_shape, bias, name)
    output_shape = _torch_conv(torch.zeros(x_shape), torch.zeros(w_shape), **attrs).shape
    gradient_graph = _reverse(_model([_conv_node(attrs, bias)], arrays, output_shape), ["w"])
    nodes = list(gradient_graph.graph.node)
    constants = _initializers(gradient_graph)
    producers = {o: n for n in nodes for o in n.output}
    spatial = len(w_shape) - 2
    strides, dilations = attrs.get("strides", [1] * spatial), attrs.get("dilations", [1] * spatial)
    pads = attrs.get("pads", [0] * 2 * spatial)
    filters, channels, kernel = w_shape[0], x_shape[1], w_shape[2:]
    taps = list(itertools.product(*(range(k) for k in kernel)))
    ops = [n.op_type for n in nodes[1:]]
    whole = all(k == 1 for k in kernel) and all(s == 1 for s in strides) and not any(pads)
    shift = form == "per_tap" and filters < channels and all(s == 1 for s in strides)
    source_moves = form == "per_tap" and not shift and not whole
    if form == "depthwise":
        assert ops.count("Mul") == len(taps) and ops.count("ReduceSum") == len(taps) and "Gemm" not in ops
        gathers = [n for n in nodes if n.op_type == "Gather"]
        assert bool(gathers) == ("gathered" in name), "which cases gather"
        if gathers:   # source and adjoint channels last; each tap's product summed over images and positions
            last = [0] + list(range(2, 2 + spatial)) + [1]
            assert sorted(list(n.attribute[0].ints) for n in nodes if n.op_type == "Transpose") == [last, last]
            sums = [n for n in nodes if n.op_type == "ReduceSum"]
            assert {tuple(constants[n.input[1]].tolist()) for n in sums} == {(0, 1)}
    elif source_moves:
        shapes = {n.output[0]: constants[n.input[1]].tolist() for n in nodes if n.op_type == "Reshape"}
        out_pixels = int(np.prod(output_shape[2:]))
        if out_pixels >= rules.TAPS_PER_IMAGE_MIN_PIXELS and filters * channels <= \
                rules.TAPS_PER_IMAGE_MAX_FILTERS_BY_CHANNELS:   # a product per image, summed over them
            assert name.startswith("per_image")
            products = [n for n in nodes if n.op_type == "MatMul"]
            assert len(products) == len(taps) and "Gemm" not in ops
            assert {tuple(shapes[p.input[1]]) for p in products} == {(0, -1, channels)}
            (shared,) = {p.input[0] for p in products}
            assert shapes[shared] == [0, filters, -1]
            assert ops.count("Transpose") == 1, "the adjoint as it lies: only the source is transposed"
            sums = [n for n in nodes if n.op_type == "ReduceSum"]   # each product summed over the images
            assert sorted(n.input[0] for n in sums) == sorted(p.output[0] for p in products)
            assert {(tuple(constants[n.input[1]].tolist()), attribute(n, "keepdims", 1)) for n in sums} == {((0,), 0)}
        else:
            assert not name.startswith("per_image")
            products = [n for n in nodes if n.op_type == "Gemm"]
            assert len(products) == len(taps) and "MatMul" not in ops
            assert {(attribute(p, "transA", 0), attribute(p, "transB", 0)) for p in products} == {(0, 0)}
            assert {shapes[p.input[1]] == [-1, channels] for p in products} == {True}
            (shared,) = {p.input[0] for p in products}
            assert shapes[shared] == [filters, -1]
        (last,) = [n for n in nodes if n.op_type == "Transpose" and list(n.attribute[0].ints) ==
                   [0] + list(range(2, 2 + spatial)) + [1]]
        source_last = last.output[0]
        if any(pads):   # transposed first, then padded channels last
            (pad,) = [n for n in nodes if n.op_type == "Pad"]
            assert pad.input[0] == source_last
            assert constants[pad.input[1]].tolist() == [0] + pads[:spatial] + [0, 0] + pads[spatial:] + [0]
            source_last = pad.output[0]
        assert {n.input[0] for n in nodes if n.op_type == "Slice"} <= {source_last}
        gathers = [n for n in nodes if n.op_type == "Gather"]
        assert bool(gathers) == (name.startswith("gathered") or name == "per_image"), "which cases gather"
        if channels >= rules.TAPS_GATHERED_MIN_CHANNELS:   # one Gather per tap of each image's grid rows
            assert len(gathers) == len(taps) and "Slice" not in ops
            assert {producers[g.input[0]].input[0] for g in gathers} == {source_last}
            assert {attribute(g, "axis", 0) for g in gathers} == {1}
            assert {tuple(shapes[g.input[0]]) for g in gathers} == {(0, -1, channels)}
        else:
            assert gathers == [] and ops.count("Slice") == len(taps)
    else:
        gemms = [n for n in nodes if n.op_type == "Gemm"]
        assert len(gemms) == len(taps)

        def rows(value):   # each Gemm operand is a Reshape to [rows, -1]
            return int(constants[producers[value].input[1]][0])
        for gemm in gemms:
            assert rows(gemm.input[0]) >= rows(gemm.input[1]), "the larger operand first"
            assert {rows(gemm.input[0]), rows(gemm.input[1])} == {filters, channels}
        if len(taps) > 1:
            (shared,) = set.intersection(*(set(g.input[:2]) for g in gemms))
            assert rows(shared) == (channels if shift else filters)
    if whole:
        assert not {"Slice", "Pad", "Concat"} & set(ops), ops
        return
    assert ops.count("Concat") == (1 if len(taps) > 1 else 0)
    padded = [d + pads[i] + pads[spatial + i] for i, d in enumerate(x_shape[2:])]
    grid = [int(np.prod(padded[i + 1:])) for i in range(spatial)]
    moved = [n for n in nodes if n.op_type == "Slice"]
    gathered = [n for n in nodes if n.op_type == "Gather"]
    shifted = [n for n in nodes if n.op_type == "Pad" and producers.get(n.input[0]) is not None
               and producers[n.input[0]].op_type == "Reshape"]
    assert shifted == [], "the rows of zeros before each image in the origin's own Pad"
    if shift:
        reach = sum((k - 1) * d * g for k, d, g in zip(kernel, dilations, grid))
        lead = -(-reach // grid[0])
        (origin,) = [n for n in nodes if n.op_type == "Pad" and n.output[0] in
                     {producers[m.input[0]].input[0] for m in moved}]
        out_sizes = list(output_shape[2:])
        assert constants[origin.input[1]].tolist() == [0, 0, lead] + [0] * (spatial - 1) + [0, 0] + [
            p - n for p, n in zip(padded, out_sizes)]
        starts = sorted(lead * grid[0] - sum(t * d * g for t, d, g in zip(tap, dilations, grid)) for tap in taps)
        assert sorted(int(constants[n.input[1]][0]) for n in moved) == starts
        flat = int(np.prod(padded))
        assert all(constants[n.input[2]][0] - constants[n.input[1]][0] == flat for n in moved)
    else:
        out_sizes = list(output_shape[2:])
        expected = sorted(([t * d for t, d in zip(tap, dilations)],
                           [t * d + s * (n - 1) + 1 for t, d, s, n in zip(tap, dilations, strides, out_sizes)],
                           list(range(1, 1 + spatial)) if source_moves else list(range(2, 2 + spatial)),
                           list(strides)) for tap in taps)
        if gathered:   # the rows a tap's Slice would read, numbered in the padded grid by numpy
            numbered = np.arange(int(np.prod(padded))).reshape(padded)
            assert sorted(constants[n.input[1]].tolist() for n in gathered) == sorted(
                numbered[tuple(slice(b, e, s) for b, e, s in zip(start, end, step))].ravel().tolist()
                for start, end, _, step in expected)
        else:
            assert sorted([constants[i].tolist() for i in n.input[1:]] for n in moved) == [list(e) for e in expected]


@pytest.mark.parametrize("name", ["grouped", "depthwise", "fewer_filters", "pointwise", "more_filters_strided"])
def test_conv_weight_gradient_alone(name):
    """The weight alone asked for (a frozen input): no input gradient is written."""
    x_shape, w_shape, attrs, bias, _ = CONV_CASES[name]
    arrays = _conv_arrays(x_shape, w_shape, bias, name)
    wrt = [n for n in arrays if n != "x"]
    gradient_graph = _check([_conv_node(attrs, bias)], arrays, wrt, lambda x, w, b=None: _torch_conv(x, w, b, **attrs))
    assert "ConvTranspose" not in _added_ops(gradient_graph)
    assert [o.name for o in gradient_graph.graph.output] == ["y"] + [f"adj_{n}" for n in wrt]


@pytest.mark.parametrize("name", ["grouped", "depthwise", "fewer_filters", "pointwise", "few_channels"])
def test_conv_input_gradient_alone(name):
    """The input alone asked for (a frozen weight): no weight gradient is written."""
    x_shape, w_shape, attrs, bias, _ = CONV_CASES[name]
    arrays = _conv_arrays(x_shape, w_shape, bias, name)
    gradient_graph = _check([_conv_node(attrs, bias)], arrays, ["x"], lambda x, w, b=None: _torch_conv(x, w, b, **attrs))
    ops = _added_ops(gradient_graph)
    assert "Gemm" not in ops and "ReduceSum" not in ops
    assert ops.count("Conv") + ops.count("ConvTranspose") == 1, ops


# name: x shape, w shape, attributes; whether the input gradient is a Conv when the weight is fed
FED_CASES = {
    "fed_3x3": ([2, 8, 5, 6], [6, 8, 3, 3], dict(pads=[1, 1, 1, 1]), True),
    "fed_asymmetric": ([2, 8, 6, 5], [4, 8, 3, 2], dict(pads=[0, 1, 2, 0]), True),
    "fed_unpadded": ([2, 8, 6, 5], [8, 8, 2, 3], dict(), True),
    "fed_1d": ([2, 8, 9], [4, 8, 3], dict(pads=[2, 1]), True),
    "fed_3d": ([1, 8, 3, 4, 4], [4, 8, 2, 2, 2], dict(pads=[0, 1, 0, 1, 0, 1]), True),
    "fed_1x3": ([2, 8, 4, 6], [4, 8, 1, 3], dict(pads=[0, 1, 0, 1]), True),
    "fed_dilated": ([2, 8, 7, 7], [4, 8, 3, 3], dict(dilations=[2, 2], pads=[2, 2, 2, 2]), False),
    "fed_more_filters": ([2, 4, 5, 5], [8, 4, 3, 3], dict(pads=[1, 1, 1, 1]), False),
    "fed_strided": ([2, 8, 5, 5], [4, 8, 3, 3], dict(strides=[2, 2], pads=[1, 1, 1, 1]), False),
    "fed_grouped": ([2, 8, 5, 5], [4, 4, 3, 3], dict(group=2, pads=[1, 1, 1, 1]), False),
    "fed_pointwise_padded": ([2, 8, 4, 4], [4, 8, 1, 1], dict(pads=[0, 1, 0, 0]), False),
}


@pytest.mark.parametrize("name", list(FED_CASES))
def test_conv_input_gradient_of_a_fed_weight(name):
    x_shape, w_shape, attrs, as_conv = FED_CASES[name]
    arrays = _conv_arrays(x_shape, w_shape, True, name)
    gradient_graph = _check([_conv_node(attrs, True)], arrays, ["x", "w", "b"],
                            lambda x, w, b: _torch_conv(x, w, b, **attrs), fed={"w"})
    ops = _added_ops(gradient_graph)
    assert ("ConvTranspose" not in ops) is as_conv, ops
    gradient_graph = _check([_conv_node(attrs, True)], arrays, ["x"],
                            lambda x, w, b: _torch_conv(x, w, b, **attrs), fed={"w"})
    assert ("ConvTranspose" not in _added_ops(gradient_graph)) is as_conv
    # another weight fed: this one's input gradient is onnx-ad's ConvTranspose
    gradient_graph = _check([_conv_node(attrs, True)], arrays, ["x"],
                            lambda x, w, b: _torch_conv(x, w, b, **attrs), fed={"b", "x"})
    assert "ConvTranspose" in _added_ops(gradient_graph)


def test_conv_input_gradient_as_conv_when_switched_on(monkeypatch):
    monkeypatch.setattr(rules, "LARGER_INPUT_GRADIENTS_AS_CONV", True)
    x_shape, w_shape, attrs, _ = FED_CASES["fed_asymmetric"]
    arrays = _conv_arrays(x_shape, w_shape, False, "switched")
    gradient_graph = _check([_conv_node(attrs, False)], arrays, ["x"], lambda x, w: _torch_conv(x, w, **attrs))
    assert "ConvTranspose" not in _added_ops(gradient_graph)


def test_a_weight_shared_by_two_convolutions():
    """y = conv(conv(x, w), w): each node's rule asks for w again (onnx-ad's asked_for is put
    back after each rule); the weight's gradient is the sum of both uses."""
    for w_shape, attrs in [([8, 1, 3, 3], dict(group=8, pads=[1, 1, 1, 1])),
                           ([8, 8, 3, 3], dict(pads=[1, 1, 1, 1])),
                           ([4, 2, 3, 3], dict(group=2, pads=[1, 1, 1, 1])),
                           ([8, 8, 1, 1], dict())]:
        channels = w_shape[0]
        rng = np.random.default_rng(5)
        arrays = {"x": _random(2, channels, 4, 5, rng=rng), "w": _random(*w_shape, rng=rng, scale=0.5)}
        nodes = [helper.make_node("Conv", ["x", "w"], ["h"], **attrs), helper.make_node("Conv", ["h", "w"], ["y"], **attrs)]
        with rules.weights_fed({"w"}):
            _check(nodes, arrays, ["x", "w"], lambda x, w: _torch_conv(_torch_conv(x, w, **attrs), w, **attrs))


def test_grouped_weight_gradient_needs_static_shapes():
    """A clear refusal (it was a TypeError from inside the rule)."""
    x_shape, w_shape, attrs, bias, _ = CONV_CASES["grouped"]
    arrays = _conv_arrays(x_shape, w_shape, False)
    model = _model([_conv_node(attrs, False)], arrays, ["n", 6, 3, 5], dynamic={"x": 0})
    with pytest.raises(UnsupportedOperator, match=r"^a grouped or transposed convolution's weight gradient needs static shapes \(the shape of 'y' is not "
                                                  r"known\)$"):
        _reverse(model, ["w"])
    # a ConvTranspose's output known, its input not: weight_gradient's own refusal
    x_shape, w_shape, attrs, _ = CONV_TRANSPOSE_CASES["grouped"]
    arrays = _conv_arrays(x_shape, w_shape, False)
    model = _model([_conv_node(attrs, False, "ConvTranspose")], arrays, [2, 4, 5, 5], dynamic={"x": 0})
    with pytest.raises(UnsupportedOperator, match="^a grouped or transposed convolution's weight gradient needs static "
                                                  "shapes$"):
        _reverse(model, ["w"])


# ---- ConvTranspose ------------------------------------------------------------------------------

def _torch_conv_transpose(x, w, b=None, *, group=1, strides=None, pads=None, dilations=None, output_padding=None):
    spatial = x.dim() - 2
    conv = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[spatial]
    full = conv(x, w, b, stride=strides or 1, output_padding=output_padding or 0, groups=group,
                dilation=dilations or 1)
    pads = pads or [0] * (2 * spatial)
    crop = tuple([slice(None)] * 2 + [slice(pads[i], full.shape[2 + i] - pads[spatial + i]) for i in range(spatial)])
    return full[crop]


CONV_TRANSPOSE_CASES = {
    "upsampling": ([2, 4, 3, 3], [4, 3, 3, 3], dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]), True),
    "grouped": ([2, 4, 3, 4], [4, 2, 2, 3], dict(group=2, strides=[2, 1], dilations=[1, 2], pads=[0, 1, 1, 0]), True),
    "per_tap": ([2, 4, 3, 3], [4, 8, 3, 3], dict(strides=[2, 2]), False),
    "one_d": ([2, 3, 5], [3, 2, 4], dict(strides=[3], pads=[1, 2]), True),
}


@pytest.mark.parametrize("name", list(CONV_TRANSPOSE_CASES))
def test_conv_transpose_gradients_against_torch(name):
    x_shape, w_shape, attrs, bias = CONV_TRANSPOSE_CASES[name]
    arrays = _conv_arrays(x_shape, w_shape, False, name)
    if bias:
        arrays["b"] = _random(w_shape[1] * attrs.get("group", 1))
    _check([_conv_node(attrs, bias, "ConvTranspose")], arrays, list(arrays),
           lambda x, w, b=None: _torch_conv_transpose(x, w, b, **attrs))
    # the weight alone, and the input alone (onnx-ad's rule, which refuses the weight)
    _check([_conv_node(attrs, bias, "ConvTranspose")], arrays, ["w"],
           lambda x, w, b=None: _torch_conv_transpose(x, w, b, **attrs))
    _check([_conv_node(attrs, bias, "ConvTranspose")], arrays, ["x"],
           lambda x, w, b=None: _torch_conv_transpose(x, w, b, **attrs))


# ---- BatchNormalization -------------------------------------------------------------------------

def _bn_arrays(shape, seed=3):
    rng = np.random.default_rng(seed)
    channels = shape[1]
    # channel spreads from 0.01 to 3: epsilon matters for the narrow ones
    spread = np.geomspace(0.01, 3.0, channels).reshape([1, -1] + [1] * (len(shape) - 2))
    x = (rng.standard_normal(shape) * spread + rng.standard_normal([1, channels] + [1] * (len(shape) - 2)))
    return {"x": x.astype(np.float32), "scale": _random(channels, rng=rng), "bias": _random(channels, rng=rng),
            "mean": _random(channels, rng=rng), "var": (rng.random(channels) + 0.5).astype(np.float32)}


@pytest.mark.parametrize("shape,epsilon", [([3, 4, 2, 3], None), ([4, 3, 5], 0.1), ([6, 5], None),
                                           ([2, 3, 2, 2, 2], 1e-3)])
def test_batch_norm_training_against_torch(shape, epsilon):
    arrays = _bn_arrays(shape)
    extra = {} if epsilon is None else {"epsilon": epsilon}
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y", "mean_out", "var_out"],
                            training_mode=1, **extra)

    def bn(x, scale, bias, mean, var):
        return F.batch_norm(x, mean.detach().clone(), var.detach().clone(), scale, bias, training=True,
                            eps=1e-5 if epsilon is None else epsilon)

    _check([node], arrays, ["x", "scale", "bias"], bn)
    # the running statistics do not change the training-mode output: zero gradients
    _check([node], arrays, ["x", "mean", "var"], bn)
    _check([node], arrays, ["scale"], bn)


def test_batch_norm_gradient_types():
    """The backward is written in X's type (epsilon included): in float64 it matches torch, and
    with float64 X beside float32 running statistics (ONNX allows it; ONNX Runtime's CPU kernels do
    not run it) the gradient graph passes onnx's full type check."""
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y", "mean_out", "var_out"],
                            training_mode=1)
    arrays = {k: v.astype(np.float64) for k, v in _bn_arrays([3, 4, 2, 3]).items()}

    def bn(x, scale, bias, mean, var):
        return F.batch_norm(x, mean.detach().clone(), var.detach().clone(), scale, bias, training=True)
    output_shape = [3, 4, 2, 3]
    seed = _random(*output_shape).astype(np.float64)
    model = _model([node], arrays, output_shape, output_type=TensorProto.DOUBLE)
    gradient_graph = _reverse(model, ["x", "scale", "bias"])
    onnx.checker.check_model(gradient_graph, full_check=True)
    got = _run(gradient_graph, {**arrays, "adj_y": seed[..., None]})
    _, expected = _torch_reference(bn, arrays, ["x", "scale", "bias"], seed)
    for name in ("x", "scale", "bias"):
        np.testing.assert_allclose(got[f"adj_{name}"][..., 0], expected[name], rtol=1e-9, atol=1e-9)
    mixed = {k: (v if k in ("x", "scale", "bias") else v.astype(np.float32)) for k, v in arrays.items()}
    gradient_graph = _reverse(_model([node], mixed, output_shape, output_type=TensorProto.DOUBLE), ["x", "scale"])
    onnx.checker.check_model(gradient_graph, full_check=True)


@pytest.mark.parametrize("training_mode", [None, 0])
def test_batch_norm_inference_against_torch(training_mode):
    arrays = _bn_arrays([3, 4, 2, 3])
    extra = {} if training_mode is None else {"training_mode": training_mode}
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"], epsilon=0.01, **extra)
    _check([node], arrays, ["x", "scale", "bias"],
           lambda x, scale, bias, mean, var: F.batch_norm(x, mean, var, scale, bias, training=False, eps=0.01))


# ---- MatMul -------------------------------------------------------------------------------------

MATMUL_CASES = {
    # name: A shape, W shape, asked for, whether the weight's gradient is one Gemm
    "sequence": ([2, 3, 4], [4, 5], ["a", "w"], True),
    "sequence_weight_alone": ([2, 2, 3, 4], [4, 5], ["w"], True),
    "sequence_input_alone": ([2, 3, 4], [4, 5], ["a"], False),
    "rows": ([3, 4], [4, 5], ["a", "w"], False),
    "batched_weight": ([2, 3, 4], [2, 4, 5], ["a", "w"], False),
    "vector_weight": ([2, 3, 4], [4], ["a", "w"], False),
}


@pytest.mark.parametrize("name", list(MATMUL_CASES))
def test_matmul_against_torch(name):
    a_shape, w_shape, wrt, as_gemm = MATMUL_CASES[name]
    rng = np.random.default_rng(len(name))
    arrays = {"a": _random(*a_shape, rng=rng), "w": _random(*w_shape, rng=rng)}
    gradient_graph = _check([helper.make_node("MatMul", ["a", "w"], ["y"])], arrays, wrt, lambda a, w: a @ w)
    assert ("Gemm" in _added_ops(gradient_graph)) is as_gemm


def test_matmul_with_an_unknown_batch():
    """A sequence or a weight of unknown shape: onnx-ad's rule."""
    rng = np.random.default_rng(9)
    arrays = {"a": _random(3, 2, 4, rng=rng), "w": _random(4, 5, rng=rng)}
    output_shape = ["n", 2, 5]
    node = helper.make_node("MatMul", ["a", "w"], ["y"])
    seed = _random(3, 2, 5, rng=rng)
    expected_y, expected = _torch_reference(lambda a, w: a @ w, arrays, ["a", "w"], seed)
    for dynamic, as_gemm in [({"a": 0}, False), ({"w": 0}, False), ({}, True)]:
        gradient_graph = _reverse(_model([node], arrays, output_shape, dynamic=dynamic), ["a", "w"])
        got = _run(gradient_graph, {**arrays, "adj_y": seed[..., None]})
        _assert_close(got["adj_w"][..., 0], expected["w"], "dw")
        _assert_close(got["adj_a"][..., 0], expected["a"], "da")
        assert ("Gemm" in _added_ops(gradient_graph)) is as_gemm


# ---- Slice --------------------------------------------------------------------------------------

BIG = 1 << 62
SLICE_CASES = {
    # name: starts, ends, axes (None: the input left out), steps
    "swin_patches": ([0, 1], [6, 5], [1, 2], [2, 2]),
    "flip": ([-1], [-BIG], [0], [-1]),
    "backwards_by_two": ([4], [0], [2], [-2]),
    "backwards_from_past_the_end": ([9], [-7], [1], [-2]),
    "negative_axis_clamped": ([-4], [100], [-1], [3]),
    "one_read_strided": ([1], [2], [0], [2]),
    "one_read_backwards": ([3], [0], [1], [-3]),
    "no_axes": ([1, 5], [4, -BIG], None, [2, -1]),
    "mixed": ([1, 5, 0], [4, 0, 5], [0, 1, 2], [1, -1, 2]),
    "three_axes": ([3, 0, -1], [-BIG, 6, 0], [0, 1, 2], [-2, 3, -3]),
    "unit_steps": ([1, 2], [3, 5], [0, 2], [1, 1]),
    "strided_to_the_end": ([2], [6], [1], [2]),
    "backwards_from_before_the_start": ([-9], [-BIG], [1], [-2]),
    "every_other_end_to_end": ([0, 3], [5, -BIG], [2, 0], [2, -3]),
}
SLICE_INPUT = [4, 6, 5]


def _slice_node(name):
    starts, ends, axes, steps = SLICE_CASES[name]
    constants = {"starts": np.array(starts, np.int64), "ends": np.array(ends, np.int64),
                 "steps": np.array(steps, np.int64)}
    if axes is not None:
        constants["axes"] = np.array(axes, np.int64)
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes" if axes is not None else "", "steps"], ["y"])
    return node, constants


def _torch_slice(name):
    """x's elements at the positions ONNX Runtime's Slice reads (its forward on the flat index of
    each element), as a torch gather: autograd scatters the adjoint back."""
    node, constants = _slice_node(name)
    iota = np.arange(np.prod(SLICE_INPUT), dtype=np.float32).reshape(SLICE_INPUT)
    model = _model([node], {"x": iota}, [None] * 3, constants)
    positions = _run(model, {"x": iota})["y"].astype(np.int64)

    def fn(x):
        return x.reshape(-1)[torch.tensor(positions.reshape(-1))].reshape(positions.shape)
    return fn


def _slice_moves(name):
    """The moves the module docstring lists, per axis the slice reads with a step: reversed (a
    Slice) if the step is negative and it reads more than one position, interleaved with zeros
    (Unsqueeze, Pad, Reshape, Slice) if |step| > 1 and more than one, zero-padded (a Pad) unless
    the positions read reach both ends. Worked out from the positions ONNX Runtime reads."""
    node, constants = _slice_node(name)
    _, _, axes, steps = SLICE_CASES[name]
    axes = list(range(len(steps))) if axes is None else [a % 3 for a in axes]
    iota = np.arange(np.prod(SLICE_INPUT), dtype=np.float32).reshape(SLICE_INPUT)
    flat = _run(_model([node], {"x": iota}, [None] * 3, constants), {"x": iota})["y"].astype(np.int64)
    read = np.unravel_index(flat.reshape(-1), SLICE_INPUT)
    moves = {"Slice": 1, "Pad": 0, "Reshape": 0}   # the forward's Slice
    for axis, step in zip(axes, steps):
        positions = set(read[axis].tolist())
        if step < 0 and len(positions) > 1:
            moves["Slice"] += 1
        if abs(step) > 1 and len(positions) > 1:
            moves["Slice"] += 1
            moves["Pad"] += 1
            moves["Reshape"] += 1
        if min(positions) > 0 or max(positions) < SLICE_INPUT[axis] - 1:
            moves["Pad"] += 1
    return moves


@pytest.mark.parametrize("name", list(SLICE_CASES))
def test_slice_against_torch(name):
    node, constants = _slice_node(name)
    arrays = {"x": _random(*SLICE_INPUT, rng=np.random.default_rng(4))}
    gradient_graph = _check([node], arrays, ["x"], _torch_slice(name), constants=constants)
    assert all(n.op_type in {"Slice", "Pad", "Unsqueeze", "Reshape", "Expand", "Identity"}
               for n in gradient_graph.graph.node), "data movement only"
    if name != "unit_steps":   # steps of 1: onnx-ad's rule, one Pad
        ops = [n.op_type for n in gradient_graph.graph.node]
        assert {op: ops.count(op) for op in ("Slice", "Pad", "Reshape")} == _slice_moves(name)


@pytest.mark.parametrize("name", ["swin_patches", "three_axes", "no_axes", "mixed"])
def test_slice_with_two_seeds(name):
    """Two adjoints at once (onnx-ad's trailing seed axis of 2): each is the gradient of its own
    seed (the rule moves data only, the seed axis along)."""
    node, constants = _slice_node(name)
    arrays = {"x": _random(*SLICE_INPUT, rng=np.random.default_rng(4))}
    fn = _torch_slice(name)
    output_shape = tuple(fn(torch.zeros(SLICE_INPUT)).shape)
    seeds = np.random.default_rng(7).standard_normal(output_shape + (2,)).astype(np.float32)
    gradient_graph = _reverse(_model([node], arrays, output_shape, constants), ["x"])
    got = _run(gradient_graph, {**arrays, "adj_y": seeds})["adj_x"]
    assert got.shape == tuple(SLICE_INPUT) + (2,)
    for k in range(2):
        _, expected = _torch_reference(fn, arrays, ["x"], seeds[..., k])
        _assert_close(got[..., k], expected["x"], f"dx, seed {k}")


def test_slice_reading_nothing_has_a_zero_gradient():
    arrays = {"x": _random(*SLICE_INPUT)}
    constants = {"starts": np.array([3], np.int64), "ends": np.array([1], np.int64),
                 "axes": np.array([1], np.int64), "steps": np.array([2], np.int64)}
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"])
    gradient_graph = _reverse(_model([node], arrays, [4, 0, 5], constants), ["x"])
    got = _run(gradient_graph, {**arrays, "adj_y": np.zeros([4, 0, 5, 1], np.float32)})
    assert got["adj_x"].shape == (4, 6, 5, 1) and not got["adj_x"].any()


def test_slice_without_steps_is_onnx_ads():
    """Four operands (no steps), or an empty steps name: onnx-ad's rule, a single Pad."""
    arrays = {"x": _random(*SLICE_INPUT)}
    constants = {"starts": np.array([1], np.int64), "ends": np.array([3], np.int64), "axes": np.array([2], np.int64)}
    for operands in (["x", "starts", "ends", "axes"], ["x", "starts", "ends", "axes", ""]):
        node = helper.make_node("Slice", operands, ["y"])
        gradient_graph = _check([node], arrays, ["x"], lambda x: x[:, :, 1:3], constants=constants)
        assert "Pad" in _added_ops(gradient_graph)


def test_slice_refusals_name_the_problem():
    arrays = {"x": _random(*SLICE_INPUT)}
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"])
    bounds = {"starts": np.array([0], np.int64), "ends": np.array([6], np.int64), "axes": np.array([1], np.int64)}
    fed_steps = _model([node], {**arrays, "steps": np.array([2], np.int64)}, [4, 3, 5], bounds)
    with pytest.raises(UnsupportedOperator, match="^Slice is differentiable only with constant steps$"):
        _reverse(fed_steps, ["x"])
    fed_starts = _model([node], {**arrays, "starts": np.array([0], np.int64)}, [4, 3, 5],
                        {k: v for k, v in {**bounds, "steps": np.array([2], np.int64)}.items() if k != "starts"})
    with pytest.raises(UnsupportedOperator, match="^Slice is differentiable only with constant bounds$"):
        _reverse(fed_starts, ["x"])
    fed_ends = _model([node], {**arrays, "ends": np.array([6], np.int64)}, [4, 3, 5],
                      {k: v for k, v in {**bounds, "steps": np.array([2], np.int64)}.items() if k != "ends"})
    with pytest.raises(UnsupportedOperator, match="^Slice is differentiable only with constant bounds$"):
        _reverse(fed_ends, ["x"])
    unknown = _model([node], arrays, [4, 3, 5], {**bounds, "steps": np.array([2], np.int64)}, dynamic={"x": 0})
    unknown.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(UnsupportedOperator, match="^Slice needs a declared shape to be differentiated in reverse mode$"):
        _reverse(unknown, ["x"])
    zero_step = _model([node], arrays, [4, 3, 5], {**bounds, "steps": np.array([0], np.int64)})
    with pytest.raises(UnsupportedOperator, match="^Slice with a step of 0$"):
        _reverse(zero_step, ["x"])


# ---- Gather -------------------------------------------------------------------------------------

GATHER_CASES = {
    # name: data shape, axis (None: the default 0), index, whether graphopt's Pad rule applies
    "first_axis": ([3, 4, 5], None, 1, True),
    "negative_index": ([3, 4, 5], 1, -1, True),
    "negative_axis": ([3, 4, 5], -1, 0, True),
    "last_position": ([3, 4, 5], 2, 4, True),
    "first_position": ([3, 4, 5], 1, 0, True),
    "single_position": ([3, 1, 5], 1, 0, True),
    "most_negative": ([3, 4, 5], 1, -4, True),
    "several": ([3, 4, 5], 1, [0, 2], False),
    "one_element_list": ([3, 4, 5], 2, [3], False),
}


def _torch_gather(axis, index):
    def fn(x):
        return torch.index_select(x, axis % x.dim(), torch.tensor(np.array(index).reshape(-1) % x.shape[axis])
                                  ).reshape(_gathered_shape(list(x.shape), axis, index))
    return fn


def _gathered_shape(shape, axis, index):
    return shape[:axis % len(shape)] + list(np.shape(index)) + shape[axis % len(shape) + 1:]


@pytest.mark.parametrize("name", list(GATHER_CASES))
def test_gather_against_torch(name):
    shape, axis, index, as_pad = GATHER_CASES[name]
    arrays = {"x": _random(*shape, rng=np.random.default_rng(6))}
    extra = {} if axis is None else {"axis": axis}
    node = helper.make_node("Gather", ["x", "index"], ["y"], **extra)
    gradient_graph = _check([node], arrays, ["x"], _torch_gather(axis or 0, index),
                            constants={"index": np.array(index, np.int64)})
    ops = _added_ops(gradient_graph)
    assert ("ScatterND" not in ops) is as_pad, ops


def test_gather_of_unknown_shape_is_onnx_ads():
    """Data of unknown batch: onnx-ad's scatter (graphopt's Pad needs the extent)."""
    arrays = {"x": _random(3, 4, 5)}
    node = helper.make_node("Gather", ["x", "index"], ["y"], axis=1)
    seed = _random(3, 5)
    for dynamic in ({"x": 0}, {"x": 1}):
        model = _model([node], arrays, ["n", 5], {"index": np.array(2, np.int64)}, dynamic=dynamic)
        gradient_graph = _reverse(model, ["x"])
        assert "ScatterND" in _added_ops(gradient_graph)
        got = _run(gradient_graph, {**arrays, "adj_y": seed[..., None]})["adj_x"][..., 0]
        _, expected = _torch_reference(lambda x: x[:, 2], arrays, ["x"], seed)
        _assert_close(got, expected["x"], "dx")


def test_gather_of_a_fed_index_is_onnx_ads():
    arrays = {"x": _random(3, 4, 5), "index": np.array(2, np.int64)}
    node = helper.make_node("Gather", ["x", "index"], ["y"], axis=1)
    gradient_graph = _check([node], arrays, ["x"], lambda x, index: x[:, 2])
    assert "ScatterND" in _added_ops(gradient_graph)


def test_gather_out_of_range_is_left_to_onnx_ad():
    """An index outside the axis (ONNX Runtime refuses to run it): onnx-ad's rule, as for any
    index graphopt's does not cover."""
    for index in (4, -5, 7):
        node = helper.make_node("Gather", ["x", "index"], ["y"], axis=1)
        model = _model([node], {"x": _random(3, 4, 5)}, [3, 5], {"index": np.array(index, np.int64)})
        assert "ScatterND" in _added_ops(_reverse(model, ["x"]))


# ---- Relu and LeakyRelu -------------------------------------------------------------------------

def _derivative_reads(gradient_graph):
    """What the backward's comparison (Greater) reads: the op's input or its output."""
    (greater,) = [n for n in gradient_graph.graph.node if n.op_type == "Greater"]
    return greater.input[0]


@pytest.mark.parametrize("op,alpha,reads", [("Relu", None, "y"), ("LeakyRelu", 0.2, "y"), ("LeakyRelu", None, "y"),
                                            ("LeakyRelu", 3.0, "y"), ("LeakyRelu", -0.5, "x"), ("LeakyRelu", 0.0, "x")])
def test_relu_against_torch(op, alpha, reads):
    x = _random(4, 6, rng=np.random.default_rng(8))
    x[0, :3] = 0.0   # the kink: derivative 0 for Relu, alpha for LeakyRelu (torch's convention)
    extra = {} if alpha is None else {"alpha": alpha}
    node = helper.make_node(op, ["x"], ["y"], **extra)
    if op == "Relu":
        fn = lambda x: F.relu(x)  # noqa: E731
    else:
        slope = 0.01 if alpha is None else alpha
        fn = (lambda x: F.leaky_relu(x, slope)) if slope > 0 else (lambda x: torch.where(x > 0, x, slope * x))
    gradient_graph = _check([node], {"x": x}, ["x"], fn)
    assert _derivative_reads(gradient_graph) == reads


# ---- through build_training_graph ----------------------------------------------------------------

def test_build_training_graph_uses_these_rules():
    """A small model with a depthwise Conv, BatchNormalization (put in training mode by the
    builder), Relu, a strided Slice, a Gather and a MatMul of a sequence by a weight, through
    build_training_graph, against torch in training mode."""
    rng = np.random.default_rng(0)
    shapes = {"w": (8, 1, 3, 3), "scale": (8,), "bias": (8,), "m": (6, 5)}
    params = {k: _random(*s, rng=rng) for k, s in shapes.items()}
    mean, var = np.zeros(8, np.float32), np.ones(8, np.float32)
    inits = [numpy_helper.from_array(v, k) for k, v in params.items()]
    inits += [numpy_helper.from_array(mean, "mean"), numpy_helper.from_array(var, "var"),
              numpy_helper.from_array(np.array([2, -1, 6], np.int64), "shape"),
              numpy_helper.from_array(np.array([0, 1], np.int64), "starts"),
              numpy_helper.from_array(np.array([8, 4], np.int64), "ends"),
              numpy_helper.from_array(np.array([1, 3], np.int64), "axes"),
              numpy_helper.from_array(np.array([1, 2], np.int64), "steps"),
              numpy_helper.from_array(np.array(1, np.int64), "which")]
    n = helper.make_node
    nodes = [n("Conv", ["x", "w"], ["c"], group=8, pads=[1, 1, 1, 1]),
             n("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["bn"]),
             n("Relu", ["bn"], ["r"]),
             n("Slice", ["r", "starts", "ends", "axes", "steps"], ["s"]),
             n("Reshape", ["s", "shape"], ["rows"]),
             n("MatMul", ["rows", "m"], ["mm"]),
             n("Gather", ["mm", "which"], ["g"], axis=2),
             n("Mul", ["g", "target"], ["p"]),
             n("ReduceSum", ["p"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 3, 4]),
                                               helper.make_tensor_value_info("target", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    forward = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    for (table, op), rule in ONNX_AD_OWN.items():   # the builder registers the rules itself
        getattr(onnx_ad_rules, table)[op] = rule
    train = build_training_graph(forward)
    onnx.checker.check_model(train)
    feeds = {"x": _random(2, 8, 3, 4, rng=rng), "target": _random(2, 8, rng=rng)}
    got = _run(train, {**feeds, "mean": mean, "var": var})

    tensors = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    x = torch.tensor(feeds["x"], dtype=torch.float64)
    c = F.conv2d(x, tensors["w"], padding=1, groups=8)
    bn = F.batch_norm(c, torch.zeros(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), tensors["scale"],
                      tensors["bias"], training=True)
    s = F.relu(bn)[:, :, :, 1:4:2]
    mm = s.reshape(2, -1, 6) @ tensors["m"]
    loss = (mm[:, :, 1] * torch.tensor(feeds["target"], dtype=torch.float64)).sum()
    loss.backward()
    _assert_close(got["loss"], loss.detach().numpy(), "loss")
    for name, tensor in tensors.items():
        _assert_close(got[f"{name}_grad"], tensor.grad.numpy(), f"d{name}")
    ops = [node.op_type for node in train.graph.node]
    assert "ScatterND" not in ops and "Gemm" in ops


# Everything imported so far (torch, onnx, the module under test) is left out of garbage
# collection: pytest collects garbage five times as a session ends, and in mutmut's children,
# forked from a process that has imported this file, each collection walks (and so copies) every
# object of the parent: 1 to 2 seconds a mutant, against a tenth with this (tests/mutation.py).
gc.freeze()


def test_transposed_shape_truncated_where_onnx_shape_inference_truncates():
    """The oracle: onnx's own shape inference of onnx-ad's input gradient (a ConvTranspose given
    the Conv's input shape as `output_shape`); where it infers fewer axes than the Conv's input
    has, `transposed_shape_truncated` says so, and only there."""
    cases = [([2, 4, 8, 8], [2, 8, 8, 8]), ([2, 4, 8, 8], [2, 8, 8, 10]), ([2, 4, 8, 8], [2, 8, 10, 8]),
             ([2, 4, 8, 8], [2, 8, 6, 6]), ([2, 4, 9], [2, 8, 11]), ([2, 4, 9], [2, 8, 7]),
             ([2, 4, 5, 5, 5], [2, 8, 5, 7, 5]), ([2, 4, 5, 5, 5], [2, 8, 3, 5, 5])]
    for x, y in cases:
        spatial = len(x) - 2
        node = helper.make_node("ConvTranspose", ["dy", "w"], ["dx"], output_shape=x[2:])
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("dy", TensorProto.FLOAT, y),
                                                helper.make_tensor_value_info("w", TensorProto.FLOAT,
                                                                              [y[1], x[1]] + [3] * spatial)],
                                  [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)])
        inferred = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
        rank = len(inferred.graph.output[0].type.tensor_type.shape.dim)
        assert rules.transposed_shape_truncated(x, y) is (rank < len(x)), (x, y, rank)
    assert rules.transposed_shape_truncated([2, 4, 8, 8], [2, 8, None, 10]) is False
    assert rules.transposed_shape_truncated(None, [2, 8, 8, 10]) is False


# ---- Resize: the adjoint of repeating each element (rules._resize_reverse) -------------------------

# name: x shape, Resize attributes, scales or None, sizes or None; whether each element is repeated
# in place (the adjoint a Reshape and a ReduceSum) or not (onnx-ad's interpolation matrices)
RESIZE_CASES = {
    "nearest_2x": ([2, 3, 4, 5], dict(mode="nearest"), [1, 1, 2, 2], None, True),
    "nearest_sizes_3x2": ([2, 3, 4, 5], dict(mode="nearest"), None, [2, 3, 12, 10], True),
    "nearest_one_axis": ([2, 3, 4, 5], dict(mode="nearest"), [1, 1, 1, 4], None, True),
    "nearest_asymmetric_floor": ([2, 3, 4, 5], dict(mode="nearest", coordinate_transformation_mode="asymmetric",
                                                    nearest_mode="floor"), [1, 1, 3, 2], None, True),
    # asymmetric coordinates with halves rounded up: the second copy of each element is already its
    # successor (and the last element three times)
    "nearest_asymmetric_ceil": ([2, 3, 4, 5], dict(mode="nearest", coordinate_transformation_mode="asymmetric",
                                                   nearest_mode="round_prefer_ceil"), [1, 1, 2, 2], None, False),
    "linear_2x": ([2, 3, 4, 5], dict(mode="linear"), [1, 1, 2, 2], None, False),
    "nearest_downsampled": ([2, 3, 8, 6], dict(mode="nearest"), [1, 1, 0.5, 0.5], None, False),
}


def _resize_case(name):
    x_shape, attrs, scales, sizes, repeated = RESIZE_CASES[name]
    x = _random(*x_shape, rng=np.random.default_rng(len(name)))
    constants = {"scales": np.array(scales, np.float32)} if scales else {"sizes": np.array(sizes, np.int64)}
    operands = ["x", "", "scales"] if scales else ["x", "", "", "sizes"]
    node = helper.make_node("Resize", operands, ["y"], **attrs)
    output_shape = list(sizes) if sizes else [int(d * s) for d, s in zip(x_shape, scales)]
    return x, constants, node, output_shape, repeated


@pytest.mark.parametrize("name", list(RESIZE_CASES))
def test_resize_adjoint_is_the_transpose_of_the_forward(name):
    """<g, resize(x)> = <adjoint(g), x> for any x and g (the resize is linear in x), the forward
    run by ONNX Runtime from the model alone: an oracle independent of either rule. Repeats are
    summed by one ReduceSum (no MatMul); anything else keeps onnx-ad's matrices (a MatMul per
    resized axis)."""
    x, constants, node, output_shape, repeated = _resize_case(name)
    model = _model([node], {"x": x}, output_shape, constants)
    gradient_graph = _reverse(model, ["x"])
    seed = np.random.default_rng(3).standard_normal(output_shape).astype(np.float32)
    got = _run(gradient_graph, {"x": x, "adj_y": seed[..., None]})
    forward = _run(model, {"x": x})["y"]
    left = float(np.dot(seed.astype(np.float64).ravel(), forward.astype(np.float64).ravel()))
    right = float(np.dot(got["adj_x"][..., 0].astype(np.float64).ravel(), x.astype(np.float64).ravel()))
    assert abs(left - right) <= 1e-5 * (np.abs(seed).sum() * np.abs(forward).max()), (left, right)
    # and on a second x: the adjoint does not depend on x
    other = np.random.default_rng(5).standard_normal(x.shape).astype(np.float32)
    forward = _run(model, {"x": other})["y"]
    left = float(np.dot(seed.astype(np.float64).ravel(), forward.astype(np.float64).ravel()))
    right = float(np.dot(got["adj_x"][..., 0].astype(np.float64).ravel(), other.astype(np.float64).ravel()))
    assert abs(left - right) <= 1e-5 * (np.abs(seed).sum() * np.abs(forward).max()), (left, right)
    ops = _added_ops(gradient_graph)
    if repeated:
        assert ops.count("ReduceSum") == 1 and "MatMul" not in ops, ops
    else:
        assert "MatMul" in ops, ops


def test_nearest_upsampling_adjoint_against_torch():
    """A 2 x 3 nearest upsampling (ONNX's defaults: half-pixel coordinates, rounded to the nearest)
    is torch's repeat_interleave along each axis: its gradient against torch's in float64."""
    x = _random(2, 3, 4, 5)
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")
    _check([node], {"x": x}, ["x"], lambda x: x.repeat_interleave(2, dim=2).repeat_interleave(3, dim=3),
           constants={"scales": np.array([1, 1, 2, 3], np.float32)})


def test_repeat_factors_follow_the_runtime():
    """repeat_factors runs the node: the same attributes at other shapes (2 x 2 from 3 x 3, 3 x
    from 2 x) give what ONNX Runtime does, and a mode it does not run gives None."""
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")
    assert rules.repeat_factors(node, 4, 17, [1.0, 1.0, 2.0, 3.0], None, None, [2, 3, 4, 5], [2, 3, 8, 15]) == [1, 1, 2, 3]
    assert rules.repeat_factors(node, 4, 17, [1.0, 1.0, 1.5, 1.0], None, None, [2, 3, 4, 5], [2, 3, 6, 5]) is None
    # Upsample, its scales an input (opset 9) or an attribute (opset 7)
    upsample = helper.make_node("Upsample", ["x", "scales"], ["y"], mode="nearest")
    assert rules.repeat_factors(upsample, 4, 9, [1.0, 1.0, 2.0, 2.0], None, None, [1, 2, 3, 4], [1, 2, 6, 8]) == [1, 1, 2, 2]
    upsample = helper.make_node("Upsample", ["x"], ["y"], mode="nearest", scales=[1.0, 1.0, 2.0, 3.0])
    assert rules.repeat_factors(upsample, 4, 7, [1.0, 1.0, 2.0, 3.0], None, None, [1, 2, 3, 4], [1, 2, 6, 12]) == [1, 1, 2, 3]
    bad = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="no_such_mode")
    assert rules.repeat_factors(bad, 4, 17, [1.0, 1.0, 2.0, 2.0], None, None, [2, 3, 4, 5], [2, 3, 8, 10]) is None
