"""The operator-coverage table of docs/reference/ops.md, generated from the architectures the tests check
against torch autograd (zoo/torch_zoo.py, tests/test_builder_vs_torch.py).

    python tests/op_coverage.py           # print the table
    python tests/op_coverage.py --write   # put it into docs/reference/ops.md between the markers
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TABLE_FILE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "ops.md"
START, END = "<!-- op-coverage:start -->", "<!-- op-coverage:end -->"

# where an operator's gradient comes from, when not from onnx-ad's rule as it is
GRAPHOPT_RULES = {
    "BatchNormalization": "graphopt (training mode: through the batch statistics; reads only the input)",
    "Conv": "onnx-ad (inputs, 3-channel weights); graphopt for weights per tap, grouped weights, 1x1 inputs",
    "ConvTranspose": "onnx-ad for the input; graphopt for the weight",
    "Relu": "graphopt (reads the output, not the input)",
    "LeakyRelu": "graphopt (reads the output)",
    "Dropout": "graphopt (seeded mask + Where; the mask is drawn once)",
    "Gather": "onnx-ad, its ScatterND made a ScatterElements (exact with threads)",
    "MaxPool": "onnx-ad, its ScatterND made a ScatterElements (exact with threads)",
    "Slice": "onnx-ad; graphopt for steps other than 1 (negative too)",
}


def table() -> str:
    from graphopt_zoo.torch_zoo import op_coverage
    coverage = op_coverage()
    by_op: dict[str, list[str]] = {}
    for arch, ops in coverage.items():
        for op in ops:
            by_op.setdefault(op, []).append(arch)
    lines = ["| operator | architectures (gradients checked against torch) | gradient rule |",
             "|---|---|---|"]
    for op in sorted(by_op):
        lines.append(f"| {op} | {', '.join(by_op[op])} | {GRAPHOPT_RULES.get(op, 'onnx-ad')} |")
    return "\n".join(lines)


def committed_table() -> str | None:
    match = re.search(re.escape(START) + r"\n(.*?)\n" + re.escape(END), TABLE_FILE.read_text(), re.S)
    return match.group(1) if match else None


def write() -> None:
    text = TABLE_FILE.read_text()
    block = f"{START}\n{table()}\n{END}"
    if START in text:
        text = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda m: block, text, flags=re.S)
    else:
        text += "\n" + block + "\n"
    TABLE_FILE.write_text(text)


if __name__ == "__main__":
    if "--write" in sys.argv:
        write()
    else:
        print(table())
