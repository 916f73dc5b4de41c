"""graphopt: gradient checkpointing for ONNX training graphs."""
