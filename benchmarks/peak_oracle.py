"""The step's peak as graphopt measures it, against an independent oracle: the least memory limit
under which ONNX Runtime runs the step (issue 25, item 6: nothing else checked the GPU's).

    python benchmarks/peak_oracle.py [--examples resnet,unet] [--size full|large]
        [--provider CUDAExecutionProvider]

Per model (the bundled examples' training graphs; `--size large`: 8x their batch): the peak of one
step measured in a fresh process (graphopt.runtime.measure.measure: VmHWM on the CPU; on CUDA
ONNX Runtime's log of its arena's growth, NVML's used device memory beside it), then the least
arena cap under which two steps run in fresh processes
(graphopt.runtime.measure.run_within_limit, bisected to 1% or 1 MiB; the weights, inputs and
state buffers held outside the cap). Printed side by side, with their ratio. The cap is an upper
bound of what the step needs at once (plus the arena's fragmentation), so a measured peak far
above it, or far below, says the measurement is off.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

MIB = 1 << 20


def least_cap(path: str, inputs_path: str, provider: str | None, start_bytes: int) -> tuple[int, int, int]:
    """(the least cap that fits, the outside bytes, the runs it took), bisected from `start_bytes`."""
    from graphopt.runtime.measure import run_within_limit
    runs = 1
    first = run_within_limit(path, inputs_path, start_bytes, provider=provider)
    outside, hi = first.outside_bytes, first.cap_bytes
    while not first.fits:   # the start was too low: double the cap until it fits
        hi *= 2
        first = run_within_limit(path, inputs_path, outside + hi, provider=provider)
        runs += 1
    lo = 0
    while hi - lo > max(MIB, hi // 100):
        mid = (lo + hi) // 2
        runs += 1
        if run_within_limit(path, inputs_path, outside + mid, provider=provider).fits:
            hi = mid
        else:
            lo = mid
    return hi, outside, runs


def main() -> None:
    from memory_limit import add_model_arguments, model_jobs, write_model

    from graphopt.runtime.measure import measure
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--provider", default=None, help="default: graphopt's (CUDA when present, else CPU)")
    args = parser.parse_args()
    print("| model | measured peak (MiB, method) | NVML's (CUDA, MiB) | least cap that runs (MiB) | "
          "measured / least cap | NVML's / least cap | held outside the cap (MiB) | runs |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, name in model_jobs(args):
        with tempfile.TemporaryDirectory(prefix="graphopt-oracle-") as tmp:
            label, path, inputs_path = write_model(kind, name, args, tmp)
            m = measure(path, inputs_path, provider=args.provider, repeats=1)
            cap, outside, runs = least_cap(path, inputs_path, args.provider, 2 * m.peak_bytes + 64 * MIB)
            nvml = m.nvml_peak_bytes
            print(f"| {label} | {m.peak_bytes / MIB:.1f} ({m.method}) | "
                  f"{'-' if nvml is None else f'{nvml / MIB:.1f}'} | {cap / MIB:.1f} | {m.peak_bytes / cap:.2f} | "
                  f"{'-' if nvml is None else f'{nvml / cap:.2f}'} | {outside / MIB:.1f} | {runs} |", flush=True)


if __name__ == "__main__":
    main()
