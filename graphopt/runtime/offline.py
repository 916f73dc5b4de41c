"""ONNX Runtime's own graph optimizations, applied once, offline, so that graphopt plans the
graph ORT would run rather than the file it was given.

A rewritten graph must run with ORT's graph optimizations off (they would merge recomputed
nodes back and change the planned order; docs/ort-facts.md section 3), and so, planned on the
user's file, it loses what the default session gains from them: fused Conv+activation, fused
Gemm+activation, MatMul+Transpose, ... (`benchmarks/overhead_table.py` prints, per model, the
plan without recomputation against the faster of the original's two sessions).

The levels graphopt applies (``GRAPH_OPTIMIZATION_LEVELS``):

- ``none``: the file as given.
- ``basic``: ORT's BASIC level (redundant nodes removed, semantics-preserving fusions into
  standard ONNX operators: Conv+Add, MatMul+Add -> Gemm, ...).
- ``extended``: ORT's EXTENDED level (adds fusions into ``com.microsoft`` operators that stock
  ORT builds run on the provider they were made for: FusedConv, FusedGemm, FusedMatMul, Gelu,
  LayerNormalization, ...). The saved model is for the provider it was optimized on.

ORT's ALL level (layout transformations, NCHWc on CPU) is not offered: its saved models are
tied to the machine's vector width (ORT warns so itself), and the model graphopt returns may
run elsewhere; and its NCHWc Convs read a blocked copy of each weight made at optimization time
(on the resnet example's training graph: 27 Convs, each reading a new initializer), a second
copy of the weights that goes stale as soon as training feeds new values, as constant folding's
would (below).
The training-graph builder writes the blocked convolutions itself instead, with the weights
reordered in the graph, so they run at every level and for fed weights (builder/blocked_convs.py).

Two of ORT's optimizers are disabled in every level:

- constant folding: on a training graph it folds expressions of the parameters (the transposed
  weight a backward MatMul reads) into new constants, a second copy of each weight in the file
  and in memory, stale as soon as the parameters are fed new values;
- common-subexpression elimination: a training graph often computes a forward value again in
  the backward pass (the unet example's MaxPool gradients, its Expands); merged into the
  forward node, the value is held from the forward pass to its backward reader. Measured on
  the unet example, graphopt's order with nothing recomputed: 43.2 MiB after BASIC with it,
  38.0 MiB as given.
"""
from __future__ import annotations

import os

GRAPH_OPTIMIZATION_LEVELS = {"none": None, "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED"}
DEFAULT_GRAPH_OPTIMIZATIONS = "extended"
DISABLED_OFFLINE = ("ConstantFolding", "CommonSubexpressionElimination")

# Initializers at or above this size go to an external data file when the optimized model is
# saved (needed for models over protobuf's 2 GiB limit; harmless below it).
_EXTERNAL_MIN_BYTES = 1024


def optimize_offline(model_path: str | os.PathLike, out_path: str | os.PathLike, level: str,
                     providers: list[str] | None = None, external_data: bool = False) -> None:
    """Load ``model_path`` in ONNX Runtime at ``level`` (a key of GRAPH_OPTIMIZATION_LEVELS other
    than ``none``) with ``providers`` and save the graph it optimized to ``out_path`` (its
    initializers in ``<out_path>.data`` when ``external_data``)."""
    import onnxruntime as ort

    from .session import default_providers
    if GRAPH_OPTIMIZATION_LEVELS.get(level) is None:
        raise ValueError(f"no offline optimization for level {level!r} (known: {sorted(GRAPH_OPTIMIZATION_LEVELS)})")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.__members__[GRAPH_OPTIMIZATION_LEVELS[level]]
    so.optimized_model_filepath = os.fspath(out_path)
    so.log_severity_level = 3
    if external_data:
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                    os.path.basename(os.fspath(out_path)) + ".data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                    str(_EXTERNAL_MIN_BYTES))
    providers = list(providers or default_providers())
    ort.InferenceSession(os.fspath(model_path), so, providers=providers, disabled_optimizers=list(DISABLED_OFFLINE))


TRANSFER_OPS = ("MemcpyFromHost", "MemcpyToHost")


def without_transfers(model) -> int:
    """Remove (in place) the copies between host and device a saved graph of a device provider
    carries (ONNX Runtime inserts them at load where it leaves a node on the CPU), each reader
    reading the copy's input instead; how many were removed. They are ops of that provider alone
    (the CPU provider, which checks outputs, has no kernel for them), and ONNX Runtime inserts them
    again when it loads the file on the device; the order check leaves them out
    (`verify.inserted_at_load`)."""
    from onnx import helper

    rename: dict[str, str] = {}
    kept = []
    for node in model.graph.node:
        if node.op_type in TRANSFER_OPS and node.domain in ("", "ai.onnx") and len(node.input) == 1:
            rename[node.output[0]] = rename.get(node.input[0], node.input[0])
        else:
            kept.append(node)
    if not rename:
        return 0
    graph_outputs = {o.name for o in model.graph.output}
    for node in kept:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    for output, source in rename.items():
        if output in graph_outputs:   # a graph output stays under its name: an Identity writes it
            kept.append(helper.make_node("Identity", [source], [output], name=f"{output}__copy"))
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return len(rename)
