"""What graphopt knows about ONNX ops as ONNX Runtime runs them (aliasing, random, folded at
load, in-place statistics, kernel work buffers), and `build_cost_graph`: the typed cost graph
(`costgraph.CostGraph`, bytes and seconds) of an analyzed training graph and its measured
annotations. This is where ONNX knowledge ends: the solvers and the cost model see only that
graph."""
from __future__ import annotations

import math

import onnx
from onnx import defs

from .analyze import TrainingGraph, fed_back_outputs, implicit_inputs
from .costgraph import CostGraph, Op
from .runtime.measure import MMAP_THRESHOLD_BYTES
from .onnx_ops import ALIAS_OPS, STANDARD_DOMAINS

# Ops whose output 0 shares the buffer of input 0 in ONNX Runtime's CPU and CUDA providers.
# Ops that draw random numbers: never recomputed (their outputs are always checkpoints).
RANDOM_OPS = frozenset({"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform",
                        "RandomUniformLike", "Multinomial", "Bernoulli"})
# ScatterND's offset table: one uint64 per index tuple (scatter_nd.cc); see `workspace_bytes`.
SCATTER_ND_OFFSET_BYTES = 8
# Ops ONNX Runtime's priority-based order runs as soon as they are ready.
RUNS_FIRST_OPS = frozenset({"Shape", "Size"})
# Ops ONNX Runtime replaces by initializers when it loads a graph (onnxruntime/core/graph/
# graph.cc, at every optimization level): they never run, their outputs exist before the
# run starts and are not part of its peak. Measured on 1.32: a `Constant` node is absent
# from the profiled execution order.
FOLDED_AT_LOAD_OPS = frozenset({"Constant"})


# Allocation granularity of the CPU process that measures a peak (graphopt/runtime/measure.py):
# glibc with MALLOC_MMAP_THRESHOLD_ = MMAP_THRESHOLD_BYTES, peak = growth of resident pages.
PAGE_BYTES = 4096
# ORT's per-tensor heap objects: a traced step (malloc interposed, shufflenet_v2 and googlenet at
# full size) held 168 + 40 bytes of Tensor object and shape per live tensor, plus two 8-byte chunk
# headers; see `allocated_bytes`.
TENSOR_OBJECT_BYTES = 224
# posix_memalign(64, n): the chunk header plus the alignment's slack in front of the data
ALIGNED_CHUNK_OVERHEAD_BYTES = 80
# on the heap, memalign also splits off a leading remainder (up to 64 + 32 bytes) that only
# small requests can reuse
HEAP_SPLIT_BYTES = 96


def allocated_bytes(nbytes: int, provider: str | None = None) -> int:
    """Bytes of memory one tensor buffer of `nbytes` costs while it lives, on the CPU provider as
    graphopt measures it. ONNX Runtime's CPU allocator takes every buffer through
    ``posix_memalign(64, n)`` and keeps a Tensor object and its shape on the heap. Under the
    measuring process's allocator settings (`graphopt.runtime.measure`: mmap threshold 4 KiB),
    a buffer of 4 KiB or more is a mapping of its own, whose data plus header are whole 4 KiB
    pages; a smaller one is a heap chunk (16-byte granularity). Measured on 1.32
    (tests/test_cost_rules.py: one Split into n graph outputs, extra bytes per output beyond its
    own): 2000 x 64 B: +481 to +543, 2000 x 1 KiB: +436, 1000 x 3968 B: +370, 100 x 1 MiB: +4260 (one
    page and the Tensor object), 200 x 68 KiB: +4321. Between 4 and 64 KiB some buffers come
    from the free top of the heap instead (+950 to +2404 measured where this rule says +4320).
    Zero bytes (an absent tensor) cost nothing; on CUDA (a different allocator) the bytes are
    taken as they are."""
    if nbytes <= 0 or (provider is not None and provider != "CPUExecutionProvider"):
        return max(0, int(nbytes))
    if nbytes + ALIGNED_CHUNK_OVERHEAD_BYTES + 16 < MMAP_THRESHOLD_BYTES:
        return -(-(nbytes + ALIGNED_CHUNK_OVERHEAD_BYTES) // 16) * 16 + HEAP_SPLIT_BYTES + TENSOR_OBJECT_BYTES
    pages = -(-(nbytes + ALIGNED_CHUNK_OVERHEAD_BYTES) // PAGE_BYTES)
    return pages * PAGE_BYTES + TENSOR_OBJECT_BYTES


def _numel(shape) -> int | None:
    if shape is None or any(d is None or d < 0 for d in shape):
        return None
    return math.prod(shape)


def static_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Tensor shapes as ONNX shape inference sees them (None for an unknown dimension)."""
    from .builder.graph_util import infer_shapes
    try:
        inferred = infer_shapes(model, data_prop=True)   # on the graph without its weights: any size
    except Exception:
        inferred = model
    g = inferred.graph
    shapes: dict[str, list[int | None]] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
    for t in model.graph.initializer:
        shapes[t.name] = list(t.dims)
    return shapes


def _ints(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return list(a.ints) if a.type == onnx.AttributeProto.INTS else a.i
    return default


def workspace_bytes(node: onnx.NodeProto, shapes: dict, tensor_bytes: dict[str, int]) -> int:
    """Bytes a CPU kernel of ONNX Runtime allocates for itself while it runs (freed when it
    returns), for the kernels where that is a tensor-sized buffer. Each rule is ORT's code
    and was confirmed by measurement on 1.32 (peak of a one-node graph, arena off):

    - ``Sum`` with three or more inputs accumulates through one temporary of the output's
      size (2 inputs: none; Max/Min/Mean with 3 inputs: none). Measured: 3 inputs of
      16 MiB -> 32 MiB (output + temporary), 4 -> 96 MiB with inputs produced in-graph.
    - ``ConvTranspose`` builds its column buffer of (C_out/group) * prod(kernel) *
      prod(input spatial) elements (conv_transpose.cc). Measured: x 8x64x64x64, w 64x64x3x3:
      8 MiB output + 9 MiB column buffer.
    - ``Conv`` (MLAS, convolve.cpp MlasConvPrepare): a pointwise convolution (or one whose
      kernel spans the input's width) is a direct GEMM with no buffer; otherwise, when the
      filter count per group exceeds the output's spatial size, the whole im2col matrix is
      expanded: prod(output spatial) * (C/group) * prod(kernel) elements; else it works in
      small per-thread segments (counted as 0). Measured: a weight-gradient convolution
      x 64x8x66x66, w 64x8x64x64 -> 3x3 output: +1.1 MiB; a 3x3 convolution over 64x64
      images: no extra.
    - ``Where`` (where_op.cc) broadcasts in two passes: it allocates X_selection (the shape of
      condition broadcast with X) and Y_selection (condition with Y), both of X's dtype, and
      merges them into the output. Measured (tests/test_cost_rules.py, and traced in
      mobilenet_v2's ReLU6 gradient ``Where(cond, g, 0)``, 3 MiB output): output + 2 x 3 MiB.
    - ``ScatterND`` (scatter_nd.cc, ``Prepare::element_offsets``) computes one ``uint64`` offset
      per index tuple before it scatters: 8 bytes x prod(indices.shape[:-1]), from malloc.
      Measured (tests/test_cost_rules.py; traced in googlenet's backward, whose scatter-adds
      (``ScatterND(zeros, indices, g, reduction="add")``) held up to 1 MiB of offsets, one of
      them at the original's peak).
    """
    op_type = node.op_type
    if node.domain == "com.microsoft" and op_type == "FusedConv":
        op_type = "Conv"   # ORT's Conv+activation (runtime/offline.py): the same MLAS convolution
    elif node.domain not in STANDARD_DOMAINS:
        return 0
    outs = [t for t in node.output if t]
    if not outs:
        return 0
    if op_type == "Sum":
        return int(tensor_bytes.get(outs[0], 0)) if len([t for t in node.input if t]) >= 3 else 0
    if op_type == "Where" and len(node.input) == 3:
        return _where_selection_bytes(node, shapes, tensor_bytes)
    if op_type == "ScatterND" and len(node.input) >= 2:
        indices = shapes.get(node.input[1])
        slices = _numel(indices[:-1]) if indices else None
        return SCATTER_ND_OFFSET_BYTES * slices if slices else 0
    if op_type not in ("Conv", "ConvTranspose") or len(node.input) < 2:
        return 0
    x, w, y = shapes.get(node.input[0]), shapes.get(node.input[1]), shapes.get(outs[0])
    if x is None or w is None or y is None or None in x or None in w or None in y or len(x) < 3:
        return 0
    n_out = _numel(y)
    if not n_out:
        return 0
    elem = int(tensor_bytes.get(outs[0], 0)) // n_out or 4
    group = int(_ints(node, "group", 1)) or 1
    kernel = w[2:]
    if op_type == "ConvTranspose":
        c_out_per_group = w[1]  # weight: (C_in, C_out/group, k...)
        return elem * c_out_per_group * math.prod(kernel) * math.prod(x[2:])
    # Conv: weight (M, C/group, k...)
    dims = len(kernel)
    strides = _ints(node, "strides", [1] * dims)
    pads = _ints(node, "pads", [0] * (2 * dims))
    dilations = _ints(node, "dilations", [1] * dims)
    auto_pad = next((a.s for a in node.attribute if a.name == "auto_pad"), b"NOTSET")
    ones = all(s == 1 for s in strides) and all(d == 1 for d in dilations)
    no_pad = all(p == 0 for p in pads) and auto_pad in (b"NOTSET", b"VALID")
    if ones and no_pad:
        if math.prod(kernel) == 1:
            return 0
        if dims == 2 and (kernel[1] == x[3] or (kernel[0] == x[2] and kernel[1] == 1)):
            return 0
    filters_per_group = w[0] // group
    output_size = math.prod(y[2:])
    if filters_per_group > output_size:
        return elem * output_size * w[1] * math.prod(kernel)
    return 0


def _broadcast(a: list, b: list) -> list | None:
    rank = max(len(a), len(b))
    a, b = [1] * (rank - len(a)) + list(a), [1] * (rank - len(b)) + list(b)
    if any(d is None for d in a + b):
        return None
    return [max(x, y) if 1 in (x, y) or x == y else None for x, y in zip(a, b)]


def _where_selection_bytes(node: onnx.NodeProto, shapes: dict, tensor_bytes: dict[str, int]) -> int:
    """Bytes of Where's X_selection and Y_selection buffers (see `workspace_bytes`)."""
    cond, x, y, out = shapes.get(node.input[0]), shapes.get(node.input[1]), shapes.get(node.input[2]), \
        shapes.get(node.output[0])
    if cond is None or x is None or y is None or out is None:
        return 0
    n_out = _numel(out)
    if not n_out:
        return 0
    elem = int(tensor_bytes.get(node.output[0], 0)) // n_out
    total = 0
    for value in (x, y):
        selection = _broadcast(cond, value)
        if selection is None or None in selection:
            return 0
        total += elem * math.prod(selection)
    return total


def is_alias(node: onnx.NodeProto, graph_outputs: frozenset | set = frozenset()) -> bool:
    """Output 0 shares input 0's buffer (Reshape, Identity, Squeeze, Unsqueeze, Flatten),
    unless output 0 is a graph output: ONNX Runtime's allocation planner gives a graph output a
    buffer of its own, and the kernel copies into it (the input is freed after its last reader).
    Measured on 1.32 (tests/test_cost_rules.py; traced in mobilenet_v2's backward, where each
    weight gradient ``Reshape`` to a graph output held input + output while it ran, then the
    output alone)."""
    if not (node.domain in STANDARD_DOMAINS and node.op_type in ALIAS_OPS):
        return False
    return not (node.output and node.output[0] in graph_outputs)


def is_random(node: onnx.NodeProto) -> bool:
    """Random ops, and ops with subgraphs (their bodies are not looked into)."""
    has_subgraph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                       for a in node.attribute)
    return node.op_type in RANDOM_OPS or has_subgraph


# Ops whose optional outputs go together: ONNX Runtime takes BatchNormalization with 1 or
# 3 outputs (training mode writes both running statistics), never 2.
ALL_OR_NOTHING_OUTPUTS = frozenset({"BatchNormalization"})


def optional_output_positions(node: onnx.NodeProto, opset: int) -> set[int]:
    """Positions of outputs that the op's schema declares optional (may be left unnamed)."""
    if node.op_type in ALL_OR_NOTHING_OUTPUTS:
        return set()
    try:
        schema = defs.get_schema(node.op_type, opset, node.domain)
    except Exception:
        return set()
    positions = set()
    for k, formal in enumerate(schema.outputs):
        if formal.option == defs.OpSchema.FormalParameterOption.Optional:
            positions.add(k)
    return positions


def clobbered_inputs(node: onnx.NodeProto) -> tuple[str, ...]:
    """Inputs whose buffers ONNX Runtime overwrites with an output (its kernel declares them
    aliased): a training-mode BatchNormalization writes the updated running statistics into
    the buffers of its statistics inputs (3 and 4). Read after the op, such a tensor holds the
    updated values, so no plan may keep it for a later reader (a recomputed clone)."""
    if node.domain in STANDARD_DOMAINS and node.op_type == "BatchNormalization":
        training = next((a.i for a in node.attribute if a.name == "training_mode"), 0)
        if training:
            return tuple(t for t in node.input[3:5] if t)
    return ()


def opset_of(model: onnx.ModelProto, domain: str = "") -> int:
    for imp in model.opset_import:
        if imp.domain in (domain, "ai.onnx" if domain == "" else domain):
            return imp.version
    return onnx.defs.onnx_opset_version()


# A recomputed copy of a node costs this many times the node's profiled seconds (the time
# stage's: graphopt's plan without recomputation, profiled at the threads the plan is timed at),
# by ONNX Runtime's intra-op threads. Fitted by `python benchmarks/time_model.py` on the six
# examples' plans (least squares on the relative error of the predicted step; plans within
# max overheads 0.1, 0.25, 0.5 and the least peak), on this 2-core machine: 1.06 and 0.91 in two
# runs at one thread (1.05 fitted on seven corpus models instead), 0.66, 0.61 and 0.61 in three
# runs at two threads (0.40 and 0.54 on the corpus models): at two threads a copy costs less than
# its node's profiled seconds (why is not established). More threads than two were not measured
# here: they take two's.
RECOMPUTE_FACTORS = {1: 1.05, 2: 0.63}
RECOMPUTE_FACTOR = RECOMPUTE_FACTORS[1]


def at_threads(table: dict[int, float], threads: int) -> float:
    """`table`'s value (thread count -> value measured at it) at `threads`: the value of the
    largest count measured that is not above it (beyond the largest, the largest's)."""
    return table[max(t for t in table if t <= max(min(table), int(threads)))]


def recompute_factor(threads: int) -> float:
    """The factor of a recomputed copy's seconds at `threads` intra-op threads (RECOMPUTE_FACTORS)."""
    return at_threads(RECOMPUTE_FACTORS, threads)


def build_cost_graph(training: TrainingGraph, tensor_bytes: dict[str, int],
                     node_seconds: dict[str, float],
                     tensor_shapes: dict[str, list[int]] | None = None,
                     provider: str | None = None,
                     recompute_factor: float = RECOMPUTE_FACTOR) -> CostGraph:
    """The cost graph of `training`: one op per forward/backward node (see costmodel).

    `tensor_shapes` (measured, e.g. ``Annotations.tensor_shapes``) sizes the kernels'
    work buffers; without it, ONNX shape inference does (unknown shapes count 0). The graph's
    tensor bytes are what each buffer costs once allocated (`allocated_bytes`, CPU unless
    `provider` names another)."""
    model = training.model
    nodes = training.nodes
    opset = opset_of(model)
    shapes = static_shapes(model)
    if tensor_shapes:
        shapes.update({k: list(v) for k, v in tensor_shapes.items()})
    outputs = {o.name for o in model.graph.output}
    droppable = set()
    ops = {}
    # tensors a subgraph reads from the outer scope are inputs of its node; their producers are
    # never recomputed (a body reads the tensor by its name, which a recomputed copy does not have)
    implicit = {name: implicit_inputs(nodes[name]) for name in training.forward + training.backward}
    implicitly_read = {t for names in implicit.values() for t in names}
    for name in training.forward + training.backward:
        node = nodes[name]
        clobbers = clobbered_inputs(node)
        # overwriting a resident tensor (an initializer, a graph input), a clone would read
        # the updated values: such an op is never recomputed
        overwrites_resident = any(t in training.resident for t in clobbers)
        optional = optional_output_positions(node, opset)
        for k, t in enumerate(node.output):
            if t and k in optional and t not in outputs and k > 0:
                droppable.add(t)
        folded = node.domain in STANDARD_DOMAINS and node.op_type in FOLDED_AT_LOAD_OPS
        ops[name] = Op(
            name=name,
            op_type=node.op_type,
            inputs=tuple(t for t in node.input if t) + implicit[name],
            outputs=tuple(t for t in node.output if t),
            seconds=float(node_seconds.get(name, 0.0)),
            alias=is_alias(node, outputs),
            recomputable=(not is_random(node) and not folded and not overwrites_resident
                          and not any(t in implicitly_read for t in node.output)),
            runs_first=node.op_type in RUNS_FIRST_OPS,
            folded=folded,
            clobbers=clobbers,
            workspace_bytes=0 if folded else workspace_bytes(node, shapes, tensor_bytes),
        )
    allocated = {t: allocated_bytes(int(b), provider) for t, b in tensor_bytes.items()}
    return CostGraph([ops[n] for n in training.forward], [ops[n] for n in training.backward],
                     allocated, resident=training.resident, kept=outputs, droppable=droppable,
                     recompute_factor=recompute_factor, bound=fed_back_outputs(model))
