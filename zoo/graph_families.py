"""Abstract training cost graphs of four families, sized by TOTAL op count (forward + backward).

    chains        Conv -> Relu layers in stages of falling activation size, a Reshape (alias)
                  now and then, average pooling between stages
    residual      the same with a skip connection (Add) every 2-3 layers
    dense         DenseNet blocks: each layer reads the Concat of the block input and every
                  earlier layer's output; transitions (Conv + pooling) between blocks
    random        random layered DAGs: layers of 1-4 ops of mixed types (Conv, Relu, Tanh,
                  Gelu, Add, Concat, Reshape, Dropout) reading tensors of the last 3 layers

The backward pass is what reverse-mode differentiation (as ONNX Runtime's gradient builder
writes it) gives each forward op: a Conv becomes a Reshape (alias) of the output gradient, a
ConvTranspose for the input gradient (with a work buffer), a Conv + Transpose for the weight
gradient and a ReduceSum for the bias gradient (weight and bias gradients are graph outputs,
kept); a Relu becomes Greater(y) -> Cast -> Mul; a Concat one Slice per input; gradients that
reach a tensor along several paths are accumulated by one Sum of all of them (multi-input;
3+ inputs need a work buffer); an Add or forward Sum passes its gradient to every input
without an op. The loss head is Gemm -> LogSoftmax -> NLL loss; its backward starts from a
resident seed and a Size op (``runs_first``). Dropout is not recomputable (its mask is a
second output that the backward reads).

Attribute conventions are those of graphopt/costmodel.py and zoo/synthetic.py. Activations
are 1-16 MiB and seconds scale with bytes (Conv-like ops ~10x elementwise ones). Every
generator is deterministic in (n_total, seed), and the returned graph has exactly
``n_total`` ops (filled up with Reshape pairs and, if the count is odd, one Shape op).

    from graphopt_zoo.graph_families import FAMILIES, make_graph
    graph = make_graph("residual", 10_000, seed=0)
"""
from __future__ import annotations

import math
import random

from graphopt.costgraph import CostGraph, Op


MiB = 2 ** 20
KiB = 2 ** 10
STAGE_BYTES = (16 * MiB, 8 * MiB, 4 * MiB, 2 * MiB, 1 * MiB)


class _Builder:
    """Forward ops as plain records, then their backward; the cost graph is made last."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.ops: dict[str, dict] = {}
        self.forward: list[str] = []
        self.backward: list[str] = []
        self.tensor_bytes: dict[str, int] = {}
        self.resident: set[str] = set()
        self.kept: set[str] = set()
        self.producer: dict[str, str] = {}
        self.count = 0

    # -- helpers -------------------------------------------------------------------------
    def _name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def jitter(self) -> float:
        return self.rng.uniform(0.7, 1.3)

    def resident_tensor(self, prefix: str, nbytes: int) -> str:
        t = self._name(prefix)
        self.tensor_bytes[t] = nbytes
        self.resident.add(t)
        return t

    def add_op(self, op_type: str, inputs, outputs_bytes, seconds: float, phase: str, *,
               alias=False, recomputable=True, runs_first=False, workspace=0, **extra) -> tuple[str, ...]:
        op = self._name(f"{'f' if phase == 'forward' else 'b'}_{op_type}_")
        outputs = []
        for k, nbytes in enumerate(outputs_bytes):
            t = f"{op}:{k}"
            self.tensor_bytes[t] = int(nbytes)
            self.producer[t] = op
            outputs.append(t)
        self.ops[op] = dict(inputs=tuple(inputs), outputs=tuple(outputs), seconds=float(seconds),
                            phase=phase, alias=alias, recomputable=recomputable, runs_first=runs_first,
                            folded=False, workspace=int(workspace), op_type=op_type, **extra)
        (self.forward if phase == "forward" else self.backward).append(op)
        return tuple(outputs)

    def nbytes(self, t: str) -> int:
        return self.tensor_bytes[t]

    # -- forward ops ---------------------------------------------------------------------
    def conv(self, x: str, out_bytes: int) -> str:
        w_bytes = self.rng.choice([64, 256, 576, 1024, 2304]) * KiB
        w = self.resident_tensor("W", w_bytes)
        b = self.resident_tensor("bias", 4 * KiB)
        seconds = 0.5e-3 * (self.nbytes(x) + out_bytes) / MiB * self.jitter()
        return self.add_op("Conv", (x, w, b), (out_bytes,), seconds, "forward")[0]

    def unary(self, op_type: str, x: str) -> str:
        seconds = 0.05e-3 * self.nbytes(x) / MiB * self.jitter()
        return self.add_op(op_type, (x,), (self.nbytes(x),), seconds, "forward")[0]

    def reshape(self, x: str) -> str:
        return self.add_op("Reshape", (x,), (self.nbytes(x),), 5e-6, "forward", alias=True)[0]

    def pool(self, x: str, factor: int = 2) -> str:
        seconds = 0.1e-3 * self.nbytes(x) / MiB * self.jitter()
        return self.add_op("AveragePool", (x,), (max(KiB, self.nbytes(x) // factor),), seconds, "forward")[0]

    def add(self, xs: list[str]) -> str:
        """Add of two inputs, forward Sum of more (the gradient passes to each input)."""
        nbytes = max(self.nbytes(x) for x in xs)
        seconds = 0.05e-3 * len(xs) * nbytes / MiB * self.jitter()
        return self.add_op("Add" if len(xs) == 2 else "Sum", xs, (nbytes,), seconds, "forward",
                           workspace=nbytes if len(xs) >= 3 else 0)[0]

    def concat(self, xs: list[str]) -> str:
        nbytes = sum(self.nbytes(x) for x in xs)
        return self.add_op("Concat", xs, (nbytes,), 0.1e-3 * nbytes / MiB * self.jitter(), "forward")[0]

    def dropout(self, x: str) -> str:
        nbytes = self.nbytes(x)
        return self.add_op("Dropout", (x,), (nbytes, nbytes // 4), 0.1e-3 * nbytes / MiB * self.jitter(),
                           "forward", recomputable=False)[0]

    def loss_head(self, h: str, pad_reshapes: int) -> str:
        for _ in range(pad_reshapes):
            h = self.reshape(h)
        logits = self.conv(h, 64 * KiB)
        logp = self.unary("LogSoftmax", logits)
        labels = self.resident_tensor("labels", 2 * KiB)
        loss = self.add_op("NLLLoss", (logp, labels), (4,), 2e-5, "forward")[0]
        self.kept.add(loss)
        self.labels = labels
        return loss

    # -- backward ------------------------------------------------------------------------
    def differentiate(self, loss: str, odd_shape_op: bool) -> None:
        contributions: dict[str, list[str]] = {}
        seed = self.resident_tensor("loss_seed", 4)
        loss_op = self.producer[loss]
        logp = self.ops[loss_op]["inputs"][0]
        size = self.add_op("Size", (logp,), (8,), 2e-6, "backward", runs_first=True)[0]
        scale = self.add_op("Div", (seed, size), (4,), 4e-6, "backward")[0]
        g = self.add_op("NLLLossGrad", (scale, self.labels), (self.nbytes(logp),), 1e-5, "backward")[0]
        contributions[logp] = [g]
        first_conv = True
        for op in reversed(self.forward):
            if op == loss_op:
                continue
            rec = self.ops[op]
            y = rec["outputs"][0]
            if y not in contributions:
                continue
            gy = self.gradient(y, contributions)
            gxs = self.backward_rule(rec, y, gy, odd_shape_op and first_conv)
            if rec["op_type"] == "Conv":
                first_conv = False
            for x, gx in gxs:
                if x not in self.resident:
                    contributions.setdefault(x, []).append(gx)

    def gradient(self, t: str, contributions: dict[str, list[str]]) -> str:
        parts = contributions[t]
        if len(parts) == 1:
            return parts[0]
        nbytes = self.nbytes(t)
        return self.add_op("Sum", parts, (nbytes,), 0.05e-3 * len(parts) * nbytes / MiB * self.jitter(),
                           "backward", workspace=nbytes if len(parts) >= 3 else 0)[0]

    def backward_rule(self, rec: dict, y: str, gy: str, with_shape_op: bool) -> list[tuple[str, str]]:
        kind = rec["op_type"]
        ins = rec["inputs"]
        gbytes = self.nbytes(gy)
        if kind == "Conv":
            x, w, b = ins
            seconds = rec["seconds"]
            shape_in = ()
            if with_shape_op:
                shape_in = self.add_op("Shape", (w,), (16,), 2e-6, "backward", runs_first=True)
            gy2 = self.add_op("Reshape", (gy,) + shape_in, (gbytes,), 5e-6, "backward", alias=True)[0]
            out = []
            if x not in self.resident:
                gx = self.add_op("ConvTranspose", (gy2, w), (self.nbytes(x),), seconds * self.jitter(),
                                 "backward", workspace=self.nbytes(w) // 2)[0]
                out.append((x, gx))
            gw_raw = self.add_op("Conv", (x, gy2), (self.nbytes(w),), seconds * self.jitter(), "backward",
                                 workspace=self.nbytes(w) // 8)[0]
            gw = self.add_op("Transpose", (gw_raw,), (self.nbytes(w),), 0.2e-3 * self.nbytes(w) / MiB,
                             "backward")[0]
            gb = self.add_op("ReduceSum", (gy,), (self.nbytes(b),), 0.05e-3 * gbytes / MiB, "backward")[0]
            self.kept.update((gw, gb))
            return out
        if kind == "Relu":
            mask = self.add_op("Greater", (y,), (gbytes // 4,), 0.03e-3 * gbytes / MiB, "backward")[0]
            maskf = self.add_op("Cast", (mask,), (gbytes,), 0.03e-3 * gbytes / MiB, "backward")[0]
            return [(ins[0], self.add_op("Mul", (gy, maskf), (gbytes,), 0.05e-3 * gbytes / MiB, "backward")[0])]
        if kind in ("Tanh", "LogSoftmax"):
            sq = self.add_op("Mul", (y, y), (gbytes,), 0.05e-3 * gbytes / MiB, "backward")[0]
            d = self.add_op("Sub", (sq,), (gbytes,), 0.05e-3 * gbytes / MiB, "backward")[0]
            return [(ins[0], self.add_op("Mul", (gy, d), (gbytes,), 0.05e-3 * gbytes / MiB, "backward")[0])]
        if kind == "Gelu":
            return [(ins[0], self.add_op("GeluGrad", (gy, ins[0]), (gbytes,), 0.1e-3 * gbytes / MiB,
                                         "backward")[0])]
        if kind == "Reshape":
            return [(ins[0], self.add_op("Reshape", (gy,), (self.nbytes(ins[0]),), 5e-6, "backward", alias=True)[0])]
        if kind == "AveragePool":
            x = ins[0]
            return [(x, self.add_op("AveragePoolGrad", (gy,), (self.nbytes(x),), 0.1e-3 * self.nbytes(x) / MiB,
                                    "backward")[0])]
        if kind in ("Add", "Sum"):
            return [(x, gy) for x in ins]
        if kind == "Concat":
            return [(x, self.add_op("Slice", (gy,), (self.nbytes(x),), 0.05e-3 * self.nbytes(x) / MiB,
                                    "backward")[0]) for x in ins]
        if kind == "Dropout":
            mask = rec["outputs"][1]
            return [(ins[0], self.add_op("DropoutGrad", (gy, mask), (gbytes,), 0.05e-3 * gbytes / MiB,
                                         "backward")[0])]
        raise AssertionError(kind)

    def graph(self) -> CostGraph:
        def op(name):
            rec = self.ops[name]
            return Op(name, rec["op_type"], rec["inputs"], rec["outputs"], rec["seconds"], alias=rec["alias"],
                      recomputable=rec["recomputable"], runs_first=rec["runs_first"],
                      workspace_bytes=rec["workspace"])
        return CostGraph([op(n) for n in self.forward], [op(n) for n in self.backward], self.tensor_bytes,
                         resident=self.resident, kept=self.kept)


# -- forward bodies: (builder, units) -> last tensor --------------------------------------------
def _stages(units: int) -> list[int]:
    """Activation bytes of each of `units` layers: up to five stages, each half the last."""
    stages = min(len(STAGE_BYTES), max(1, units // 4))
    return [STAGE_BYTES[min(stages - 1, i * stages // max(1, units))] for i in range(units)]


def _chains(b: _Builder, units: int) -> str:
    sizes = _stages(units)
    h = b.resident_tensor("x", sizes[0])
    for i, nbytes in enumerate(sizes):
        if i and nbytes != sizes[i - 1]:
            h = b.pool(h, sizes[i - 1] // nbytes)
        h = b.unary("Relu", b.conv(h, nbytes))
        if b.rng.random() < 0.15:
            h = b.reshape(h)
    return h


def _residual(b: _Builder, units: int) -> str:
    sizes = _stages(units)
    h = b.resident_tensor("x", sizes[0])
    h = b.unary("Relu", b.conv(h, sizes[0]))
    i = 1
    while i < units:
        nbytes = sizes[i]
        if nbytes != sizes[i - 1]:
            h = b.pool(h, sizes[i - 1] // nbytes)
        skip = h
        depth = min(b.rng.choice([2, 3]), units - i)
        for j in range(depth):
            h = b.conv(h, nbytes)
            if j < depth - 1:
                h = b.unary("Relu", h)
        if b.rng.random() < 0.2:
            h = b.reshape(h)
        h = b.unary("Relu", b.add([h, skip]))
        i += depth
    return h


def _dense(b: _Builder, units: int) -> str:
    h = b.resident_tensor("x", 4 * MiB)
    h = b.unary("Relu", b.conv(h, 4 * MiB))
    done = 0
    while done < units:
        k = min(b.rng.randint(4, 8), units - done)
        growth = b.rng.choice([512 * KiB, 1 * MiB])
        features = [h]
        for _ in range(k):
            inp = features[0] if len(features) == 1 else b.concat(features)
            features.append(b.conv(b.unary("Relu", inp), growth))
        done += k
        block = b.concat(features)
        h = b.pool(b.conv(b.unary("Relu", block), max(MiB, b.nbytes(block) // 2)), 2)
        h = b.unary("Relu", h)
    return h


def _random(b: _Builder, units: int) -> str:
    """`units` ops in layers of 1-4; every tensor is read by a later op (all reach the loss)."""
    x = b.resident_tensor("x", 4 * MiB)
    layers = [[b.unary("Relu", b.conv(x, b.rng.choice(STAGE_BYTES[1:])))]]
    consumers: dict[str, int] = {layers[0][0]: 0}
    made = 2
    while made < units:
        window = [t for layer in layers[-3:] for t in layer]
        oldest = [t for t in layers[-3] if consumers[t] == 0] if len(layers) >= 3 else []
        width = max(b.rng.randint(1, 4), len(oldest))
        unread = [t for t in window if consumers[t] == 0]
        layer = []
        for _ in range(width):
            first = unread.pop(0) if unread else b.rng.choice(layers[-1])
            kind = b.rng.choices(["Conv", "Relu", "Tanh", "Gelu", "Add", "Concat", "Reshape", "Dropout"],
                                 [30, 15, 8, 8, 15, 8, 10, 3])[0]
            others = [t for t in window if t != first]
            if kind in ("Add", "Concat") and not others:
                kind = "Conv"
            if kind == "Concat" and b.nbytes(first) > 8 * MiB:
                kind = "Add"
            if kind == "Conv":
                t = b.conv(first, b.rng.choice(STAGE_BYTES))
            elif kind in ("Relu", "Tanh", "Gelu"):
                t = b.unary(kind, first)
            elif kind == "Reshape":
                t = b.reshape(first)
            elif kind == "Dropout":
                t = b.dropout(first)
            else:
                picks = [first] + b.rng.sample(others, min(len(others), b.rng.randint(1, 2)))
                if kind == "Concat":
                    picks = [p for p in picks if b.nbytes(p) <= 8 * MiB] or picks[:1]
                t = b.concat(picks) if kind == "Concat" and len(picks) > 1 else b.add(picks) if len(picks) > 1 \
                    else b.conv(first, b.rng.choice(STAGE_BYTES))
                for p in picks[1:]:
                    consumers[p] += 1
            consumers[first] += 1
            consumers[t] = 0
            layer.append(t)
            made += 1
        layers.append(layer)
    unread = [t for t, n in consumers.items() if n == 0]
    return unread[0] if len(unread) == 1 else b.add(unread)


FAMILIES = {"chains": _chains, "residual": _residual, "dense": _dense, "random": _random}


def _build(family: str, units: int, seed: int, pad: int) -> _Builder:
    rng = random.Random(1_000_003 * seed + list(FAMILIES).index(family))
    b = _Builder(rng)
    h = FAMILIES[family](b, units)
    loss = b.loss_head(h, pad // 2)
    b.differentiate(loss, odd_shape_op=bool(pad % 2))
    return b


def _total(b: _Builder) -> int:
    return len(b.forward) + len(b.backward)


def make_graph(family: str, n_total: int, seed: int = 0) -> CostGraph:
    """A training cost graph of `family` with exactly `n_total` ops."""
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    # largest unit count whose graph fits in n_total, then fill up with Reshape pairs / a Shape op
    lo, hi = 1, 2
    if _total(_build(family, lo, seed, 0)) > n_total:
        raise ValueError(f"{family}: {n_total} ops is too few (the smallest graph has "
                         f"{_total(_build(family, lo, seed, 0))})")
    while _total(_build(family, hi, seed, 0)) <= n_total:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _total(_build(family, mid, seed, 0)) <= n_total:
            lo = mid
        else:
            hi = mid
    pad = n_total - _total(_build(family, lo, seed, 0))
    b = _build(family, lo, seed, pad)
    assert _total(b) == n_total, (family, n_total, _total(b))
    return b.graph()


def describe(graph: CostGraph) -> str:
    fwd = len(graph.forward_order)
    tb = graph.tensor_bytes
    acts = [tb[t] for op in graph.forward_order for t in graph.ops[op].outputs]
    return (f"{len(graph)} ops ({fwd} forward), forward tensors {len(acts)} "
            f"totalling {sum(acts) / MiB:.0f} MiB, {len(graph.kept)} kept outputs")


if __name__ == "__main__":
    import sys
    sizes = [int(s) for s in (sys.argv[1:] or ["100", "1000", "10000", "20000"])]
    for family in FAMILIES:
        for n in sizes:
            print(f"{family:9s} {n:6d}: {describe(make_graph(family, n))}")
