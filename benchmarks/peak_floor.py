"""The peak no plan can go below, against what was measured: a training graph returns every
gradient as an output, so all of them are alive together at the end of the step whatever is
recomputed. Their bytes over the default session's measured peak is each model's floor
ratio; the median of the floors bounds the median any plan can reach from below.

    python benchmarks/peak_floor.py --json overhead.json [--size full]

`--json`: rows written by benchmarks/overhead_table.py (the default session's measured peak
and graphopt's returned peak per corpus model); each model is exported and built the same
way (zoo/real_zoo.py, legacy exporter, cross entropy) to read its outputs' bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from overhead_table import corpus_models  # noqa: E402


def output_bytes(model) -> int:
    """Bytes of the graph's outputs (static shapes, as the builder declares them)."""
    import numpy as np
    import onnx
    total = 0
    for value in model.graph.output:
        tensor_type = value.type.tensor_type
        dims = [d.dim_value for d in tensor_type.shape.dim]
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)).itemsize
        total += int(np.prod(dims, dtype=np.int64)) * itemsize
    return total


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True, help="benchmarks/overhead_table.py --json output")
    parser.add_argument("--size", default="full")
    args = parser.parse_args()
    with open(args.json) as f:
        rows = {r["model"]: r for r in json.load(f)["rows"]}
    table = []
    for name, train, _ in corpus_models(list(rows), args.size):
        floor = output_bytes(train) / 2**20
        r = rows[name]
        table.append((name, floor, r["peak_default_mib"], r["peak_mib"]))
        print(f"{name}: outputs {floor:.1f} MiB", file=sys.stderr, flush=True)
    print("| model | outputs MiB (gradients, loss, statistics) | peak default session MiB | returned MiB | "
          "floor vs default | returned vs default | returned vs floor |")
    print("|---|---|---|---|---|---|---|")
    for name, floor, default, returned in table:
        print(f"| {name} | {floor:.1f} | {default:.1f} | {returned:.1f} | {floor / default:.2f}x | "
              f"{returned / default:.2f}x | {returned / floor:.2f}x |")
    floors = [floor / default for _, floor, default, _ in table]
    returned = [r / default for _, _, default, r in table]
    print(f"\nmedian floor vs default session: {statistics.median(floors):.3f}x over {len(table)} models "
          f"(no plan's median can be lower)")
    print(f"median returned vs default session: {statistics.median(returned):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
