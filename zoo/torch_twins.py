"""PyTorch twins of graphopt's example zoo (graphopt/examples.py).

For each example, a ``torch.nn.Module`` written the way a PyTorch user would write it
(``F.linear``, ``F.conv2d``, ``F.layer_norm``, ``F.cross_entropy``, ...) that computes the
same forward pass and loss as the ONNX forward model, from the same parameter values:
each twin is made FROM the ONNX forward model, whose float initializers (the parameters)
it copies by name, and whose sizes it reads off the parameter and input shapes.

    forward = graphopt.examples.forward_example("resnet")
    model = twin(forward)                      # or twin_example("resnet", small=True)
    loss = model(*torch_inputs(example_inputs(forward)))
    loss.backward()                            # model.onnx_parameters()[name].grad
                                               # == the training graph's `<name>_grad`

Two things are not in the parameter shapes and are read from the ONNX graph instead: the
transformer's head count (the shape constant of its q Reshape) and randwire's random
wiring (which earlier cells each cell sums: the inputs of its Sum node). Every layer's
arithmetic follows the builder: Gemm = ``F.linear`` (weight [out, in]); the transformer's
MatMul+Add linears multiply by a [in, out] weight; convs pad k//2; LayerNormalization
epsilon 1e-5; exact (erf) Gelu; nearest x2 Resize (half_pixel + round_prefer_floor is
torch's nearest for a factor of 2); AveragePool/MaxPool 2x2 stride 2; GlobalAveragePool +
Flatten = mean over H, W; the loss is the mean cross-entropy over every label (or the MSE).

Imports torch; graphopt's library does not (this lives under benchmarks/).
"""
from __future__ import annotations

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

__all__ = ["TWINS", "twin", "twin_example", "torch_inputs", "Twin"]


def _key(name: str) -> str:
    # parameter names may not contain dots in a ParameterDict
    return name.replace(".", "__")


class Twin(nn.Module):
    """Base class: the ONNX model's float initializers as parameters, by their ONNX name."""

    input_names: tuple[str, ...] = ()

    def __init__(self, forward_model: onnx.ModelProto):
        super().__init__()
        self._shapes: dict[str, tuple[int, ...]] = {}
        params = {}
        for t in forward_model.graph.initializer:
            array = numpy_helper.to_array(t)
            if array.dtype != np.float32:
                continue  # int64 shape/index constants, not parameters
            params[_key(t.name)] = nn.Parameter(torch.from_numpy(array.copy()))
            self._shapes[t.name] = tuple(array.shape)
        self.params = nn.ParameterDict(params)
        self._names = list(self._shapes)
        self._input_shapes = {
            v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
            for v in forward_model.graph.input}

    def p(self, name: str) -> nn.Parameter:
        return self.params[_key(name)]

    def has(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def onnx_parameters(self) -> dict[str, nn.Parameter]:
        """ONNX initializer name -> parameter (its `.grad` is the training graph's `<name>_grad`)."""
        return {n: self.params[_key(n)] for n in self._names}

    # --- layers, as in graphopt.examples._Builder ---
    def linear(self, x, stem):  # Gemm transB=1: weight [out, in]
        return F.linear(x, self.p(stem + ".weight"), self.p(stem + ".bias"))

    def matmul_linear(self, x, stem):  # MatMul by a [in, out] weight, then Add
        return torch.matmul(x, self.p(stem + ".weight")) + self.p(stem + ".bias")

    def conv(self, x, stem, stride=1):
        w = self.p(stem + ".weight")
        b = self.p(stem + ".bias") if self.has(stem + ".bias") else None
        return F.conv2d(x, w, b, stride=stride, padding=w.shape[-1] // 2)

    @staticmethod
    def gap(h):  # GlobalAveragePool + Flatten
        return h.mean(dim=(2, 3))


def _count(twin: Twin, pattern: str) -> int:
    n = 0
    while twin.has(pattern % n):
        n += 1
    return n


class MLP(Twin):
    input_names = ("x", "labels")

    def __init__(self, forward_model):
        super().__init__(forward_model)
        self.depth = _count(self, "fc%d.weight")

    def forward(self, x, labels):
        h = x
        for i in range(self.depth):
            h = torch.tanh(self.linear(h, "fc%d" % i))
        return F.cross_entropy(self.linear(h, "head"), labels)


class ResNet(Twin):
    input_names = ("x", "labels")

    def __init__(self, forward_model):
        super().__init__(forward_model)
        self.stages = _count(self, "s%d.b0.conv1.weight")
        self.blocks = _count(self, "s0.b%d.conv1.weight")

    def forward(self, x, labels):
        h = F.relu(self.conv(x, "stem"))
        for s in range(self.stages):
            for k in range(self.blocks):
                stride = 2 if (k == 0 and s > 0) else 1
                name = "s%d.b%d" % (s, k)
                y = F.relu(self.conv(h, name + ".conv1", stride=stride))
                y = self.conv(y, name + ".conv2")
                shortcut = self.conv(h, name + ".proj", stride=stride) \
                    if self.has(name + ".proj.weight") else h
                h = F.relu(y + shortcut)
        return F.cross_entropy(self.linear(self.gap(h), "head"), labels)


class DenseNet(Twin):
    input_names = ("x", "labels")

    def __init__(self, forward_model):
        super().__init__(forward_model)
        self.layers = []
        blk = 0
        while self.has("d%d.l0.conv.weight" % blk):
            self.layers.append(_count(self, "d%d.l%%d.conv.weight" % blk))
            blk += 1

    def forward(self, x, labels):
        h = self.conv(x, "stem")
        for blk, n in enumerate(self.layers):
            for i in range(n):
                name = "d%d.l%d" % (blk, i)
                new = self.conv(F.relu(h), name + ".conv")
                h = torch.cat([h, new], dim=1)
            if blk + 1 < len(self.layers):
                h = self.conv(F.relu(h), "t%d.conv" % blk)
                h = F.avg_pool2d(h, kernel_size=2, stride=2)
        h = F.relu(h)
        return F.cross_entropy(self.linear(self.gap(h), "head"), labels)


class UNet(Twin):
    input_names = ("x", "target")

    def __init__(self, forward_model):
        super().__init__(forward_model)
        self.levels = _count(self, "enc%d.conv1.weight")

    def double(self, h, name):
        h = F.relu(self.conv(h, name + ".conv1"))
        return F.relu(self.conv(h, name + ".conv2"))

    def forward(self, x, target):
        h = x
        skips = []
        for lvl in range(self.levels):
            h = self.double(h, "enc%d" % lvl)
            skips.append(h)
            h = F.max_pool2d(h, kernel_size=2, stride=2)
        h = self.double(h, "mid")
        for lvl in reversed(range(self.levels)):
            name = "dec%d" % lvl
            up = F.interpolate(h, scale_factor=2, mode="nearest")
            up = self.conv(up, name + ".up")
            h = torch.cat([up, skips[lvl]], dim=1)
            h = self.double(h, name)
        y = self.conv(h, "head")
        return F.mse_loss(y, target)


class Transformer(Twin):
    input_names = ("tokens", "labels")

    def __init__(self, forward_model):
        super().__init__(forward_model)
        self.layers = _count(self, "l%d.ln1.weight")
        self.d_model = self.shape("embed.weight")[1]
        consts = {t.name: numpy_helper.to_array(t) for t in forward_model.graph.initializer}
        split = next(n for n in forward_model.graph.node
                     if n.op_type == "Reshape" and n.output[0].endswith(".q_split"))
        self.heads = int(consts[split.input[1]][2])
        self.dh = self.d_model // self.heads
        # the builder's scale is a float32 constant: the same rounding here
        self.scale = float(np.float32(1.0 / np.sqrt(self.dh)))

    def ln(self, x, name):
        return F.layer_norm(x, (self.d_model,), self.p(name + ".weight"), self.p(name + ".bias"),
                            eps=1e-5)

    def forward(self, tokens, labels):
        b, t = tokens.shape
        h = F.embedding(tokens, self.p("embed.weight")) + self.p("pos.weight")
        for i in range(self.layers):
            name = "l%d" % i
            x = self.ln(h, name + ".ln1")
            q = self.matmul_linear(x, name + ".q").reshape(b, t, self.heads, self.dh)
            k = self.matmul_linear(x, name + ".k").reshape(b, t, self.heads, self.dh)
            v = self.matmul_linear(x, name + ".v").reshape(b, t, self.heads, self.dh)
            q, k, v = q.transpose(1, 2), k.permute(0, 2, 3, 1), v.transpose(1, 2)
            attn = torch.softmax(torch.matmul(q, k) * self.scale, dim=-1)
            ctx = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.d_model)
            h = h + self.matmul_linear(ctx, name + ".o")
            x = self.ln(h, name + ".ln2")
            f = F.gelu(self.matmul_linear(x, name + ".fc1"))
            h = h + self.matmul_linear(f, name + ".fc2")
        logits = self.matmul_linear(self.ln(h, "ln_f"), "lm_head")
        return F.cross_entropy(logits.reshape(b * t, -1), labels.reshape(b * t))


class RandWire(Twin):
    """The wiring (which earlier outputs each cell sums) is read from the ONNX graph; output
    0 is the stem, output i+1 is cell i's conv."""

    input_names = ("x", "labels")

    def __init__(self, forward_model):
        super().__init__(forward_model)
        self.cells = _count(self, "cell%d.conv.weight")
        producer = {out: n for n in forward_model.graph.node for out in n.output}
        index = {"stem_relu": 0}
        self.strides = []
        for n in forward_model.graph.node:
            if n.op_type == "Conv" and n.output[0].startswith("cell"):
                index[n.output[0]] = len(index)
                strides = [list(a.ints) for a in n.attribute if a.name == "strides"]
                self.strides.append(strides[0][0] if strides else 1)

        def sources(tensor):
            node = producer[tensor]
            if node.op_type in ("Sum", "Mean"):
                return [index[i] for i in node.input]
            return [index[tensor]]

        self.preds = []
        for i in range(self.cells):
            relu = producer[producer["cell%d.conv" % i].input[0]]
            self.preds.append(sources(relu.input[0]))
        final_relu = next(n for n in forward_model.graph.node if n.output[0] == "final_relu")
        self.leaves = sources(final_relu.input[0])

    def forward(self, x, labels):
        outs = [F.relu(self.conv(x, "stem"))]
        for i in range(self.cells):
            preds = self.preds[i]
            summed = outs[preds[0]]
            for p in preds[1:]:
                summed = summed + outs[p]
            outs.append(self.conv(F.relu(summed), "cell%d.conv" % i, stride=self.strides[i]))
        if len(self.leaves) == 1:
            merged = outs[self.leaves[0]]
        else:
            merged = outs[self.leaves[0]]
            for j in self.leaves[1:]:
                merged = merged + outs[j]
            merged = merged / len(self.leaves)
        h = F.relu(merged)
        return F.cross_entropy(self.linear(self.gap(h), "head"), labels)


TWINS = {"mlp": MLP, "resnet": ResNet, "densenet": DenseNet, "unet": UNet,
         "transformer": Transformer, "randwire": RandWire}


def twin(forward_model: onnx.ModelProto) -> Twin:
    """The torch twin of a zoo forward model (chosen by the model's graph name)."""
    name = forward_model.graph.name
    if name not in TWINS:
        raise KeyError("no torch twin for %r; twins: %s" % (name, sorted(TWINS)))
    return TWINS[name](forward_model)


def twin_example(name: str, seed: int = 0, **size):
    """(twin module, ONNX forward model, numpy inputs) for zoo example `name`; the inputs
    are those of `graphopt.examples.training_example(name, seed, **size)`."""
    from graphopt.examples import example_inputs, forward_example
    forward = forward_example(name, seed=seed, **size)
    return twin(forward), forward, example_inputs(forward, seed=seed)


def torch_inputs(module: Twin, inputs: dict[str, np.ndarray]) -> tuple[torch.Tensor, ...]:
    """The numpy inputs as torch tensors (sharing memory), in the twin's argument order."""
    return tuple(torch.from_numpy(inputs[n]) for n in module.input_names)
