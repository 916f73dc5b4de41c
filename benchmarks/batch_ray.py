"""The zoo batch on Ray against the local batch, on the same zoo, side by side (issue 27).

    python benchmarks/batch_ray.py [--jobs 2] [--size small|default]

The zoo: the six example training graphs and four forward classifiers (graphopt_zoo.batch_zoo,
as tests/test_batch.py has it). Each batch is one `graphopt batch` command, timed from start to exit, into a
folder of its own: worker processes here (the default), then `--ray local` (a one-node Ray
cluster started by the command, its start included), then `--ray ADDRESS` on a two-node local
cluster started beforehand (a head and a second node, `--jobs` CPUs in all, its start not
included). Printed: one markdown row each, the wall time and its ratio to the local batch's.
Needs `pip install 'graphopt[ray]'`.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from graphopt_zoo.batch_zoo import write_batch_zoo

def timed_batch(zoo: Path, out: Path, *args: str) -> float:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "graphopt.cli", "batch", str(zoo), "-o", str(out), *args],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"batch {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--size", choices=("small", "default"), default="small")
    args = ap.parse_args()
    from ray.cluster_utils import Cluster
    with tempfile.TemporaryDirectory(prefix="graphopt-batch-ray-") as tmp:
        folder = Path(tmp)
        zoo = folder / "zoo"
        write_batch_zoo(zoo, small=args.size == "small")
        jobs = ["--jobs", str(args.jobs)]
        rows = [("local worker processes", timed_batch(zoo, folder / "local", *jobs))]
        rows.append(("--ray local (one node, started by the command)",
                     timed_batch(zoo, folder / "ray-local", *jobs, "--ray", "local")))
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": max(1, args.jobs // 2)})
        try:
            cluster.add_node(num_cpus=max(1, args.jobs - args.jobs // 2))
            cluster.wait_for_nodes()
            rows.append(("--ray ADDRESS (two local nodes, started before)",
                         timed_batch(zoo, folder / "ray-two", *jobs, "--ray", cluster.address)))
        finally:
            cluster.shutdown()
    base = rows[0][1]
    print(f"Zoo: 10 models ({args.size} examples and 4 classifiers), --jobs {args.jobs}\n")
    print("| batch | wall seconds | / local |")
    print("|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.1f} | {seconds / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
