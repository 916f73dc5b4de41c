"""graphopt_zoo: the models and graphs that graphopt's tests and benchmarks share, importable
wherever graphopt is installed (`pip install -e .`).

- `synthetic`: random branching cost graphs and small training cost graphs (no ONNX);
- `graph_families`: scalable cost-graph families (chains, residual, dense, random) for the
  solver benchmarks (`python -m graphopt_zoo.graph_families` describes them);
- `torch_zoo`: twelve torch architectures exported forward-only, for the builder against
  torch autograd;
- `real_zoo`: real torchvision and transformers architectures, exported with either exporter;
- `torch_twins`: PyTorch twins of the bundled examples (graphopt/examples.py).

The torch modules need the test extra (`pip install -e '.[test]'`)."""
