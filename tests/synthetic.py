"""Synthetic training cost graphs for solver tests: a random forward DAG and the backward
pass reverse-mode differentiation would give it (no ONNX)."""
from __future__ import annotations

import random

import networkx as nx


def training_cost_graph(n_forward: int, seed: int = 0, max_fanin: int = 2,
                        random_ops: float = 0.0) -> nx.DiGraph:
    rng = random.Random(seed)
    g = nx.DiGraph()
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
        g.add_node(op, inputs=tuple(sorted(picks)), outputs=(t,), seconds=rng.uniform(0.5, 2.0),
                   phase="forward", alias=False, recomputable=rng.random() >= random_ops,
                   runs_first=False, op_type="F")
        forward.append(op)
        outs.append(t)
    loss_op = "loss_op"
    g.add_node(loss_op, inputs=(outs[-1],), outputs=("loss",), seconds=0.1, phase="forward",
               alias=False, recomputable=True, runs_first=False, op_type="Loss")
    forward.append(loss_op)
    tensor_bytes["loss"] = 1
    grad = {outs[-1]: "g_loss"}
    g.add_node("b_loss", inputs=(outs[-1],), outputs=("g_loss",), seconds=0.1, phase="backward",
               alias=False, recomputable=True, runs_first=False, op_type="B")
    backward.append("b_loss")
    tensor_bytes["g_loss"] = tensor_bytes[outs[-1]]
    kept = {"loss"}
    for i in reversed(range(n_forward)):
        op = f"f{i}"
        t = f"a{i}"
        if t not in grad:
            continue
        ins = g.nodes[op]["inputs"]
        # reads its output's gradient, its inputs and its output (like tanh/matmul rules)
        b = f"b{i}"
        produced = []
        for u in ins:
            gu = f"g_{u}_{i}"
            tensor_bytes[gu] = tensor_bytes[u]
            produced.append(gu)
        g.add_node(b, inputs=(grad[t],) + ins + (t,), outputs=tuple(produced), seconds=2 * g.nodes[op]["seconds"],
                   phase="backward", alias=False, recomputable=True, runs_first=False, op_type="B")
        backward.append(b)
        for u, gu in zip(ins, produced):
            if u in grad:  # accumulate
                acc = f"acc_{u}_{i}"
                tensor_bytes[acc] = tensor_bytes[u]
                g.add_node(f"sum_{u}_{i}", inputs=(grad[u], gu), outputs=(acc,), seconds=0.1,
                           phase="backward", alias=False, recomputable=True, runs_first=False, op_type="Sum")
                backward.append(f"sum_{u}_{i}")
                grad[u] = acc
            else:
                grad[u] = gu
    if "x" in grad:
        kept.add(grad["x"])
    producer = {}
    for op in forward + backward:
        for t in g.nodes[op]["inputs"]:
            if t in producer:
                g.add_edge(producer[t], op)
        for t in g.nodes[op]["outputs"]:
            producer[t] = op
    g.graph.update(tensor_bytes=tensor_bytes, resident=frozenset({"x"}), kept=frozenset(kept),
                   droppable=frozenset(), forward_order=forward, backward_order=backward)
    return g
