"""Synthetic training cost graphs for solver tests: a random forward DAG and the backward
pass reverse-mode differentiation would give it (no ONNX)."""
from __future__ import annotations

import random

from graphopt.costgraph import CostGraph, Op


def training_cost_graph(n_forward: int, seed: int = 0, max_fanin: int = 2,
                        random_ops: float = 0.0) -> CostGraph:
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
