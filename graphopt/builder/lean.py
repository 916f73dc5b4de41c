"""Passes over the differentiated graph that keep less alive than reverse mode leaves, so a
built graph's own peak stays near PyTorch eager's (benchmarks/builder_vs_eager.py).

* pads_sum_to_concat: the gradient of pieces sliced from one tensor (an LSTM's gates, Split)
  arrives as each piece zero-padded to the whole, then summed: n full-size tensors where one
  suffices. When the pieces tile one axis exactly, Sum(Pad(g_i)) is Concat(g_i).
* recompute_gelu_intermediates: exact GELU as exported (x / sqrt 2 -> Erf -> + 1 -> * x ->
  * 0.5) leaves the backward reading the Div and Add outputs, two tensors the size of x kept
  from the forward besides x itself. The backward gets its own copies of them, recomputed
  from x right before their first backward reader, as PyTorch's gelu backward does. The same
  for SiLU / Swish, x * Sigmoid(x): the backward recomputes the Sigmoid from x (EfficientNet).
* transposed_products: Transpose(A @ B) of 2-D products (a weight's gradient through a
  transposed weight: a tied language-model head) -> one Gemm writing B^T A^T.
* transposed_weights_into_gemm: MatMul(A, Transpose(W)) (a Linear on a sequence as exported)
  -> Gemm(A rows, W, transB=1): no weight-sized copy, which ORT's default order made at the
  start of the step for every layer (Swin-T full: 182 -> 134 MiB).
* outputs_written_in_place: a graph output that is a Reshape of an intermediate is a copy in
  ONNX Runtime; the producer writes the gradient output itself.
* masks_as_products: Where(mask, g, 0) (the gradients of Clip, ReLU6, Max/Min masks) ->
  g * Cast(mask): ONNX Runtime's CPU Where broadcasts the scalar zero element by element, 50x
  slower than Cast and Mul on a [8, 144, 16, 16, 1] gradient (7.49 against 0.15 ms, one
  thread); MobileNetV2's step spent 37% of its time in Where. The same values for finite
  gradients; a non-finite one masked out becomes NaN instead of 0 (training has diverged there).
* loss_first: the loss-only nodes go last in the file, so ORT's default order computes the
  loss right after the forward instead of after the backward.

Cross entropy's fused gradient is in losses.py (cross_entropy_seed), the embedding gradients'
accumulation in embedding_grad.py. Measured by benchmarks/real_vs_eager.py.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .graph_util import Names, attribute, small_constants
from graphopt.onnx_ops import ALIAS_OPS, STANDARD_DOMAINS


def _readers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def _splice(graph: onnx.GraphProto, nodes: list, before: dict[int, list], dead: set[int]) -> None:
    """Rewrite ``graph``'s nodes as ``nodes`` with ``before[id(n)]`` inserted ahead of each n and
    the nodes whose ids are in ``dead`` left out (the passes' edits, applied once)."""
    spliced = []
    for node in nodes:
        spliced.extend(before.get(id(node), []))
        if id(node) not in dead:
            spliced.append(node)
    graph.ClearField("node")
    graph.node.extend(spliced)


def _read_by_subgraphs(model: onnx.ModelProto) -> set[str]:
    """Every name a node's subgraph (Scan, Loop, If bodies) reads, at any depth: a conservative
    set of the outer names they capture."""
    names, stack = set(), [a for n in model.graph.node for a in n.attribute]
    while stack:
        attr = stack.pop()
        for graph in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else
                      list(attr.graphs) if attr.type == onnx.AttributeProto.GRAPHS else []):
            for node in graph.node:
                names.update(node.input)
                stack.extend(node.attribute)
            names.update(o.name for o in graph.output)
    return names


def pads_sum_to_concat(model: onnx.ModelProto, shapes: dict[str, list]) -> int:
    """In place; returns how many Sums became Concats. `shapes`: static shapes by name."""
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output if o}
    readers = _readers(model)
    constants = small_constants(model)
    outputs = {o.name for o in graph.output}
    replaced, dead = 0, set()
    for node in graph.node:
        if node.op_type not in ("Sum", "Add") or len(node.input) < 2:
            continue
        total = shapes.get(node.output[0])
        pieces = []
        for name in node.input:
            pad = producers.get(name)
            if pad is None or pad.op_type != "Pad" or len(readers.get(name, [])) != 1 or name in outputs:
                break
            if attribute(pad, "mode", b"constant") not in (b"constant", "constant"):
                break
            pads = constants.get(pad.input[1]) if len(pad.input) > 1 else None
            value = constants.get(pad.input[2]) if len(pad.input) > 2 and pad.input[2] else np.zeros(())
            if pads is None or total is None or np.any(value != 0) or (len(pad.input) > 3 and pad.input[3]):
                break
            rank = len(total)
            begins, ends = pads[:rank], pads[rank:]
            axes = [a for a in range(rank) if begins[a] or ends[a]]
            if len(axes) != 1 or np.any(pads < 0):
                break
            axis = axes[0]
            pieces.append((axis, int(begins[axis]), int(total[axis] - ends[axis]), pad))
        else:
            axis_set = {p[0] for p in pieces}
            if len(axis_set) != 1:
                continue
            pieces.sort(key=lambda p: p[1])
            position = 0
            for _, begin, end, _ in pieces:
                if begin != position:
                    break
                position = end
            else:
                if position != total[pieces[0][0]]:
                    continue
                axis = pieces[0][0]
                concat = helper.make_node("Concat", [p[3].input[0] for p in pieces], list(node.output),
                                          name=node.name, axis=axis)
                node.CopyFrom(concat)
                dead.update(id(p[3]) for p in pieces)
                replaced += 1
    if dead:
        kept = [n for n in graph.node if id(n) not in dead]
        graph.ClearField("node")
        graph.node.extend(kept)
    return replaced


def _gelu_patterns(model: onnx.ModelProto):
    """(x, div, erf, add) nodes of exact GELUs: Mul(Mul(x, Add(Erf(Div(x, sqrt 2)), 1)), 0.5)."""
    producers = {o: n for n in model.graph.node for o in n.output if o}
    constants = small_constants(model)
    for node in model.graph.node:
        if node.op_type != "Erf":
            continue
        div = producers.get(node.input[0])
        if div is None or div.op_type != "Div" or div.input[1] not in constants \
                or not np.allclose(constants[div.input[1]], np.sqrt(2.0), rtol=1e-6):
            continue
        adds = [n for n in model.graph.node if n.op_type == "Add" and node.output[0] in n.input]
        if len(adds) != 1:
            continue
        add = adds[0]
        other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
        if other not in constants or not np.allclose(constants[other], 1.0):
            continue
        yield div.input[0], div, node, add


def _silu_patterns(model: onnx.ModelProto):
    """(x, sigmoid) of SiLUs / Swishes: Mul(x, Sigmoid(x)), either operand order."""
    producers = {o: n for n in model.graph.node for o in n.output if o}
    seen = set()
    for node in model.graph.node:
        if node.op_type != "Mul" or len(node.input) != 2:
            continue
        for k in (0, 1):
            sigmoid = producers.get(node.input[k])
            if sigmoid is not None and sigmoid.op_type == "Sigmoid" \
                    and sigmoid.input[0] == node.input[1 - k] and id(sigmoid) not in seen:
                seen.add(id(sigmoid))
                yield sigmoid.input[0], sigmoid
                break


def recompute_gelu_intermediates(model: onnx.ModelProto, backward: set[str]) -> int:
    """In place; `backward` holds the names of the backward nodes. Returns the activations
    changed: exact GELUs (their Div, Erf and Add outputs) and SiLUs / Swishes, x * Sigmoid(x)
    (the Sigmoid's output: reverse mode reads it for both the product's and the sigmoid's
    derivative, a tensor the size of x kept through the backward where PyTorch's silu keeps x
    alone). The backward gets its own copies, recomputed from x right before their first
    backward reader."""
    groups = [[div, erf, add] for _, div, erf, add in _gelu_patterns(model)]
    groups += [[sigmoid] for _, sigmoid in _silu_patterns(model)]
    graph = model.graph
    taken = {o for n in graph.node for o in n.output} | {n.name for n in graph.node}
    clones_before: dict[int, list] = {}
    changed = 0
    node_list = list(graph.node)
    position = {id(n): k for k, n in enumerate(node_list)}
    for group in groups:
        stashed = [(n, n.output[0]) for n in group]
        readers = [r for r in node_list if r.name in backward
                   and any(name in r.input for _, name in stashed)]
        if not readers:
            continue
        first = min(readers, key=lambda r: position[id(r)])
        renamed = {}
        clones = []
        for original, name in stashed:
            fresh = f"{name}__backward"
            while fresh in taken:
                fresh += "_"
            taken.add(fresh)
            clone = onnx.NodeProto()
            clone.CopyFrom(original)
            clone.name = f"{original.name}__backward"
            clone.input[:] = [renamed.get(i, i) for i in clone.input]
            clone.output[0] = fresh
            renamed[name] = fresh
            clones.append(clone)
        for reader in readers:
            reader.input[:] = [renamed.get(i, i) for i in reader.input]
        clones_before.setdefault(id(first), []).extend(clones)
        changed += 1
    if changed:
        nodes = []
        for node in node_list:
            nodes.extend(clones_before.get(id(node), []))
            nodes.append(node)
        graph.ClearField("node")
        graph.node.extend(nodes)
    return changed


def _squeezed(shape):
    return None if shape is None or None in shape else [d for d in shape if d != 1]


def _matrix(shape):
    """The matrix a MatMul reads or writes: ``shape`` itself when 2-D, its last two axes when
    every axis before them is 1; None otherwise (a real batch, or an unknown size)."""
    if shape is None or None in shape or len(shape) < 2 or any(d != 1 for d in shape[:-2]):
        return None
    return list(shape[-2:])


def transposed_products(model: onnx.ModelProto, shapes: dict[str, list]) -> int:
    """Transpose(A @ B) -> B^T @ A^T as one Gemm, for 2-D products or a batch of one (through reshapes that
    only add or drop size-1 axes): the product is written transposed, where reverse mode
    makes it and then a transposed copy (a weight's gradient through a transposed weight, as a
    tied language-model head reads its embedding: two vocabulary-sized tables, one would do).
    In place; `shapes`: static shapes by name. Returns how many Transposes went."""
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output if o}
    readers = _readers(model)
    outputs = {o.name for o in graph.output}
    names = {n.name for n in graph.node} | {o for n in graph.node for o in n.output}
    replaced, dead, before = 0, set(), {}
    nodes = list(graph.node)
    for node in nodes:
        if node.op_type != "Transpose":
            continue
        in_shape, out_shape = shapes.get(node.input[0]), shapes.get(node.output[0])
        if in_shape is None or out_shape is None or None in in_shape or None in out_shape:
            continue
        perm = list(attribute(node, "perm", list(reversed(range(len(in_shape))))))
        kept = [axis for axis in perm if in_shape[axis] != 1]
        if len(kept) != 2 or kept[0] < kept[1]:
            continue
        chain, source = [], node.input[0]
        while True:
            producer = producers.get(source)
            if producer is None or source in outputs or len(readers.get(source, [])) != 1:
                producer = None
                break
            if producer.op_type in ALIAS_OPS and _squeezed(shapes.get(producer.input[0])) == _squeezed(in_shape):
                chain.append(producer)
                source = producer.input[0]
                continue
            break
        if producer is None or producer.op_type not in ("Gemm", "MatMul") or len(producer.input) > 2 \
                and producer.input[2]:
            continue
        a, b = producer.input[0], producer.input[1]
        ma, mb = _matrix(shapes.get(a)), _matrix(shapes.get(b))
        if ma is None or mb is None or _matrix(shapes.get(source)) is None:
            continue
        operands = []       # a 3-D operand with a leading 1 (a batch of one) is read as a matrix
        for operand, matrix in ((b, mb), (a, ma)):
            if len(shapes[operand]) == 2:
                operands.append(operand)
                continue
            matrix_name, matrix_shape = operand + "__matrix", operand + "__matrix_shape"
            while matrix_name in names or matrix_shape in names:
                matrix_name, matrix_shape = matrix_name + "_", matrix_shape + "_"
            names.update((matrix_name, matrix_shape))
            graph.initializer.append(onnx.numpy_helper.from_array(np.array(matrix, np.int64), matrix_shape))
            before.setdefault(id(node), []).append(helper.make_node(
                "Reshape", [operand, matrix_shape], [matrix_name], name=matrix_name))
            operands.append(matrix_name)
        ta, tb = (attribute(producer, "transA", 0), attribute(producer, "transB", 0)) \
            if producer.op_type == "Gemm" else (0, 0)
        alpha = attribute(producer, "alpha", 1.0) if producer.op_type == "Gemm" else 1.0
        product = producer.output[0] + "__transposed"
        while product in names:
            product += "_"
        names.add(product)
        gemm = helper.make_node("Gemm", operands, [product], name=producer.name + "__transposed",
                                transA=1 - tb, transB=1 - ta, alpha=alpha)
        shape_name = node.output[0] + "__shape"
        while shape_name in names:
            shape_name += "_"
        names.add(shape_name)
        graph.initializer.append(onnx.numpy_helper.from_array(np.array(out_shape, np.int64), shape_name))
        reshape = helper.make_node("Reshape", [product, shape_name], list(node.output), name=node.name)
        node.CopyFrom(reshape)
        before.setdefault(id(node), []).append(gemm)
        dead.update(id(n) for n in chain + [producer])
        replaced += 1
    if replaced:
        _splice(graph, nodes, before, dead)
    return replaced


_ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Sum", "Neg", "Relu", "Tanh", "Sigmoid", "Exp", "Where")


def outputs_written_in_place(model: onnx.ModelProto, shapes: dict[str, list]) -> int:
    """A graph output that is a reshape of an intermediate is a copy in ONNX Runtime (measured:
    Gather -> Reshape -> output peaks at two tables, Gather -> output at one): gradients come
    out of reverse mode with a trailing seed axis and are reshaped to the parameter's shape, so
    each gradient was allocated twice at its end. The producer writes the output itself: renamed
    when the shapes agree, else its inputs reshaped instead (row Gathers and ScatterElements
    along axis 0 whose rows keep their length, elementwise ops without broadcasting). In place;
    returns how many outputs changed."""
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output if o}
    readers = _readers(model)
    outputs = {o.name for o in graph.output}
    declared = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    taken = {n.name for n in graph.node} | {o for n in graph.node for o in n.output} | declared
    changed, dead, before = 0, set(), {}

    def fresh(stem):
        name = stem
        while name in taken:
            name += "_"
        taken.add(name)
        return name

    def static(name):
        shape = shapes.get(name)
        return None if shape is None or None in shape else list(shape)

    for alias in list(graph.node):
        if alias.op_type not in ALIAS_OPS or alias.output[0] not in outputs:
            continue
        source, target = alias.input[0], alias.output[0]
        producer = producers.get(source)
        if producer is None or producer.op_type in ALIAS_OPS or source in outputs or source in declared \
                or len(readers.get(source, [])) != 1 or len(producer.output) != 1:
            continue
        have, want = static(source), static(target)
        if have is None or want is None or int(np.prod(have)) != int(np.prod(want)):
            continue
        reshaped = []     # (input slot, new shape)
        if have != want:
            op = producer.op_type
            if op == "Gather" and attribute(producer, "axis", 0) == 0 and static(producer.input[1]) is not None \
                    and len(static(producer.input[1])) == 1 and want[0] == have[0] and static(producer.input[0]):
                reshaped = [(0, [static(producer.input[0])[0]] + want[1:])]
            elif op == "ScatterElements" and attribute(producer, "axis", 0) == 0 and want[0] == have[0] \
                    and all(static(producer.input[k]) is not None and static(producer.input[k])[1:] == have[1:]
                            for k in (1, 2)):
                reshaped = [(0, want)] + [(k, [static(producer.input[k])[0]] + want[1:]) for k in (1, 2)]
            elif op in _ELEMENTWISE and all(static(i) == have for i in producer.input if op != "Where") \
                    and (op != "Where" or all(static(i) == have for i in producer.input)):
                reshaped = [(k, want) for k in range(len(producer.input))]
            else:
                continue
        for slot, shape in reshaped:
            shape_name = fresh(f"{target}__in{slot}_shape")
            graph.initializer.append(onnx.numpy_helper.from_array(np.array(shape, np.int64), shape_name))
            value = fresh(f"{target}__in{slot}")
            before.setdefault(id(producer), []).append(helper.make_node(
                "Reshape", [producer.input[slot], shape_name], [value], name=fresh(f"{producer.name}/reshape_in{slot}")))
            producer.input[slot] = value
        producer.output[0] = target
        dead.add(id(alias))
        changed += 1
    if changed:
        _splice(graph, list(graph.node), before, dead)
    return changed


def loss_first(model: onnx.ModelProto, loss: str) -> int:
    """Move the nodes only the loss needs (cross entropy's GatherElements, mean, Neg) to the end
    of the file. ONNX Runtime's default order walks back from the graph's leaves, the last
    node's first, so the loss is then computed right after the forward, not after the whole
    backward with the log-probabilities (a logits-sized tensor) kept alive for it. In place;
    returns how many nodes moved."""
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output if o}
    others = set()
    stack = [o.name for o in graph.output if o.name != loss]
    while stack:
        node = producers.get(stack.pop())
        if node is None or id(node) in others:
            continue
        others.add(id(node))
        stack.extend(i for i in node.input if i)
    only = set()
    stack = [loss]
    while stack:
        node = producers.get(stack.pop())
        if node is None or id(node) in others or id(node) in only:
            continue
        only.add(id(node))
        stack.extend(i for i in node.input if i)
    if not only:
        return 0
    nodes = [n for n in graph.node if id(n) not in only] + [n for n in graph.node if id(n) in only]
    graph.ClearField("node")
    graph.node.extend(nodes)
    return len(only)


def gradients_early(model: onnx.ModelProto, sources: set[str]) -> int:
    """Put the nodes that produce gradient outputs (leaves: read by no node) from `sources`
    (or reshapes of them) last in the file, in reverse order. ONNX Runtime's default order walks
    back from the leaves, the last one's first, so such a gradient is computed as soon as
    `sources` exist, not after the whole backward with them kept alive for it. Measured: a
    language model's head weight gradient, reading the logits' gradient (a [tokens, vocabulary]
    tensor), ran last (Llama full: 183.4 -> 172.4 MiB). Only for the given sources: moving every
    gradient leaf this way reorders the whole backward (measured worse: BERT 425 -> 654 MiB).
    In place; returns how many nodes moved."""
    graph = model.graph
    every = list(graph.node)
    near = set(sources)
    for node in every:
        if node.op_type in ALIAS_OPS and node.input and node.input[0] in near:
            near.update(node.output)
    read = {name for node in every for name in node.input}
    wanted = {o.name for o in graph.output}
    leaves = [k for k, n in enumerate(every) if n.output and near.intersection(n.input)
              and all(o in wanted and o not in read for o in n.output if o)]
    if not leaves:
        return 0
    moved = set(leaves)
    nodes = [n for k, n in enumerate(every) if k not in moved] + [every[k] for k in reversed(leaves)]
    graph.ClearField("node")
    graph.node.extend(nodes)
    return len(leaves)


def transposed_weights_into_gemm(model: onnx.ModelProto, shapes: dict[str, list]) -> int:
    """MatMul(A, Transpose(W)) of a 2-D W (a Linear layer on a sequence as exporters write it)
    -> Gemm(A rows, W, transB=1), reshaped back: the Transpose made a weight-sized copy that
    ONNX Runtime's default order computes as soon as the walk reaches its MatMul's producers,
    the highest index first, i.e. before the whole forward that leads to the MatMul's other
    operand, so every layer's transposed weight was alive from the start (Swin-T: about 60 MiB
    at its peak). Gemm reads W in place. Only when every reader of the Transpose is such a
    MatMul (the backward reads W itself once cleanup composed Transpose(Transpose(W))). In
    place; `shapes`: static shapes by name. Returns how many Transposes went."""
    graph = model.graph
    every = list(graph.node)
    readers: dict[str, list] = {}
    for n in every:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    outputs = {o.name for o in graph.output} | _read_by_subgraphs(model)
    names = Names(model)
    replaced, dead, before = 0, set(), {}

    def static(name):
        shape = shapes.get(name)
        return None if shape is None or None in shape else list(shape)

    for node in every:
        if node.op_type != "Transpose" or node.domain not in STANDARD_DOMAINS:
            continue
        w_shape = static(node.input[0])
        if w_shape is None or len(w_shape) != 2 or list(attribute(node, "perm", [1, 0])) != [1, 0]:
            continue
        matmuls = readers.get(node.output[0], [])
        if not matmuls or node.output[0] in outputs or not all(
                r.op_type == "MatMul" and r.domain in STANDARD_DOMAINS and list(r.input).count(node.output[0]) == 1
                and r.input[1] == node.output[0] and static(r.input[0]) is not None
                and len(static(r.input[0])) >= 2 and static(r.output[0]) is not None for r in matmuls):
            continue
        k = w_shape[1]
        for matmul in matmuls:
            a, a_shape, out_shape = matmul.input[0], static(matmul.input[0]), static(matmul.output[0])
            added = []
            if len(a_shape) > 2:
                rows_shape = names.fresh(matmul.name + "/rows_shape")
                graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1, k], np.int64), rows_shape))
                rows = names.fresh(a + "__rows")
                added.append(helper.make_node("Reshape", [a, rows_shape], [rows], name=names.fresh(matmul.name + "/rows")))
                a = rows
            if len(out_shape) > 2:
                product = names.fresh(matmul.output[0] + "__rows")
                added.append(helper.make_node("Gemm", [a, node.input[0]], [product], transB=1, name=matmul.name))
                shape_name = names.fresh(matmul.name + "/out_shape")
                graph.initializer.append(onnx.numpy_helper.from_array(np.array(out_shape, np.int64), shape_name))
                matmul.CopyFrom(helper.make_node("Reshape", [product, shape_name], list(matmul.output),
                                                 name=names.fresh(matmul.name + "/rows_back")))
            else:
                matmul.CopyFrom(helper.make_node("Gemm", [a, node.input[0]], list(matmul.output), transB=1,
                                                 name=matmul.name))
            before[id(matmul)] = added
        dead.add(id(node))
        replaced += 1
    if replaced:
        _splice(graph, every, before, dead)
    return replaced


def masks_as_products(model: onnx.ModelProto, loss: str) -> int:
    """Where(mask, g, zero) -> Mul(g, Cast(mask)) and Where(mask, zero, g) -> Mul(g, Cast(Not(mask)))
    where `zero` is a constant of zeros with one element (the module docstring says why), in the
    backward only (what the `loss` does not read: a forward Where may mask out infinities, such
    as attention scores, which a product would turn into NaN). In place; returns how many Where
    nodes went."""
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output if o}
    forward, stack = set(), [loss]
    while stack:
        name = stack.pop()
        if name in forward:
            continue
        forward.add(name)
        producer = producers.get(name)
        if producer is not None:
            stack.extend(i for i in producer.input if i)
    constants = small_constants(model, max_elements=1)
    names = Names(model)
    replaced, dead, before = 0, set(), {}
    for node in graph.node:
        if node.op_type != "Where" or node.domain not in STANDARD_DOMAINS or len(node.input) != 3 \
                or node.output[0] in forward:
            continue
        zero_at = [k for k in (1, 2) if node.input[k] in constants and constants[node.input[k]].size == 1
                   and not np.any(constants[node.input[k]]) and constants[node.input[k]].dtype.kind == "f"]
        if len(zero_at) != 1:
            continue
        zero = constants[node.input[zero_at[0]]]
        mask = node.input[0]
        added = []
        if zero_at[0] == 1:   # Where(mask, 0, g): g where the mask is false
            negated = names.fresh(mask + "_not")
            added.append(helper.make_node("Not", [mask], [negated], name=names.fresh(node.name + "_not")))
            mask = negated
        as_float = names.fresh(mask + "_as_float")
        added.append(helper.make_node("Cast", [mask], [as_float], name=names.fresh(node.name + "_cast"),
                                      to=helper.np_dtype_to_tensor_dtype(zero.dtype)))
        kept = node.input[3 - zero_at[0]]
        # the zero's shape may add leading axes of 1 to the output: Where broadcast all three
        product = node.output[0] if zero.ndim == 0 else names.fresh(node.output[0] + "_product")
        added.append(helper.make_node("Mul", [kept, as_float], [product], name=names.fresh(node.name + "_mul")))
        if zero.ndim:
            added.append(helper.make_node("Add", [product, node.input[zero_at[0]]], [node.output[0]],
                                          name=names.fresh(node.name + "_shaped")))
        before[id(node)] = added
        dead.add(id(node))
        replaced += 1
    if replaced:
        _splice(graph, list(graph.node), before, dead)
    return replaced


# False: n-ary Sums of gradient contributions stay as onnx-ad writes them (for comparisons)
SUMS_AS_PRODUCED = True


def sums_as_produced(model: onnx.ModelProto, forward: set[str] = frozenset()) -> int:
    """An n-ary Sum (3 or more inputs: a parameter's gradient contributions, one per use: ALBERT's
    shared layers, tied embeddings) -> a chain of Adds in the order the contributions are made,
    each written right after the newer of its inputs, so that each contribution is added as it is
    produced and freed, as PyTorch accumulates `.grad`, instead of all of them held to one Sum at
    the end. A contribution that is a view (Reshape, ...) of a tensor made earlier is moved up to
    right after it. Sums writing a value of `forward` (the model's own, before differentiation)
    stay. In place; returns how many Sums were chained."""
    if not SUMS_AS_PRODUCED:
        return 0
    graph = model.graph
    nodes = list(graph.node)
    available: dict[str, int] = {i.name: -1 for i in graph.input}
    available.update({t.name: -1 for t in graph.initializer})
    names = Names(model)
    chained = 0
    k = 0
    while k < len(nodes):
        node = nodes[k]
        inputs = [i for i in node.input if i]
        if not (node.op_type == "Sum" and node.domain in STANDARD_DOMAINS and len(inputs) >= 3
                and len(set(inputs)) == len(inputs) and node.output[0] not in forward):
            k += 1
            continue
        position = {n_out: j for j, n in enumerate(nodes) for n_out in n.output if n_out}
        # a contribution that is a view of an earlier tensor moves up to right after that tensor
        for name in inputs:
            at = position.get(name)
            if at is None:
                continue
            view = nodes[at]
            if view.op_type not in ALIAS_OPS or view.domain not in STANDARD_DOMAINS or len(view.output) != 1:
                continue
            ready = max((position.get(i, available.get(i, -1)) for i in view.input if i), default=-1)
            if ready + 1 < at:
                nodes.insert(ready + 1, nodes.pop(at))
                position = {n_out: j for j, n in enumerate(nodes) for n_out in n.output if n_out}
        k = nodes.index(node)
        order = sorted(inputs, key=lambda name: position.get(name, available.get(name, -1)))
        del nodes[k]
        total = order[0]
        for j, name in enumerate(order[1:], start=1):
            out = node.output[0] if j == len(order) - 1 else names.fresh(f"{node.output[0]}__acc")
            add = helper.make_node("Add", [total, name], [out], name=names.fresh(f"{node.name or 'sum'}_add"))
            nodes.insert(_after_inputs(nodes, add), add)   # right after the newer of its inputs
            total = out
        chained += 1
        k = 0
    graph.ClearField("node")
    graph.node.extend(nodes)
    return chained


# False: the Sums left after `sums_as_produced` stay Sums (for comparisons)
SUMS_AS_ADDS = True


def sums_as_adds(model: onnx.ModelProto) -> int:
    """Every Sum left (of two gradient contributions, as onnx-ad writes them, or the model's own
    n-ary Sums in the forward pass, which `sums_as_produced` leaves) -> Adds of its inputs in their
    order, in its place: the same additions in the same order (ONNX Runtime's Sum adds its inputs
    one after the other into its output), the same broadcasting. ONNX Runtime's CPU Sum runs on one
    thread where its Add is split over the intra-op pool: measured (onnxruntime 1.32, CPU,
    [16, 128, 32, 32] float) a Sum of two took 0.94 ms at one thread and 0.93 at two, an Add 0.92
    and 0.47; a Sum of three 1.79 at both, two Adds 1.78 and 0.95. In place; returns how many
    Sums were rewritten."""
    if not SUMS_AS_ADDS:
        return 0
    graph = model.graph
    names = Names(model)
    nodes, rewritten = [], 0
    for node in graph.node:
        inputs = list(node.input)
        if node.op_type != "Sum" or node.domain not in STANDARD_DOMAINS or len(inputs) < 2 or not all(inputs):
            nodes.append(node)
            continue
        total = inputs[0]
        for j, name in enumerate(inputs[1:], start=1):
            out = node.output[0] if j == len(inputs) - 1 else names.fresh(f"{node.output[0]}__acc")
            nodes.append(helper.make_node("Add", [total, name], [out],
                                          name=node.name if j == len(inputs) - 1 and node.name
                                          else names.fresh(f"{node.name or 'sum'}_add")))
            total = out
        rewritten += 1
    graph.ClearField("node")
    graph.node.extend(nodes)
    return rewritten


def _after_inputs(nodes: list, node: onnx.NodeProto) -> int:
    """The first position where every input of `node` made by `nodes` exists."""
    needed = {i for i in node.input if i}
    at = 0
    for j, other in enumerate(nodes):
        if needed.intersection(other.output):
            at = j + 1
    return at
