"""The state a training step returns and a trainer feeds back: updated parameters, optimizer
state, running statistics, each an output named after the input it replaces."""
from __future__ import annotations

import onnx

UPDATED_SUFFIX = "_updated"


def fed_back_outputs(model: onnx.ModelProto) -> dict[str, str]:
    """output name -> input name for every output ``<name>_updated`` whose ``<name>`` is a graph
    input: the state a training step returns (updated parameters, optimizer state, running
    statistics), which a trainer feeds back at the next step. A trainer writes these outputs
    into buffers it provides (graphopt.train), so they take no memory during the step."""
    inputs = {v.name for v in model.graph.input}
    return {o.name: o.name[:-len(UPDATED_SUFFIX)] for o in model.graph.output
            if o.name.endswith(UPDATED_SUFFIX) and o.name[:-len(UPDATED_SUFFIX)] in inputs}
