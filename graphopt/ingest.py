"""Ingest: load a model safely (limits, versions the installed ONNX Runtime reads, external data
confined to the model's folder) and give every node a unique name so that profiles and plans can
refer to nodes."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from .errors import InvalidModelError, LimitExceededError

# Domains whose operators ONNX Runtime's stock CPU/CUDA builds implement (com.microsoft.nchwc: the
# blocked-layout convolutions of its CPU provider, which the builder writes: builder/blocked_convs.py)
KNOWN_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc"})


def _external_tensors(model: onnx.ModelProto):
    yield from (t for t in model.graph.initializer if uses_external_data(t))
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.HasField("t") and uses_external_data(attr.t):
                yield attr.t


def check_external_data(model: onnx.ModelProto, base_dir: str | os.PathLike) -> None:
    """Every external-data location must be a relative path inside `base_dir`."""
    base = Path(base_dir).resolve()
    for tensor in _external_tensors(model):
        location = ExternalDataInfo(tensor).location
        if not location:
            raise InvalidModelError(f"initializer {tensor.name!r}: external data without a location")
        if os.path.isabs(location):
            raise InvalidModelError(
                f"initializer {tensor.name!r}: external data location {location!r} is absolute; "
                "it must be relative to the model's folder")
        target = (base / location).resolve()
        if base != target and base not in target.parents:
            raise InvalidModelError(
                f"initializer {tensor.name!r}: external data location {location!r} points outside "
                f"the model's folder {str(base)!r}")
        if not target.is_file():
            raise InvalidModelError(
                f"initializer {tensor.name!r}: external data file {location!r} does not exist")


# the operator set paired with an IR version when only the IR version is probed: ai.onnx 1, which
# every ONNX Runtime reads
_ANY_OPSET = (("", 1),)


@functools.lru_cache(maxsize=None)
def _onnxruntime_loads(ir_version: int, opsets: tuple) -> str | None:
    """None where the installed ONNX Runtime loads a model of this IR version importing these
    (domain, version) operator sets (a graph of no node, its input its output, read on the CPU
    provider), else its reason, the first line of its error."""
    import onnxruntime as ort

    from .runtime.session import LOAD_ERRORS
    graph = onnx.helper.make_graph([], "versions", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])])
    probe = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets])
    probe.ir_version = ir_version
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except LOAD_ERRORS as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


def _highest(loads, above: int) -> int | None:
    """The highest version below `above` that `loads` (a version -> bool that holds up to some
    version and not above it), by bisection; None when not even 0 does."""
    if not loads(0):
        return None
    low, high = 0, above
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if loads(middle) else (low, middle)
    return low


def check_versions(model: onnx.ModelProto) -> None:
    """Refuse a model whose IR version or operator sets the installed ONNX Runtime cannot load,
    naming the model's version and the highest ONNX Runtime supports, before any work starts (it
    would otherwise fail in the first child process that opens it). What ONNX Runtime supports
    is asked of it: it loads a graph of no node carrying the model's versions (`_onnxruntime_loads`,
    once per distinct set of versions in a process), and where it refuses, the highest it
    loads is found by bisection. (onnxruntime's Python API does not state its highest IR
    version, and the onnx package's `IR_VERSION` is that of the onnx installed beside it, which
    need not be the one ONNX Runtime was built with.)"""
    import onnxruntime as ort
    ir_version = int(model.ir_version)
    opsets = tuple(sorted((o.domain, int(o.version)) for o in model.opset_import))
    why = _onnxruntime_loads(ir_version, opsets)
    if why is None:
        return
    installed = f"the installed onnxruntime {ort.__version__}"
    if _onnxruntime_loads(ir_version, _ANY_OPSET) is not None:
        top = _highest(lambda v: _onnxruntime_loads(v, _ANY_OPSET) is None, ir_version)
        raise InvalidModelError(f"the model's IR version is {ir_version}, newer than {installed} reads "
                                f"(IR versions up to {top})")
    for domain, version in opsets:
        if _onnxruntime_loads(ir_version, ((domain, version),)) is not None:
            top = _highest(lambda v: _onnxruntime_loads(ir_version, ((domain, v),)) is None, version)
            raise InvalidModelError(
                f"the model imports operator set {domain or 'ai.onnx'!r} version {version}, newer than "
                f"{installed} supports ({'none' if top is None else f'versions up to {top}'})")
    imported = ", ".join(f"{domain or 'ai.onnx'!r} {version}" for domain, version in opsets)
    raise InvalidModelError(f"{installed} cannot load a model of IR version {ir_version} importing operator "
                            f"sets {imported}: {why}")


def check_blocked_layout(model: onnx.ModelProto) -> None:
    """Refuse a graph whose convolutions graphopt's builder wrote in ONNX Runtime's blocked layout
    for another channel block than this machine's (builder/blocked_convs.py: its metadata records
    the block), naming both, before any work starts (its first run would fail at the block check)."""
    from .builder.blocked_convs import BLOCK_KEY, NCHWC_DOMAIN, block_size
    written = next((p.value for p in model.metadata_props if p.key == BLOCK_KEY), None)
    if written is None or not any(n.domain == NCHWC_DOMAIN for n in model.graph.node):
        return
    here = block_size()
    if str(here) != written:
        raise InvalidModelError(
            f"the graph's convolutions are in ONNX Runtime's blocked layout for blocks of {written} channels "
            f"(metadata {BLOCK_KEY}), but this machine's ONNX Runtime "
            + ("has no blocked kernels" if here is None else f"uses blocks of {here}")
            + ": build the training graph here, or with `graphopt train-graph --plain-convs` for any machine")


def external_data_files(model_path: str | os.PathLike) -> list[str]:
    """The external-data files a model file references, as distinct relative locations in
    first-use order, each checked to be inside the model's folder and to exist."""
    path = Path(model_path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise InvalidModelError(f"{str(path)!r} is not a readable ONNX model: {exc}") from exc
    check_external_data(model, path.parent)
    locations: list[str] = []
    for tensor in _external_tensors(model):
        location = Path(ExternalDataInfo(tensor).location).as_posix()
        if location not in locations:
            locations.append(location)
    return locations


def load_model(path: str | os.PathLike, *, max_bytes: int | None = None,
               weights_on_disk: bool = False) -> onnx.ModelProto:
    """Load an ONNX model file with its external data (checked to stay in its folder). With
    `weights_on_disk`, initializers stored as external data stay references (relative to the
    model's folder: graphopt.runtime.weights.Weights(folder=...) reads them), for work on the graph
    alone at any size."""
    path = Path(path)
    if not path.is_file():
        raise InvalidModelError(f"model file {str(path)!r} does not exist")
    size = path.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise LimitExceededError(f"model file is {size} bytes, over the limit of {max_bytes} bytes")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise InvalidModelError(f"{str(path)!r} is not a readable ONNX model: {exc}") from exc
    if not model.HasField("graph"):  # protobuf parses an empty file (and more) as a ModelProto
        raise InvalidModelError(f"{str(path)!r} is not an ONNX model: it has no graph")
    check_versions(model)
    check_blocked_layout(model)
    check_external_data(model, path.parent)
    if weights_on_disk:
        # the small ones inline all the same: shapes and axes are what graph work reads (and what
        # ONNX Runtime's shape inference needs inline)
        from onnx.external_data_helper import load_external_data_for_tensor
        from .runtime.weights import DETACH_MIN_BYTES, data_bytes, is_stub
        try:
            for tensor in model.graph.initializer:
                if is_stub(tensor) and data_bytes(tensor) < DETACH_MIN_BYTES:
                    load_external_data_for_tensor(tensor, str(path.parent))
                    del tensor.external_data[:]
                    tensor.data_location = onnx.TensorProto.DEFAULT
        except Exception as exc:
            raise InvalidModelError(f"cannot read external data of {str(path)!r}: {exc}") from exc
        return model
    try:
        onnx.load_external_data_for_model(model, str(path.parent))
    except Exception as exc:
        raise InvalidModelError(f"cannot read external data of {str(path)!r}: {exc}") from exc
    return model


def load_graph(path: str | os.PathLike, *, max_bytes: int | None = None):
    """The model at `path` with its large weights left on disk (`load_model(weights_on_disk=True)`)
    and the `graphopt.runtime.weights.Weights` that reads them from its folder: what every command
    works on, at any size."""
    from .runtime.weights import Weights
    model = load_model(path, max_bytes=max_bytes, weights_on_disk=True)
    return model, Weights(folder=str(Path(path).parent))


def parse_model(data: bytes) -> onnx.ModelProto:
    """A model from serialized bytes (no external data)."""
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:
        raise InvalidModelError(f"not a serialized ONNX model: {exc}") from exc
    if not model.HasField("graph"):
        raise InvalidModelError("not an ONNX model: it has no graph")
    check_versions(model)
    check_blocked_layout(model)
    return model


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every node a unique, non-empty name (in place; returns the model).

    The first holder of a name keeps it; an unnamed node becomes ``<op_type>_<k>`` and a
    later duplicate ``<name>_<k>``, never taking a name that another node already holds.
    Nodes inside subgraphs (If branches, Loop and Scan bodies) get names unique across the
    whole model too, ``<parent>/<op_type>_<k>`` when they have none: ONNX Runtime's profile
    lists them by name beside the top-level nodes."""
    taken: set[str] = set()
    _name_graph_nodes(model.graph, taken, "")
    return model


def _name_graph_nodes(graph: onnx.GraphProto, taken: set[str], prefix: str) -> None:
    nodes = graph.node
    renamed = []
    for node in nodes:
        if node.name and node.name not in taken:
            taken.add(node.name)
        else:
            renamed.append(node)
    counters: dict[str, int] = {}
    for node in renamed:
        stem = node.name or prefix + node.op_type
        k = counters.get(stem, 0)
        while f"{stem}_{k}" in taken:
            k += 1
        counters[stem] = k + 1
        node.name = f"{stem}_{k}"
        taken.add(node.name)
    for node in nodes:
        for attribute, body in subgraphs(node, with_attributes=True):
            _name_graph_nodes(body, taken, f"{node.name}/{attribute}/")


def subgraphs(node: onnx.NodeProto, with_attributes: bool = False) -> list:
    """The node's subgraphs (If branches, Loop and Scan bodies): GraphProtos, or with
    `with_attributes` (attribute name, GraphProto) pairs."""
    found = []
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            found.append((attribute.name, attribute.g))
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            found.extend((attribute.name, g) for g in attribute.graphs)
    return found if with_attributes else [g for _, g in found]


def follow_order(model: onnx.ModelProto, reference: onnx.ModelProto) -> onnx.ModelProto:
    """Write `model`'s nodes (in place; returns it) in the topological order closest to the order
    of `reference`, a model it was derived from (ONNX Runtime's offline graph optimizations save
    nodes in an order of their own, and ORT's default execution order follows node positions:
    measured on the resnet example's training graph, 63.7 MiB under optimizations off in the
    saved order against 33.5 MiB in the file's).

    A node takes the position in `reference` of the node that produced one of its outputs there
    (the earliest), else of the latest producer of its inputs; among nodes whose inputs are all
    ready, the lowest position goes first (ties: `model`'s own order)."""
    import heapq
    position: dict[str, int] = {}
    for k, node in enumerate(reference.graph.node):
        for t in node.output:
            if t:
                position.setdefault(t, k)
    nodes = list(model.graph.node)
    produced_by = {t: i for i, node in enumerate(nodes) for t in node.output if t}

    def inputs_of(node: onnx.NodeProto) -> set[str]:
        names = {t for t in node.input if t}
        for g in subgraphs(node):   # outer-scope names a subgraph reads
            names |= _outer_names(g)
        return names

    deps = [{produced_by[t] for t in inputs_of(node) if t in produced_by} - {i} for i, node in enumerate(nodes)]
    key: list[float] = []
    for i, node in enumerate(nodes):   # `model` is topologically sorted: producers come first
        own = [position[t] for t in node.output if t in position]
        # a node with no counterpart: just after the latest of its inputs' producers
        key.append(min(own) if own else max((key[j] for j in deps[i] if j < i), default=-1) + 0.5)
    readers: list[list[int]] = [[] for _ in nodes]
    pending = [len(d) for d in deps]
    for i, d in enumerate(deps):
        for j in d:
            readers[j].append(i)
    ready = [(key[i], i) for i in range(len(nodes)) if pending[i] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, i = heapq.heappop(ready)
        out.append(nodes[i])
        for r in readers[i]:
            pending[r] -= 1
            if pending[r] == 0:
                heapq.heappush(ready, (key[r], r))
    if len(out) != len(nodes):
        return model   # a cycle: leave the order as it is (analyze names it)
    del model.graph.node[:]
    model.graph.node.extend(out)
    return model


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads that it does not define itself."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    read: set[str] = set()
    for node in graph.node:
        read |= {t for t in node.input if t}
        for g in subgraphs(node):
            read |= _outer_names(g)
        defined |= {t for t in node.output if t}
    return read - defined
