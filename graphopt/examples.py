"""A zoo of example forward models with their loss, built with `onnx.helper` only.

Each builder returns a FORWARD model (inputs: data and labels/target; parameters as
initializers; first output: a scalar `loss`). `training_example(name, **size)` turns one
into a training graph (`graphopt.builder.train_graph.build_training_graph`) and returns it
with deterministic inputs.

Default sizes are chosen so that one training step in onnxruntime CPU has a peak of roughly
50-300 MB with activations of 1 MB or more, and runs in about a second on one thread;
`small=True` gives tiny versions for fast unit tests. Every model is deep (12+ layers or
blocks): checkpointing needs depth to save memory.

No torch here: the module is used by the README demo on machines without it.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["EXAMPLES", "mlp", "resnet", "densenet", "unet", "transformer", "randwire",
           "forward_example", "training_example", "example_inputs"]

OPSET = 20          # Gelu is opset 20; LayerNormalization 17; ReduceMean axes-as-input 18
IR_VERSION = 10     # what onnxruntime 1.2x/1.3x loads


class _Builder:
    """Nodes and seeded initializers with unique names."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.counts: dict[str, int] = {}
        self.taken: set[str] = set()
        self._consts: dict[tuple, str] = {}

    def fresh(self, stem: str) -> str:
        if stem not in self.taken:
            self.taken.add(stem)
            return stem
        k = self.counts.get(stem, 0)
        while "%s_%d" % (stem, k) in self.taken:
            k += 1
        self.counts[stem] = k + 1
        name = "%s_%d" % (stem, k)
        self.taken.add(name)
        return name

    def param(self, name: str, shape, fan_in: int | None = None, gain: float = 1.0,
              value: float | None = None) -> str:
        name = self.fresh(name)
        if value is not None:
            array = np.full(shape, value, dtype=np.float32)
        else:
            fan = fan_in if fan_in is not None else int(np.prod(shape[1:])) or 1
            array = (self.rng.standard_normal(shape) * gain / np.sqrt(fan)).astype(np.float32)
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def const(self, value, dtype=np.int64) -> str:
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            name = self.fresh("c_" + ("x".join(str(int(v)) for v in array.reshape(-1)[:6])
                                      if array.dtype.kind in "iu" else "f"))
            if array.dtype.kind == "f":
                # a Constant node, not an initializer: float initializers are parameters
                self.nodes.append(helper.make_node(
                    "Constant", [], [name], name=self.fresh("n_" + name),
                    value=numpy_helper.from_array(array, name)))
            else:
                self.inits.append(numpy_helper.from_array(array, name))
            self._consts[key] = name
        return self._consts[key]

    def op(self, op_type: str, inputs, stem: str | None = None, outputs: int = 1, **attrs):
        stem = stem or op_type.lower()
        names = [self.fresh(stem if i == 0 else "%s_o%d" % (stem, i)) for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names,
                                           name=self.fresh("n_" + names[0]), **attrs))
        return names[0] if outputs == 1 else names

    # --- layers ---
    def linear(self, x, d_in, d_out, stem, gain=1.0):
        w = self.param(stem + ".weight", (d_out, d_in), fan_in=d_in, gain=gain)
        b = self.param(stem + ".bias", (d_out,), fan_in=1, gain=0.05)
        return self.op("Gemm", [x, w, b], stem=stem, transB=1)

    def matmul_linear(self, x, d_in, d_out, stem, gain=1.0):
        """x[..., d_in] @ W[d_in, d_out] + b: for rank-3 activations."""
        w = self.param(stem + ".weight", (d_in, d_out), fan_in=d_in, gain=gain)
        b = self.param(stem + ".bias", (d_out,), fan_in=1, gain=0.05)
        return self.op("Add", [self.op("MatMul", [x, w], stem=stem + "_mm"), b], stem=stem)

    def conv(self, x, c_in, c_out, stem, k=3, stride=1, gain=np.sqrt(2.0), bias=True):
        w = self.param(stem + ".weight", (c_out, c_in, k, k), fan_in=c_in * k * k, gain=gain)
        inputs = [x, w]
        if bias:
            # small random biases: with zero ones a conv over an all-zero Relu patch sits
            # exactly on the kink, and finite differences of the loss disagree
            inputs.append(self.param(stem + ".bias", (c_out,), fan_in=1, gain=0.05))
        p = k // 2
        return self.op("Conv", inputs, stem=stem, kernel_shape=[k, k], strides=[stride, stride],
                       pads=[p, p, p, p])

    def cross_entropy(self, logits, labels, axis=-1):
        """mean over the batch of -log softmax(logits)[label]; labels int64 without the axis."""
        logp = self.op("LogSoftmax", [logits], stem="logp", axis=axis)
        picked = self.op("GatherElements",
                         [logp, self.op("Unsqueeze", [labels, self.const([-1])],
                                        stem="labels_idx")],
                         stem="picked", axis=axis)
        mean = self.op("ReduceMean", [picked], stem="mean_logp", keepdims=0)
        return self.op("Neg", [mean], stem="loss")

    def mse(self, y, target):
        diff = self.op("Sub", [y, target], stem="diff")
        sq = self.op("Mul", [diff, diff], stem="sq")
        return self.op("ReduceMean", [sq], stem="loss", keepdims=0)

    def model(self, inputs, outputs, name) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="graphopt.examples")
        model.ir_version = IR_VERSION
        return model


def _float(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _int64(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.INT64, list(shape))


_LOSS = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])


# ------------------------------------------------------------------------- models --

def mlp(batch=1536, width=512, depth=16, d_in=256, classes=10, small=False, seed=0):
    """Deep tanh MLP (Gemm + Tanh) with a cross-entropy loss.

    Inputs: x [batch, d_in] float, labels [batch] int64."""
    if small:
        batch, width, depth, d_in, classes = 8, 16, 4, 12, 5
    b = _Builder(seed)
    h = b.op("Tanh", [b.linear("x", d_in, width, "fc0")], stem="act0")
    for i in range(1, depth):
        h = b.op("Tanh", [b.linear(h, width, width, "fc%d" % i, gain=1.2)], stem="act%d" % i)
    logits = b.linear(h, width, classes, "head")
    b.cross_entropy(logits, "labels")
    return b.model([_float("x", [batch, d_in]), _int64("labels", [batch])], [_LOSS], "mlp")


def resnet(batch=16, image=32, widths=(32, 64, 128), blocks=4, classes=10, small=False,
           seed=0):
    """Residual CNN: stem conv, `len(widths)` stages of `blocks` basic blocks (Conv-Relu-Conv
    + identity/strided-projection shortcut, Relu), global average pool, Gemm, cross-entropy.

    Inputs: x [batch, 3, image, image], labels [batch] int64."""
    if small:
        batch, image, widths, blocks, classes = 2, 8, (4, 8), 2, 5
    b = _Builder(seed)
    h = b.op("Relu", [b.conv("x", 3, widths[0], "stem")], stem="stem_relu")
    c = widths[0]
    for s, width in enumerate(widths):
        for k in range(blocks):
            stride = 2 if (k == 0 and s > 0) else 1
            name = "s%d.b%d" % (s, k)
            y = b.op("Relu", [b.conv(h, c, width, name + ".conv1", stride=stride)],
                     stem=name + ".relu1")
            y = b.conv(y, width, width, name + ".conv2", gain=0.5)
            if stride != 1 or c != width:
                shortcut = b.conv(h, c, width, name + ".proj", k=1, stride=stride, gain=1.0,
                                  bias=False)
            else:
                shortcut = h
            h = b.op("Relu", [b.op("Add", [y, shortcut], stem=name + ".add")],
                     stem=name + ".out")
            c = width
    pooled = b.op("Flatten", [b.op("GlobalAveragePool", [h], stem="gap")], stem="flat")
    logits = b.linear(pooled, c, classes, "head")
    b.cross_entropy(logits, "labels")
    return b.model([_float("x", [batch, 3, image, image]), _int64("labels", [batch])],
                   [_LOSS], "resnet")


def densenet(batch=16, image=32, stem=32, growth=16, layers=(6, 6, 6), classes=10,
             small=False, seed=0):
    """DenseNet-style CNN: dense blocks where each layer is Relu-Conv3x3 (growth channels)
    concatenated onto its input; transitions Conv1x1 (halving channels) + AveragePool 2x2;
    global average pool, Gemm, cross-entropy.

    Inputs: x [batch, 3, image, image], labels [batch] int64."""
    if small:
        batch, image, stem, growth, layers, classes = 2, 8, 4, 3, (2, 2), 5
    b = _Builder(seed)
    h = b.conv("x", 3, stem, "stem")
    c = stem
    for blk, n in enumerate(layers):
        for i in range(n):
            name = "d%d.l%d" % (blk, i)
            new = b.conv(b.op("Relu", [h], stem=name + ".relu"), c, growth, name + ".conv")
            h = b.op("Concat", [h, new], stem=name + ".cat", axis=1)
            c += growth
        if blk + 1 < len(layers):
            name = "t%d" % blk
            c_out = c // 2
            h = b.conv(b.op("Relu", [h], stem=name + ".relu"), c, c_out, name + ".conv", k=1)
            h = b.op("AveragePool", [h], stem=name + ".pool", kernel_shape=[2, 2],
                     strides=[2, 2])
            c = c_out
    h = b.op("Relu", [h], stem="final_relu")
    pooled = b.op("Flatten", [b.op("GlobalAveragePool", [h], stem="gap")], stem="flat")
    logits = b.linear(pooled, c, classes, "head")
    b.cross_entropy(logits, "labels")
    return b.model([_float("x", [batch, 3, image, image]), _int64("labels", [batch])],
                   [_LOSS], "densenet")


def unet(batch=8, image=64, widths=(16, 32, 64, 128), c_in=3, c_out=1, small=False, seed=0):
    """U-Net: encoder levels of (Conv-Relu)x2 then MaxPool 2x2, a bottleneck, decoder levels
    of Resize (nearest, x2) + Conv3x3 up, skip Concat, (Conv-Relu)x2; a 1x1 conv head; MSE
    loss. (ConvTranspose would be the classic up-sampler, but onnx-ad 0.3 cannot
    differentiate its weight.)

    Inputs: x [batch, c_in, image, image], target [batch, c_out, image, image]."""
    if small:
        batch, image, widths, c_in, c_out = 1, 8, (4, 8), 2, 1
    b = _Builder(seed)

    def double(h, c1, c2, name):
        h = b.op("Relu", [b.conv(h, c1, c2, name + ".conv1")], stem=name + ".relu1")
        return b.op("Relu", [b.conv(h, c2, c2, name + ".conv2")], stem=name + ".relu2")

    h, c = "x", c_in
    skips = []
    for lvl, width in enumerate(widths[:-1]):
        h = double(h, c, width, "enc%d" % lvl)
        skips.append((h, width))
        h = b.op("MaxPool", [h], stem="enc%d.pool" % lvl, kernel_shape=[2, 2], strides=[2, 2])
        c = width
    h = double(h, c, widths[-1], "mid")
    c = widths[-1]
    for lvl in reversed(range(len(widths) - 1)):
        skip, width = skips[lvl]
        name = "dec%d" % lvl
        # onnx-ad 0.3 has no ConvTranspose weight gradient: nearest Resize + 3x3 conv
        up = b.op("Resize", [h, "", b.const([1.0, 1.0, 2.0, 2.0], np.float32)],
                  stem=name + ".resize", mode="nearest")
        up = b.conv(up, c, width, name + ".up")
        h = b.op("Concat", [up, skip], stem=name + ".cat", axis=1)
        h = double(h, 2 * width, width, name)
        c = width
    y = b.conv(h, c, c_out, "head", k=1, gain=1.0)
    b.mse(y, "target")
    return b.model([_float("x", [batch, c_in, image, image]),
                    _float("target", [batch, c_out, image, image])], [_LOSS], "unet")


def transformer(batch=8, seq=128, d_model=256, heads=4, layers=8, d_ff=512, vocab=1000,
                small=False, seed=0):
    """Transformer encoder language model: token embedding (Gather on an embedding table)
    plus a learned position table, `layers` pre-LayerNorm blocks of multi-head
    self-attention (MatMul/Transpose/Reshape/Softmax) and a Gelu MLP with residuals, a final
    LayerNorm, a vocabulary projection and a token-level cross-entropy.

    Inputs: tokens [batch, seq] int64, labels [batch, seq] int64."""
    if small:
        batch, seq, d_model, heads, layers, d_ff, vocab = 2, 5, 8, 2, 2, 16, 11
    b = _Builder(seed)
    dh = d_model // heads
    emb = b.param("embed.weight", (vocab, d_model), fan_in=1, gain=0.5)
    pos = b.param("pos.weight", (seq, d_model), fan_in=1, gain=0.1)
    h = b.op("Add", [b.op("Gather", [emb, "tokens"], stem="embed", axis=0), pos], stem="h0")

    def layer_norm(x, name):
        g = b.param(name + ".weight", (d_model,), value=1.0)
        beta = b.param(name + ".bias", (d_model,), value=0.0)
        return b.op("LayerNormalization", [x, g, beta], stem=name, axis=-1, epsilon=1e-5)

    split_shape = b.const([batch, seq, heads, dh])
    merge_shape = b.const([batch, seq, d_model])
    scale = b.const(np.float32(1.0 / np.sqrt(dh)), np.float32)
    for i in range(layers):
        name = "l%d" % i
        x = layer_norm(h, name + ".ln1")
        q = b.matmul_linear(x, d_model, d_model, name + ".q")
        k = b.matmul_linear(x, d_model, d_model, name + ".k")
        v = b.matmul_linear(x, d_model, d_model, name + ".v")
        q = b.op("Transpose", [b.op("Reshape", [q, split_shape], stem=name + ".q_split")],
                 stem=name + ".q_heads", perm=[0, 2, 1, 3])
        k = b.op("Transpose", [b.op("Reshape", [k, split_shape], stem=name + ".k_split")],
                 stem=name + ".k_heads", perm=[0, 2, 3, 1])
        v = b.op("Transpose", [b.op("Reshape", [v, split_shape], stem=name + ".v_split")],
                 stem=name + ".v_heads", perm=[0, 2, 1, 3])
        scores = b.op("Mul", [b.op("MatMul", [q, k], stem=name + ".qk"), scale],
                      stem=name + ".scores")
        attn = b.op("Softmax", [scores], stem=name + ".attn", axis=-1)
        ctx = b.op("MatMul", [attn, v], stem=name + ".ctx")
        ctx = b.op("Reshape", [b.op("Transpose", [ctx], stem=name + ".ctx_t",
                                    perm=[0, 2, 1, 3]), merge_shape], stem=name + ".ctx_merge")
        h = b.op("Add", [h, b.matmul_linear(ctx, d_model, d_model, name + ".o", gain=0.5)],
                 stem=name + ".res1")
        x = layer_norm(h, name + ".ln2")
        f = b.op("Gelu", [b.matmul_linear(x, d_model, d_ff, name + ".fc1")],
                 stem=name + ".gelu")
        h = b.op("Add", [h, b.matmul_linear(f, d_ff, d_model, name + ".fc2", gain=0.5)],
                 stem=name + ".res2")
    h = layer_norm(h, "ln_f")
    logits = b.matmul_linear(h, d_model, vocab, "lm_head")
    b.cross_entropy(logits, "labels")
    return b.model([_int64("tokens", [batch, seq]), _int64("labels", [batch, seq])],
                   [_LOSS], "transformer")


def randwire(batch=24, image=32, channels=32, nodes=24, window=4, classes=10,
             small=False, seed=0):
    """Randomly wired network (seeded): a stem conv, then a random DAG of `nodes` cells; cell
    i sums 1-3 random predecessors among the previous `window` (Sum), applies Relu and a
    3x3 conv. Every third cell downsamples (strided conv) when `image` allows; cells
    with no successor are averaged into the output, then global average pool, Gemm,
    cross-entropy.

    Inputs: x [batch, 3, image, image], labels [batch] int64."""
    if small:
        batch, image, channels, nodes, window, classes = 2, 8, 4, 6, 3, 5
    b = _Builder(seed)
    wiring = np.random.default_rng(seed + 1000)
    stem = b.op("Relu", [b.conv("x", 3, channels, "stem")], stem="stem_relu")
    outs = [stem]
    sizes = [image]
    down_at = {nodes // 3, 2 * nodes // 3} if image >= 16 else set()
    consumed = set()
    for i in range(nodes):
        lo = max(0, len(outs) - window)
        candidates = list(range(lo, len(outs)))
        count = int(wiring.integers(1, min(3, len(candidates)) + 1))
        preds = sorted(set([len(outs) - 1]) | set(
            int(p) for p in wiring.choice(candidates, size=count, replace=False)))
        if i in down_at:
            preds = [len(outs) - 1]  # a downsampling cell reads just the latest one
        size = sizes[preds[-1]]
        preds = [p for p in preds if sizes[p] == size]
        consumed.update(preds)
        name = "cell%d" % i
        summed = outs[preds[0]] if len(preds) == 1 else \
            b.op("Sum", [outs[p] for p in preds], stem=name + ".sum")
        stride = 2 if i in down_at else 1
        y = b.conv(b.op("Relu", [summed], stem=name + ".relu"), channels, channels,
                   name + ".conv", stride=stride, gain=np.sqrt(2.0 / len(preds)))
        outs.append(y)
        sizes.append(size // stride)
    final = sizes[-1]
    leaves = [j for j in range(1, len(outs)) if j not in consumed and sizes[j] == final]
    merged = outs[leaves[0]] if len(leaves) == 1 else \
        b.op("Mean", [outs[j] for j in leaves], stem="merge")
    h = b.op("Relu", [merged], stem="final_relu")
    pooled = b.op("Flatten", [b.op("GlobalAveragePool", [h], stem="gap")], stem="flat")
    logits = b.linear(pooled, channels, classes, "head")
    b.cross_entropy(logits, "labels")
    return b.model([_float("x", [batch, 3, image, image]), _int64("labels", [batch])],
                   [_LOSS], "randwire")


_BUILDERS = {"mlp": mlp, "resnet": resnet, "densenet": densenet, "unet": unet,
             "transformer": transformer, "randwire": randwire}
EXAMPLES = list(_BUILDERS)


def forward_example(name: str, **size) -> onnx.ModelProto:
    """The forward model (with its loss) of example `name`."""
    if name not in _BUILDERS:
        raise KeyError("unknown example %r; choose from %s" % (name, EXAMPLES))
    return _BUILDERS[name](**size)


def example_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs for a forward or training model of the zoo."""
    rng = np.random.default_rng(seed + 12345)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in model.graph.input}
    inits = {t.name: t for t in model.graph.initializer}
    classes = _classes(model)
    feeds = {}
    for value in model.graph.input:
        if value.name in inits:
            continue
        shape = shapes[value.name]
        if value.type.tensor_type.elem_type == TensorProto.INT64:
            feeds[value.name] = rng.integers(0, classes.get(value.name, 2), size=shape,
                                             dtype=np.int64)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _classes(model):
    """The valid range of each int64 input: the vocabulary for tokens, classes for labels."""
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    out = {}
    if "embed.weight" in inits:
        out["tokens"] = inits["embed.weight"][0]
    # the head's output size is the class count
    for key in ("head.weight", "lm_head.weight"):
        if key in inits:
            dims = inits[key]
            out["labels"] = dims[0] if key == "head.weight" else dims[1]
    return out


def training_example(name: str, seed: int = 0, **size):
    """(training model, inputs) for example `name`: the training graph built from the
    forward (loss, then `<param>_grad` per parameter) and deterministic seeded inputs."""
    from graphopt.builder.train_graph import build_training_graph
    forward = forward_example(name, seed=seed, **size)
    feeds = example_inputs(forward, seed=seed)
    return build_training_graph(forward), feeds
