"""The builder's node order for a graph that runs in file order (``PRIORITY_BASED``).

A training graph with its optimizer step runs in the order of its file (graphopt/builder/
optimizer.py writes each update where it should run), so the builder picks that order:
`leanest_file_order` keeps the candidate order the cost model gives the least peak, after
`sink_to_readers` has moved each node whose outputs outweigh the inputs it keeps alive down to
right before its first reader (autodiff computes a tied embedding's gradient from the output
projection at the start of the backward pass, and it is read only at the end, where the
embedding's own contribution is added). `default_order` is the order ONNX Runtime's DEFAULT
walk runs a graph in, one of the candidates.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from graphopt.analyze import implicit_inputs

from .graph_util import infer_shapes


def static_tensor_bytes(model: onnx.ModelProto) -> dict[str, int]:
    """Bytes of every tensor whose type and shape ONNX shape inference knows fully."""
    inferred = infer_shapes(model)
    sizes: dict[str, int] = {}
    graph = inferred.graph
    for value in list(graph.value_info) + list(graph.input) + list(graph.output):
        tensor_type = value.type.tensor_type
        if not value.type.HasField("tensor_type") or not tensor_type.HasField("shape"):
            continue
        dims = tensor_type.shape.dim
        if not all(d.HasField("dim_value") for d in dims):
            continue
        try:
            itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)).itemsize
        except (KeyError, TypeError, ValueError):
            continue
        sizes[value.name] = int(np.prod([d.dim_value for d in dims], dtype=np.int64)) * itemsize
    return sizes


def sink_to_readers(nodes: list[onnx.NodeProto], sizes: dict[str, int], resident: set[str],
                    graph_outputs: set[str]) -> list[onnx.NodeProto]:
    """`nodes` (topologically sorted) with each node moved to right before its first reader
    when its outputs are larger than the inputs whose life that would extend (inputs no later
    node reads); the memory between its old and new place then only goes down. A node moves
    only when every size involved is known (`sizes`); nodes that write graph outputs, have no
    reader or hold subgraphs stay. The order stays topological."""
    reads = [[t for t in dict.fromkeys(list(n.input) + list(implicit_inputs(n))) if t] for n in nodes]
    readers: dict[str, list[int]] = {}
    for i, names in enumerate(reads):
        for t in names:
            readers.setdefault(t, []).append(i)
    key: list[tuple[int, int]] = [(i, 0) for i in range(len(nodes))]
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        outputs = [o for o in node.output if o]
        if (not outputs or any(o in graph_outputs for o in outputs)
                or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)):
            continue
        consumers = [j for o in outputs for j in readers.get(o, ()) if j > i]
        if not consumers:
            continue
        target = min(key[j] for j in consumers)
        if target[0] <= i or any(o not in sizes for o in outputs):
            continue
        extended = 0
        for t in reads[i]:
            if t in resident:
                continue
            if max((key[j][0] for j in readers[t] if j != i), default=-1) >= target[0]:
                continue                    # read there or later anyway
            if t not in sizes:
                extended = None
                break
            extended += sizes[t]
        if extended is not None and sum(sizes[o] for o in outputs) > extended:
            key[i] = (target[0], target[1] - 1)
    return [nodes[i] for i in sorted(range(len(nodes)), key=lambda i: (key[i], i))]


def leanest_file_order(model: onnx.ModelProto, candidates: list[list[str]], cost_graph=None) -> float:
    """In place: write the model's nodes in the candidate order (node names, each a
    topological order of all of them) whose run in file order (PRIORITY_BASED) the cost model
    gives the least peak, after `sink_to_readers` (the first of equally lean ones): the least
    peak a plan can reach from it (`search.plan.peak_floor_bytes`: what recomputation leaves)
    first, then its peak with every activation kept; sizes from ONNX shape inference (a tensor
    of unknown size counts 0). Returns that last peak in bytes."""
    from graphopt.analyze import analyze
    from graphopt.costmodel import priority_order, simulate
    from graphopt.op_rules import build_cost_graph

    graph = model.graph
    by_name = {n.name: n for n in graph.node}
    if len(by_name) != len(graph.node) or any(sorted(names) != sorted(by_name) for names in candidates):
        raise ValueError("each candidate order must name every node of the model once (unique names)")
    sizes = static_tensor_bytes(model)
    resident = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    outputs = {v.name for v in graph.output}
    if cost_graph is None:
        cost_graph = build_cost_graph(analyze(model), sizes, {})
    best, best_key = None, None
    for names in candidates:
        nodes = sink_to_readers([by_name[n] for n in names], sizes, resident, outputs)
        schedule = [(n.name, 0) for n in nodes if n.name in cost_graph]
        peak = simulate(cost_graph, priority_order(cost_graph, schedule)).peak_bytes
        key = (_floor_peak(cost_graph, [name for name, _ in schedule]), peak)
        if best_key is None or key < best_key:
            best, best_key = nodes, key
    graph.ClearField("node")
    graph.node.extend(best)
    return best_key[1]


def _floor_peak(cost_graph, order: list[str]) -> int:
    """The least peak a plan can reach from the graph in `order` (`search.plan.peak_floor_bytes`),
    0 where that order is no topological order of the cost graph's ops."""
    from graphopt.search.plan import peak_floor_bytes
    try:
        return peak_floor_bytes(cost_graph.in_order(order))
    except ValueError:
        return 0


def default_order(model: onnx.ModelProto) -> list[int]:
    """Positions of the model's nodes (Constant nodes left out: ORT makes them initializers at
    load) in the order ONNX Runtime's ``ExecutionOrder.DEFAULT`` runs them: a post-order
    depth-first walk back from the nodes nobody reads, the highest file position first, and
    among a node's producers the highest position first (docs/ort-facts.md, section 3)."""
    nodes = list(model.graph.node)
    kept = [i for i, n in enumerate(nodes) if n.op_type != "Constant"]
    producer = {o: i for i in kept for o in nodes[i].output if o}
    producers: dict[int, list[int]] = {}
    has_reader: set[int] = set()
    for i in kept:
        found = {producer[t] for t in list(nodes[i].input) + list(implicit_inputs(nodes[i])) if t in producer}
        producers[i] = sorted(found)
        has_reader.update(found)
    stack = [(i, False) for i in kept if i not in has_reader]
    visited: set[int] = set()
    order: list[int] = []
    while stack:
        i, done = stack.pop()
        if done:
            order.append(i)
            continue
        if i in visited:
            continue
        visited.add(i)
        stack.append((i, True))
        stack.extend((p, False) for p in producers[i] if p not in visited)
    return order


def peak_places(model: onnx.ModelProto, cost_graph=None) -> list[tuple[int, str]]:
    """(peak bytes, the node running there) of the model run in file order (PRIORITY_BASED) and
    of the least peak a plan can reach on it (`search.plan.floor_schedule_and_sizes`), by the
    cost model with sizes from ONNX shape inference."""
    from graphopt.analyze import analyze
    from graphopt.costmodel import priority_order, simulate
    from graphopt.op_rules import build_cost_graph
    from graphopt.search.plan import floor_schedule_and_sizes

    order = [n.name for n in model.graph.node]
    cost_graph = build_cost_graph(analyze(model), static_tensor_bytes(model), {}) if cost_graph is None \
        else cost_graph.in_order(order)
    in_file = priority_order(cost_graph, [(n.name, 0) for n in model.graph.node if n.name in cost_graph])
    floor_schedule, zeroed = floor_schedule_and_sizes(cost_graph)
    floor_schedule = priority_order(cost_graph, floor_schedule)
    places = []
    for schedule, sizes in ((in_file, None), (floor_schedule, zeroed)):
        simulation = simulate(cost_graph, schedule, sizes)
        places.append((simulation.peak_bytes, schedule[simulation.peak_step][0]))
    return places



def place_updates(model: onnx.ModelProto, chains: list[list[str]], cost_graph=None) -> int:
    """In place: move each chain of nodes (an optimizer's update of one parameter: nodes whose
    outputs only the chain itself reads, or graph outputs) to where in the file the cost model
    gives the least peak for running it there, in one piece, in the order given (the largest
    first, each placed with the others where they are). Returns how many chains moved.

    A chain placed later holds what it reads (the gradient) longer, and runs where less else is
    alive: an embedding's update run where the backward pass still holds the activations that
    the weight gradients after it read costs more than the same update run after them. A chain
    moves with the nodes that make only what it reads, where each reads no more than it makes
    (`_with_exclusive_producers`), and goes no earlier than right after the nodes that make
    what it reads; what it reads that later nodes read too is counted alive while it runs and
    freed after them. Sizes from ONNX shape inference (`static_tensor_bytes`);
    the order the cost model runs is the file's, as PRIORITY_BASED runs a file written in a
    topological order. The place chosen has the least peak with the sizes of the floor
    (`search.plan.floor_schedule_and_sizes`: the activations a plan can recompute take nothing,
    so this is what recomputation leaves), then the least peak with every activation kept, then
    the least bytes alive while the chain runs (each with both sizes); among equals the place it
    has, else the earliest. For position t among the other nodes (S, n of them) and the chain
    simulated at the end (`_peaks_by_position`): the peak before t is S's, the chain's own is
    the bytes resting after step t-1 plus its rise over what rests before it, and after t it is
    S's less what the chain frees."""
    from graphopt.analyze import analyze
    from graphopt.op_rules import build_cost_graph
    from graphopt.search.plan import floor_schedule_and_sizes

    if cost_graph is None:
        cost_graph = build_cost_graph(analyze(model), static_tensor_bytes(model), {})
    _, zeroed = floor_schedule_and_sizes(cost_graph)
    by_name = {n.name: n for n in model.graph.node}
    order = [n.name for n in model.graph.node]
    moved = 0
    graph_outputs = {v.name for v in model.graph.output}
    readers: dict[str, set[str]] = {}
    producer: dict[str, str] = {}
    for name, node in by_name.items():
        for t in list(node.input) + list(implicit_inputs(node)):
            if t:
                readers.setdefault(t, set()).add(name)
        for o in node.output:
            if o:
                producer[o] = name
    resident = {v.name for v in model.graph.input} | {t.name for t in model.graph.initializer}
    tensor_bytes = {name: int(size) for name, size in zip(cost_graph.tensor_names, cost_graph.tensor_bytes_by_id)
                    if name not in resident}
    for chain in chains:
        chain = _with_exclusive_producers(chain, by_name, graph_outputs, readers, producer, tensor_bytes)
        members = set(chain)
        rest = [name for name in order if name not in members]
        in_chain = [name for name in order if name in members]
        rest_steps = [name for name in rest if name in cost_graph]
        chain_steps = [name for name in in_chain if name in cost_graph]
        if not chain_steps or not rest_steps:
            continue
        n = len(rest_steps)
        positions, peaks, own = _peaks_by_position(cost_graph, rest_steps, chain_steps, None)
        _, floor_peaks, floor_own = _peaks_by_position(cost_graph, rest_steps, chain_steps, zeroed)
        following = _next_step(order, in_chain, cost_graph, members)
        current = rest_steps.index(following) if following is not None else n
        # the least peak with every activation kept and with none (the floor a plan can reach),
        # then where the chain itself holds least; the place it has among equals
        keys = np.stack([floor_peaks, peaks, floor_own, own, positions != current])
        best = int(positions[np.lexsort(keys[::-1])[0]])
        # the chain goes right before rest_steps[best] (or last)
        anchor = rest_steps[best] if best < n else None
        placed = []
        for name in rest:
            if name == anchor:
                placed.extend(in_chain)
            placed.append(name)
        if anchor is None:
            placed.extend(in_chain)
        if placed != order and _topological(placed, by_name, members, readers, producer):
            moved += 1
            order = placed
    model.graph.ClearField("node")
    model.graph.node.extend(by_name[name] for name in order)
    return moved


def _peaks_by_position(cost_graph, rest_steps: list[str], chain_steps: list[str], sizes_by_id):
    """For the chain run right before rest_steps[t] (t = len: last), for every t it can go
    (after what it reads is made): (t, the peak, the peak while the chain runs), by the cost
    model with tensor sizes `sizes_by_id` (None: the graph's), from two simulations: the chain
    at the end and the rest alone."""
    from graphopt.costmodel import liveness

    n = len(rest_steps)
    at_end = liveness(cost_graph, [(name, 0) for name in rest_steps + chain_steps], sizes_by_id)
    without = liveness(cost_graph, [(name, 0) for name in rest_steps], sizes_by_id)
    born_before = np.flatnonzero(at_end.storage_born < n)
    read_in_chain = born_before[at_end.storage_last[born_before] >= n]
    held = read_in_chain[at_end.storage_freed[read_in_chain]]
    held_bytes = at_end.storage_bytes[held].astype(np.int64)
    # read elsewhere last at step held_last (its birth when only the chain reads it): with the
    # chain at t, freed by the chain when held_last < t, else after step held_last
    held_last = without.storage_last[held]
    earliest = max([int(at_end.storage_born[k]) + 1 for k in read_in_chain] + [1])
    running, resting = at_end.running[:n].astype(np.int64), at_end.resting
    rise = int(at_end.running[n:].max()) - int(resting[n - 1])
    # steps i >= t hold what the chain frees only until its last other read
    freed_by = np.zeros(n + 1, dtype=np.int64)
    np.add.at(freed_by, np.minimum(held_last + 1, n), held_bytes)
    after = np.concatenate((np.maximum.accumulate((running - np.cumsum(freed_by)[:n])[::-1])[::-1],
                            [np.iinfo(np.int64).min]))
    before = np.maximum.accumulate(running)                       # before[t-1]: steps < t
    positions = np.arange(earliest, n + 1)
    # during the chain, what it would free but is read later still (conservative)
    own = resting[positions - 1] + rise + _bytes_read_from(held_last, held_bytes, positions)
    return positions, np.maximum(np.maximum(before[positions - 1], own), after[positions]), own


# a node joins an update that reads all it makes when what it reads from outside the update is
# at most this much more than what it makes (so that a tied embedding's gradient scattered into
# its output projection's part, both its size, joins; a shared weight's sum of every layer's
# part, whose parts would hold each layer's activations to the end, does not)
JOIN_SLACK = 1 / 16


def _with_exclusive_producers(chain: list[str], by_name: dict, graph_outputs: set[str],
                              readers: dict[str, set[str]], producer: dict[str, str],
                              tensor_bytes: dict[str, int]) -> list[str]:
    """`chain` and, transitively, every node whose outputs only the chain reads (none a graph
    output, none holding a subgraph) and that reads, from outside the chain, at most
    (1 + JOIN_SLACK) times the bytes it makes: what makes the gradient an update reads moves
    with it where that holds no more for the update than the gradient itself. `readers`:
    tensor -> the nodes reading it; `producer`: tensor -> the node making it; `tensor_bytes`:
    sizes (graph inputs and initializers absent: they are always there)."""
    members = set(chain)
    stack = list(chain)
    while stack:
        node = by_name[stack.pop()]
        for t in list(node.input) + list(implicit_inputs(node)):
            name = producer.get(t)
            if name is None or name in members:
                continue
            candidate = by_name[name]
            outputs = [o for o in candidate.output if o]
            if not (outputs and not any(o in graph_outputs for o in outputs)
                    and all(readers.get(o, set()) <= members for o in outputs)
                    and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                for a in candidate.attribute)):
                continue
            read = {i for i in list(candidate.input) + list(implicit_inputs(candidate))
                    if i and producer.get(i) not in members}
            made = sum(tensor_bytes.get(o, 0) for o in outputs)
            if sum(tensor_bytes.get(i, 0) for i in read) <= made * (1 + JOIN_SLACK):
                members.add(name)
                stack.append(name)
    return [name for name in by_name if name in members]


def _bytes_read_from(last: np.ndarray, sizes: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """For each position t: the bytes of `sizes` whose `last` read is at step t or later."""
    if not len(last):
        return np.zeros(len(positions), dtype=np.int64)
    order = np.argsort(last)
    suffix = np.concatenate((np.cumsum(sizes[order][::-1])[::-1], [0]))
    return suffix[np.searchsorted(last[order], positions, side="left")]


def _next_step(order: list[str], chain: list[str], cost_graph, members: set[str]) -> str | None:
    """The first node after the chain's last one (in `order`) that the cost graph runs."""
    for name in order[order.index(chain[-1]) + 1:]:
        if name not in members and name in cost_graph:
            return name
    return None


def _topological(order: list[str], by_name: dict, moved: set[str], readers: dict[str, set[str]],
                 producer: dict[str, str]) -> bool:
    """Whether in `order` the `moved` nodes come after the nodes that make what they read, and
    before the nodes that read what they make (the rest kept their order among themselves)."""
    position = {name: k for k, name in enumerate(order)}
    for name in moved:
        node = by_name[name]
        for t in list(node.input) + list(implicit_inputs(node)):
            if t in producer and position[producer[t]] > position[name]:
                return False
        for o in node.output:
            if any(position[r] < position[name] for r in readers.get(o, ())):
                return False
    return True
