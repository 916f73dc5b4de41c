"""Facts about ONNX ops and types that the builder, the analysis and the cost rules share: one
table per fact."""
from __future__ import annotations

import onnx

# the domains of the standard ONNX operators
STANDARD_DOMAINS = ("", "ai.onnx")
# the floating element types: what has a gradient
FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                         onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})
# ops whose output is a view of their input's buffer in ONNX Runtime (no bytes of their own)
ALIAS_OPS = frozenset({"Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"})
