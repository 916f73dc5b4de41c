"""The package's layering, read from its source: every import, including those inside
functions (a deferred import is still an arrow), resolved to graphopt's modules.

- no import cycle between graphopt's modules;
- `graphopt/runtime/` (running ONNX Runtime in isolated processes) imports nothing of graphopt
  outside itself except `graphopt.errors` (the error types every layer raises);
- the solvers (`graphopt/search/`) import no ONNX and nothing of graphopt but the cost graph,
  the errors and each other;
- the library (`graphopt/`) knows nothing of gRPC or the service.
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graphopt"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: pathlib.Path, modules: set[str] = frozenset()) -> set[str]:
    """Every module `path` imports, by absolute name: `from X import y` is X.y where that is a
    module of `modules`, else X."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
    return found


def import_graph() -> nx.DiGraph:
    """graphopt's modules and the arrows between them."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in imports_of(path, set(modules)):
            if target in modules and target != name:
                graph.add_edge(name, target)
    return graph


def test_the_import_graph_reads_real_arrows():
    graph = import_graph()
    # arrows this test must see, or it reads nothing: relative and absolute ones
    assert graph.has_edge("graphopt.search.registry", "graphopt.search.auto")
    assert graph.has_edge("graphopt.pipeline", "graphopt.costmodel")
    assert graph.has_edge("graphopt.runtime.measure", "graphopt.runtime.warm")
    assert len(graph) >= 60 and graph.number_of_edges() > 150


def test_no_import_cycle():
    graph = import_graph()
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_runtime_imports_nothing_above_it():
    up = [(a, b) for a, b in import_graph().edges
          if a.startswith("graphopt.runtime") and not b.startswith("graphopt.runtime")
          and b not in ("graphopt", "graphopt.errors")]
    assert not up, "graphopt/runtime/ imports from above it: " + ", ".join(f"{a} -> {b}" for a, b in up)


def test_solvers_see_only_the_cost_graph():
    allowed = ("graphopt.search", "graphopt.costgraph", "graphopt.costmodel", "graphopt.errors", "graphopt")
    bad = []
    for path in (PACKAGE / "search").glob("*.py"):
        for target in imports_of(path):
            if target.split(".")[0] in ("onnx", "onnxruntime"):
                bad.append((module_name(path), target))
            elif target.startswith("graphopt") and not any(
                    target == a or target.startswith(a + ".") for a in allowed[:-1]) and target != "graphopt":
                bad.append((module_name(path), target))
    assert not bad, f"solvers importing beyond the cost graph: {bad}"


def test_the_library_knows_nothing_of_grpc_or_the_service():
    bad = [(module_name(p), t) for p in PACKAGE.rglob("*.py") for t in imports_of(p)
           if t.split(".")[0] in ("grpc", "service", "grpc_health", "grpc_reflection")]
    assert not bad, f"the library imports the service layer: {bad}"
