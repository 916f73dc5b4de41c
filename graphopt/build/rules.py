"""Gradient rules graphopt adds to onnx-ad's registry (onnx_ad.rules).

* Relu (and LeakyRelu with alpha > 0): the derivative reads the output (y > 0), not the
  input, as PyTorch does: the input is freed after the forward instead of being kept for
  the backward next to the output (on resnet that kept both, about twice the stored tensors).

* BatchNormalization in training mode: onnx-ad differentiates only the inference form (an
  affine map). In training mode the batch statistics depend on x; the backward here reads
  only x and the scale, recomputing mean and 1/std from x, so what is kept for the backward
  is the layer's input, as in PyTorch:
      dx = invstd * (g - mean(g) - xhat * mean(xhat * g)),  g = dy * scale
      dscale = sum(dy * xhat),  dbias = sum(dy)          (means and sums over all axes but 1)
"""
from __future__ import annotations

from onnx_ad import rules as _onnx_ad_rules
from onnx_ad._build import attribute

_INFERENCE_BATCH_NORM = _onnx_ad_rules.REVERSE["BatchNormalization"]


def _batch_norm_reverse(ctx, node, grads):
    if not attribute(node, "training_mode", 0):
        return _INFERENCE_BATCH_NORM(ctx, node, grads)
    x, scale = node.input[0], node.input[1]
    rank, dtype = ctx.rank(x), ctx.dtype(node.output[0], x)
    outside = [axis for axis in range(rank) if axis != 1]
    epsilon = attribute(node, "epsilon", 1e-5)
    op = ctx.b.op
    centered = op("Sub", [x, ctx.reduce_mean(x, outside)])
    variance = ctx.reduce_mean(op("Mul", [centered, centered]), outside)
    invstd = op("Reciprocal", [op("Sqrt", [op("Add", [variance, ctx.constant(epsilon, dtype)])])],
                stem="bn_invstd")
    standardized = op("Mul", [centered, invstd], stem="bn_standardized")
    seeded = ctx.full(grads[0], node.output[0])
    channel_scale = op("Reshape", [scale, ctx.b.ints([1, -1] + [1] * (rank - 2))], stem="bn_scale")
    scaled = op("Mul", [seeded, ctx.lift(channel_scale)])
    projection = op("Mul", [ctx.lift(standardized),
                            ctx.reduce_mean(op("Mul", [ctx.lift(standardized), scaled]), outside)])
    dx = op("Mul", [ctx.lift(invstd), op("Sub", [op("Sub", [scaled, ctx.reduce_mean(scaled, outside)]),
                                                 projection])])

    def per_channel(value):
        return ctx.reshape_like(ctx.reduce_sum(value, outside, keepdims=0), node.input[1])

    return [dx, per_channel(op("Mul", [seeded, ctx.lift(standardized)])), per_channel(seeded), None, None]


def _d_relu(ctx, node, x, y, dtype):
    return ctx.b.op("Cast", [ctx.b.op("Greater", [y, ctx.constant(0.0, dtype)])], to=dtype)


def _d_leaky_relu(ctx, node, x, y, dtype):
    alpha = attribute(node, "alpha", 0.01)
    if alpha <= 0:  # the sign of y no longer tells the branch
        return _LEAKY_RELU(ctx, node, x, y, dtype)
    positive = ctx.b.op("Greater", [y, ctx.constant(0.0, dtype)])
    return ctx.b.op("Where", [positive, ctx.constant(1.0, dtype), ctx.constant(alpha, dtype)])


_LEAKY_RELU = _onnx_ad_rules.DERIVATIVE["LeakyRelu"]


def register() -> None:
    """Install graphopt's rules (idempotent)."""
    _onnx_ad_rules.REVERSE["BatchNormalization"] = _batch_norm_reverse
    _onnx_ad_rules.DERIVATIVE["Relu"] = _d_relu
    _onnx_ad_rules.DERIVATIVE["LeakyRelu"] = _d_leaky_relu
