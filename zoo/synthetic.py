"""Synthetic training cost graphs for solver tests (no ONNX).

`branching_cost_graph`: a random forward DAG with real branching and the backward pass that
reverse-mode differentiation would give it. `training_cost_graph`: the older generator, a
chain with skip connections (every op reads the latest tensor); kept for the chain solver's
tests, which need chains. `branching_stats`: what a graph's structure holds (tests assert
that their random graphs really branch).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from graphopt.costgraph import CostGraph, Op


def training_cost_graph(n_forward: int, seed: int = 0, max_fanin: int = 2,
                        random_ops: float = 0.0) -> CostGraph:
    """A chain with skips: op i reads a_{i-1} and up to max_fanin - 1 earlier tensors."""
    rng = random.Random(seed)
    g: dict[str, Op] = {}
    tensor_bytes = {"x": 100}
    forward, backward = [], []
    outs = ["x"]
    for i in range(n_forward):
        k = rng.randint(1, min(max_fanin, len(outs)))
        # mostly read recent tensors, sometimes a skip connection
        picks = {outs[-1]} | {rng.choice(outs) for _ in range(k - 1)}
        op = f"f{i}"
        t = f"a{i}"
        tensor_bytes[t] = rng.choice([10, 20, 40, 80, 100])
        g[op] = Op(op, inputs=tuple(sorted(picks)), outputs=(t,), seconds=rng.uniform(0.5, 2.0),
                   alias=False, recomputable=rng.random() >= random_ops,
                   runs_first=False, op_type="F")
        forward.append(op)
        outs.append(t)
    loss_op = "loss_op"
    g[loss_op] = Op(loss_op, inputs=(outs[-1],), outputs=("loss",), seconds=0.1, alias=False, recomputable=True, runs_first=False, op_type="Loss")
    forward.append(loss_op)
    tensor_bytes["loss"] = 1
    grad = {outs[-1]: "g_loss"}
    g["b_loss"] = Op("b_loss", inputs=(outs[-1],), outputs=("g_loss",), seconds=0.1, alias=False, recomputable=True, runs_first=False, op_type="B")
    backward.append("b_loss")
    tensor_bytes["g_loss"] = tensor_bytes[outs[-1]]
    kept = {"loss"}
    for i in reversed(range(n_forward)):
        op = f"f{i}"
        t = f"a{i}"
        if t not in grad:
            continue
        ins = g[op].inputs
        # reads its output's gradient, its inputs and its output (like tanh/matmul rules)
        b = f"b{i}"
        produced = []
        for u in ins:
            gu = f"g_{u}_{i}"
            tensor_bytes[gu] = tensor_bytes[u]
            produced.append(gu)
        g[b] = Op(b, inputs=(grad[t],) + ins + (t,), outputs=tuple(produced), seconds=2 * g[op].seconds,
                   alias=False, recomputable=True, runs_first=False, op_type="B")
        backward.append(b)
        for u, gu in zip(ins, produced):
            if u in grad:  # accumulate
                acc = f"acc_{u}_{i}"
                tensor_bytes[acc] = tensor_bytes[u]
                g[f"sum_{u}_{i}"] = Op(f"sum_{u}_{i}", inputs=(grad[u], gu), outputs=(acc,), seconds=0.1,
                           alias=False, recomputable=True, runs_first=False, op_type="Sum")
                backward.append(f"sum_{u}_{i}")
                grad[u] = acc
            else:
                grad[u] = gu
    if "x" in grad:
        kept.add(grad["x"])
    return CostGraph([g[op] for op in forward], [g[op] for op in backward], tensor_bytes,
                     resident={"x"}, kept=kept)


# ---------------------------------------------------------------- the branching generator --

SIZES = (4, 16, 40, 64, 100, 160, 256, 400, 640, 1000)

# forward op kinds: (weight, what the gradient rule reads besides the output gradients)
#   "out": the op's output (Tanh, Sigmoid, Relu, Exp); "in": its inputs (Log, Sin, Mul);
#   "none": only gradients (Add, Concat, Reshape, a split); "mask": the random op's mask;
#   matmul: input and weight, in two backward ops (dX = g W^T, dW = X^T g)
KINDS = {"unary": 6, "matmul": 3, "join": 4, "split": 2, "alias": 2}
UNARY = {"Tanh": "out", "Sigmoid": "out", "Relu": "out", "Exp": "out", "Log": "in", "Sin": "in",
         "Neg": "none"}
JOINS = {"Add": "none", "Concat": "none", "Mul": "in", "Max": "both"}


def branching_cost_graph(n_forward: int, seed: int = 0, *, random_ops: float = 0.1,
                         n_inputs: int | None = None, n_losses: int | None = None,
                         recency: float = 0.45, extra_outputs: float = 0.1,
                         input_grads: bool | None = None) -> CostGraph:
    """A random training cost graph with real branching, deterministic from `seed`.

    Forward: `n_forward` ops, then 1-3 loss terminals. Each op reads tensors from anywhere
    earlier (geometric recency: the latest tensor with probability `recency`, else an
    older one, so several ops read one tensor and branches run side by side). Kinds: unary
    ops, MatMuls against a resident weight, joins (Add, Concat, Mul, Max) of 2-4 tensors,
    splits with two outputs, Reshape-like aliases (``alias=True``), and with probability
    `random_ops` a Dropout (not recomputable; output and mask). A tensor nobody reads by
    the end goes into a loss terminal; with probability `extra_outputs` an activation is
    also a graph output (kept). Sizes from 4 to 1000 bytes, seconds from 0.1 to 3.

    Backward, as reverse-mode differentiation builds it: ops in reverse forward order, each
    reading its outputs' gradients and what its gradient rule needs (its output for Tanh,
    its inputs for Mul, the mask for Dropout, input and weight for MatMul in two ops, only
    gradients for Add/Concat/Reshape, whose gradient is an alias); a tensor read by several
    ops gets its contributions summed, either pairwise as they arrive or by one Sum of all
    (with a work buffer when it adds 3 or more) before its producer's backward. Weight
    gradients are graph outputs, and so are the inputs' gradients when `input_grads`."""
    if n_forward < 1:
        raise ValueError(f"n_forward must be at least 1, got {n_forward}")
    rng = random.Random(seed)
    if n_inputs is None:
        n_inputs = rng.choice((1, 1, 2))
    if input_grads is None:
        input_grads = rng.random() < 0.5
    tensor_bytes: dict[str, int] = {}
    resident: set[str] = set()
    kept: set[str] = set()
    droppable: set[str] = set()
    forward: list[Op] = []
    # differentiable tensors ops may read, in order of creation
    pool: list[str] = []
    for k in range(n_inputs):
        x = f"x{k}"
        tensor_bytes[x] = rng.choice(SIZES)
        resident.add(x)
        pool.append(x)
    forward_readers: dict[str, int] = {}
    requires_grad: set[str] = {x for x in pool if input_grads}
    rule: dict[str, str] = {}         # op -> what its gradient reads
    weight_of: dict[str, str] = {}

    def pick(count: int) -> list[str]:
        chosen: list[str] = []
        for _ in range(20 * count):
            if len(chosen) == count:
                break
            back = 0
            while back < len(pool) - 1 and rng.random() > recency:
                back += 1
            t = pool[len(pool) - 1 - back]
            if t not in chosen:
                chosen.append(t)
        return chosen

    def size() -> int:
        return rng.choice(SIZES)

    def seconds() -> float:
        return round(rng.uniform(0.1, 3.0), 3)

    for i in range(n_forward):
        name = f"f{i}"
        if i == 0 and not input_grads:
            kind = "matmul"                # a weight: gradients flow from the first op on
        elif rng.random() < random_ops:
            kind = "random"
        else:
            kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        if kind == "random":
            (u,) = pick(1)
            y, mask = f"t{i}", f"t{i}_mask"
            tensor_bytes[y] = tensor_bytes[u] or size()
            tensor_bytes[mask] = max(1, tensor_bytes[y] // 4)
            op = Op(name, "Dropout", (u,), (y, mask), seconds(), recomputable=False)
            rule[name] = "mask"
            outputs = [y]
        else:
            if kind == "join" and len(pool) < 2:
                kind = "unary"
            if kind == "unary":
                op_type = rng.choice(list(UNARY))
                (u,) = pick(1)
                y = f"t{i}"
                tensor_bytes[y] = size()
                workspace = size() if rng.random() < 0.1 else 0
                op = Op(name, op_type, (u,), (y,), seconds(), workspace_bytes=workspace)
                rule[name] = UNARY[op_type]
                outputs = [y]
            elif kind == "matmul":
                (u,) = pick(1)
                w, y = f"w{i}", f"t{i}"
                tensor_bytes[w] = size()
                resident.add(w)
                weight_of[name] = w
                tensor_bytes[y] = size()
                op = Op(name, "MatMul", (u, w), (y,), seconds())
                rule[name] = "matmul"
                outputs = [y]
            elif kind == "join":
                op_type = rng.choice(list(JOINS))
                ins = tuple(pick(rng.randint(2, min(4, len(pool)))))
                y = f"t{i}"
                if op_type == "Concat":
                    tensor_bytes[y] = sum(tensor_bytes[u] for u in ins)
                else:
                    tensor_bytes[y] = max(tensor_bytes[u] for u in ins)
                op = Op(name, op_type, ins, (y,), seconds())
                rule[name] = JOINS[op_type]
                outputs = [y]
            elif kind == "split":
                (u,) = pick(1)
                y0, y1 = f"t{i}_0", f"t{i}_1"
                tensor_bytes[y0], tensor_bytes[y1] = size(), size()
                op = Op(name, "Split", (u,), (y0, y1), seconds())
                rule[name] = rng.choice(("none", "in"))
                outputs = [y0, y1]
                if rng.random() < 0.2:        # an optional output nobody reads
                    droppable.add(y1)
                    outputs = [y0]
            else:
                (u,) = pick(1)
                y = f"t{i}"
                tensor_bytes[y] = tensor_bytes[u]
                op = Op(name, "Reshape", (u,), (y,), round(rng.uniform(0.0, 0.05), 3), alias=True)
                rule[name] = "none"
                outputs = [y]
        for u in op.inputs:
            forward_readers[u] = forward_readers.get(u, 0) + 1
        if any(u in requires_grad or u in weight_of.values() for u in op.inputs):
            requires_grad.update(outputs)
        forward.append(op)
        pool.extend(outputs)
        if rng.random() < extra_outputs:
            kept.add(rng.choice(outputs))

    # loss terminals: every activation nobody reads (and not a graph output) feeds one
    dangling = [t for t in pool if t not in resident and t not in forward_readers and t not in kept]
    if not dangling:
        dangling = [pool[-1]]
    if n_losses is None:
        n_losses = rng.randint(1, 3)
    n_losses = max(1, min(n_losses, len(dangling)))
    rng.shuffle(dangling)
    groups = [dangling[k::n_losses] for k in range(n_losses)]
    for k, group in enumerate(groups):
        extra = [t for t in pick(rng.randint(0, 1)) if t not in group]   # a loss may read more
        if not any(t in requires_grad for t in group + extra):
            # a term that depends on a weight or an input with a gradient: a backward pass
            extra.append(next(t for t in reversed(pool) if t in requires_grad and t not in resident))
        ins = tuple(group + extra)
        loss = f"loss{k}"
        tensor_bytes[loss] = 4
        forward.append(Op(f"loss_op{k}", "Loss", ins, (loss,), 0.05))
        rule[f"loss_op{k}"] = "in"
        kept.add(loss)

    # the backward pass
    backward: list[Op] = []
    grad: dict[str, str] = {}             # tensor -> its (accumulated so far) gradient
    pending: dict[str, list[str]] = {}    # tensor -> contributions not yet summed (Sum of all)
    at_once: dict[str, bool] = {}
    counter = [0]

    def fresh(base: str) -> str:
        counter[0] += 1
        return f"{base}_{counter[0]}"

    def contribute(t: str, g: str) -> None:
        if at_once.setdefault(t, rng.random() < 0.5):
            pending.setdefault(t, []).append(g)
        elif t in grad:
            acc = fresh(f"acc_{t}")
            tensor_bytes[acc] = tensor_bytes[t]
            backward.append(Op(f"sum_{acc}", "Sum", (grad[t], g), (acc,), 0.05))
            grad[t] = acc
        else:
            grad[t] = g

    def gradient_of(t: str) -> str | None:
        parts = pending.pop(t, [])
        if t in grad:
            parts = [grad[t]] + parts
        if not parts:
            return None
        if len(parts) == 1:
            grad[t] = parts[0]
        else:
            acc = fresh(f"acc_{t}")
            tensor_bytes[acc] = tensor_bytes[t]
            backward.append(Op(f"sum_{acc}", "Sum", tuple(parts), (acc,), 0.05 * len(parts),
                               workspace_bytes=tensor_bytes[t] if len(parts) >= 3 else 0))
            grad[t] = acc
        return grad[t]

    def wants_grad(t: str) -> bool:
        return t in requires_grad

    for op in reversed(forward):
        out_grads = [g for g in (gradient_of(t) for t in op.outputs if not t.endswith("_mask"))
                     if g is not None]
        if op.op_type == "Loss":
            out_grads = []
        elif not out_grads:
            continue                       # nothing downstream reaches a loss
        r = rule[op.name]
        ins = [u for u in op.inputs if u not in weight_of.values()]
        targets = [u for u in ins if wants_grad(u)]
        b_seconds = round(op.seconds * rng.uniform(1.0, 2.0), 3) + 0.01
        if r == "matmul":
            (u,) = ins
            w = weight_of[op.name]
            gw = f"d_{w}"
            tensor_bytes[gw] = tensor_bytes[w]
            kept.add(gw)
            backward.append(Op(f"b_{op.name}_w", "MatMulGradW", (u,) + tuple(out_grads), (gw,), b_seconds))
            if targets:
                gu = fresh(f"d_{u}")
                tensor_bytes[gu] = tensor_bytes[u]
                backward.append(Op(f"b_{op.name}", "MatMulGradX", tuple(out_grads) + (w,), (gu,), b_seconds))
                contribute(u, gu)
            continue
        if not targets:
            continue
        reads = list(out_grads)
        if r in ("out", "both"):
            reads += [t for t in op.outputs if t not in droppable]
        if r in ("in", "both"):
            reads += list(op.inputs)
        if r == "mask":
            reads += [op.outputs[1]]
        produced = []
        for u in targets:
            gu = fresh(f"d_{u}")
            tensor_bytes[gu] = tensor_bytes[u]
            produced.append(gu)
        alias = op.alias and len(produced) == 1 and len(out_grads) == 1   # Reshape of the gradient
        backward.append(Op(f"b_{op.name}", op.op_type + "Grad", tuple(dict.fromkeys(reads)), tuple(produced),
                           b_seconds, alias=alias))
        for u, gu in zip(targets, produced):
            contribute(u, gu)
    for x in sorted(resident):
        if input_grads and x.startswith("x"):
            g = gradient_of(x)
            if g is not None:
                kept.add(g)
    read = {t for op in forward + backward for t in op.inputs}
    # a Dropout whose output gets no gradient: its optional mask is unused (the rewrite drops it)
    droppable |= {t for op in forward if op.op_type == "Dropout" for t in op.outputs[1:] if t not in read}
    return CostGraph(forward, backward, tensor_bytes, resident=resident, kept=kept, droppable=droppable)


@dataclass(frozen=True)
class BranchingStats:
    parallel: bool        # two forward ops neither of which depends on the other
    fan_out: bool         # an activation read by two forward ops that is not only the latest
    join: bool            # a forward op reading two activations made by different ops
    multi_output: bool    # a forward op with two outputs
    losses: int           # forward ops whose outputs are graph outputs and read by nobody
    accumulations: int    # backward Sum ops

    @property
    def branching(self) -> bool:
        return self.parallel and self.fan_out and self.join


def branching_stats(graph: CostGraph) -> BranchingStats:
    """What makes a forward graph more than a chain with skips (see BranchingStats)."""
    ops = graph.ops
    order = graph.forward_order
    producer = graph.forward_tensors
    ancestors: dict[str, set[str]] = {}
    for name in order:
        a: set[str] = set()
        for t in ops[name].inputs:
            if t in producer:
                a.add(producer[t])
                a |= ancestors[producer[t]]
        ancestors[name] = a
    parallel = any(prev not in ancestors[nxt] for prev, nxt in zip(order, order[1:]))
    position = {name: i for i, name in enumerate(order)}
    fan_out = False
    for t, p in producer.items():
        readers = [r for r in graph.readers(t) if graph.phase(r) == "forward"]
        # read by two ops, one of them not right after the producer (a branch, not a step)
        if len(readers) >= 2 and any(position[r] > position[p] + 1 for r in readers):
            fan_out = True
            break
    join = any(len({producer[t] for t in ops[n].inputs if t in producer}) >= 2 for n in order)
    multi = any(len(ops[n].outputs) >= 2 for n in order)
    losses = sum(1 for n in order if ops[n].outputs and all(
        t in graph.kept and not graph.readers(t) for t in ops[n].outputs))
    sums = sum(1 for n in graph.backward_order if ops[n].op_type == "Sum")
    return BranchingStats(parallel, fan_out, join, multi, losses, sums)
