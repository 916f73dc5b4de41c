"""Replayed node seconds against ONNX Runtime's profile, where the profile times the kernels
(issue 45, item 1): on the CPU provider, per example, the sum of the replayed seconds over the
profiled step's, and per op type (those with at least 5% of the step) replayed over profiled.

    python benchmarks/replay_vs_profile.py [--examples mlp,resnet] [--provider NAME] [--threads N]

The profile: the training graph (optimizations off, graphopt's unoptimized settings) profiled
over 5 steps after a warm-up, each node's median (`runtime.profile.median_node_seconds`). The
replay: `annotate.replay` (graphopt/runtime/replay.py) on the sizes `annotate` measured. On a provider
whose profile times launches (CUDA), the "profiled" column is those launches: the table then
shows how far they are from what the device spends.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from graphopt.annotate import annotate, replay  # noqa: E402
from graphopt.examples import EXAMPLES, training_example  # noqa: E402
from graphopt.ingest import name_nodes  # noqa: E402
from graphopt.runtime.profile import median_node_seconds  # noqa: E402
from graphopt.runtime.session import UNOPTIMIZED_SETTINGS, open_session  # noqa: E402

SHARE = 0.05


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--provider", default="CPUExecutionProvider")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    providers = [args.provider] + (["CPUExecutionProvider"] if args.provider != "CPUExecutionProvider" else [])
    print(f"{'model':12s} {'nodes':>6s} {'groups':>6s} {'replay s':>8s} {'profiled ms':>11s} {'replayed ms':>11s} "
          f"{'ratio':>6s}  op types with >= {SHARE:.0%} of the step: replayed / profiled")
    for name in args.examples.split(","):
        model, inputs = training_example(name)
        name_nodes(model)
        annotations = annotate(model, inputs, UNOPTIMIZED_SETTINGS, providers=providers, threads=args.threads)
        with tempfile.TemporaryDirectory() as tmp:
            session = open_session(model, UNOPTIMIZED_SETTINGS, providers=providers, threads=args.threads,
                                   arena=True, profile_prefix=os.path.join(tmp, "profile"))
            known = {i.name for i in session.get_inputs()}
            feeds = {k: v for k, v in inputs.items() if k in known}
            for _ in range(6):
                session.run(None, feeds)
            profiled, _ = median_node_seconds(session.end_profiling(), skip_runs=1)
            del session
        started = time.perf_counter()
        replayed = replay(model, inputs, annotations.tensor_shapes, annotations.tensor_dtypes,
                                       providers=providers, threads=args.threads)
        took = time.perf_counter() - started
        op_type = {n.name: n.op_type for n in model.graph.node}
        common = [n for n in replayed.node_seconds if n in profiled]
        step = sum(profiled[n] for n in common)
        total = sum(replayed.node_seconds[n] for n in common)
        by_type: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for n in common:
            by_type[op_type[n]][0] += profiled[n]
            by_type[op_type[n]][1] += replayed.node_seconds[n]
        types = ", ".join(f"{op} {r / p:.2f}" for op, (p, r) in sorted(by_type.items(), key=lambda kv: -kv[1][0])
                          if p >= SHARE * step)
        print(f"{name:12s} {len(op_type):6d} {replayed.groups:6d} {took:8.1f} {step * 1e3:11.1f} {total * 1e3:11.1f} "
              f"{total / step:6.2f}  {types}" + (f"  ({len(replayed.skipped)} not replayed)" if replayed.skipped else ""),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
