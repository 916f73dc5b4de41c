"""Soak: repeated large uploads against a real `graphopt serve`, and the server's resident memory
after each round. Run by hand (minutes), not in the test suite.

    python benchmarks/service_soak.py [--upload-mb 160] [--rounds 20] [--concurrency 2]
        [--env MALLOC_ARENA_MAX=8] [--json out.json]

Each call uploads a small training graph (mlp, small) plus one extra file of --upload-mb MB of
random bytes beside it (sent, checked and stored like any external-data file, then removed with
the call's folder) and asks for Analyze, so that the worker's work is short and the numbers are
about the server's side of the transfer. After every round: the server process's VmRSS and
VmHWM from /proc (its workers are separate processes, reported apart), and the files left in
its work folder (none are expected between rounds). The server is `--workers 1 --queue 4` on a
free loopback port and is stopped at the end whatever happens.

--env passes variables to the server (e.g. MALLOC_ARENA_MAX=8 to compare with the server's own
setting of 2 arenas, which it makes when the variable is unset).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from graphopt.examples import training_example
from graphopt.optimize import save_model
from graphopt_service.client import Client, make_options
from graphopt_service.transfer import folder_messages

from graphopt_service._proto import graphopt_pb2 as pb


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def start_server(work: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "graphopt.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--workers", "1", "--queue", "4", "--work-dir", str(work), "--max-model-bytes", "8GiB"]
    log = open(work.parent / "server.log", "w")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, env={**os.environ, **env},
                            start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else b""
    if not line:
        proc.kill()
        raise RuntimeError(f"the server did not start: {(work.parent / 'server.log').read_text()}")
    return proc, f"127.0.0.1:{json.loads(line)['listening']}"


def one_call(target: str, folder: Path) -> str:
    import grpc
    files = ["model.onnx", "extra.bin"]
    messages = [pb.OptimizeRequest(options=make_options(measure=False))]

    def stream():
        yield from messages
        yield from folder_messages(folder, files, 1 << 20, lambda **item: pb.OptimizeRequest(**item))
    with Client(target) as client:
        try:
            client.stub.Analyze(stream(), timeout=600)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upload-mb", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)

    scratch = Path(tempfile.mkdtemp(prefix="graphopt-soak-"))
    proc = None
    try:
        folder = scratch / "upload"
        folder.mkdir()
        model, _ = training_example("mlp", small=True)
        save_model(model, folder / "model.onnx")
        with open(folder / "extra.bin", "wb") as f:
            for _ in range(args.upload_mb):
                f.write(os.urandom(1 << 20))
        work = scratch / "work"
        proc, target = start_server(work, env)
        rows = [{"round": 0, "calls": 0, "statuses": {}, "server_rss_mib": status_kib(proc.pid, "VmRSS") / 1024,
                 "server_peak_rss_mib": status_kib(proc.pid, "VmHWM") / 1024,
                 "workers_rss_mib": sum(status_kib(p, "VmRSS") for p in children(proc.pid)) / 1024,
                 "leftover_files": 0, "seconds": 0.0}]
        print(f"server {target}, pid {proc.pid}, {args.upload_mb} MB per upload, {args.concurrency} at once, "
              f"env {env or '{}'}; {os.cpu_count()} cores")
        print("| round | calls | statuses | server RSS MiB | server peak RSS MiB | workers RSS MiB | leftover files | s |")
        print("|---|---|---|---|---|---|---|---|")
        calls = 0
        for number in range(1, args.rounds + 1):
            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                statuses = list(pool.map(lambda _: one_call(target, folder), range(args.concurrency)))
            calls += len(statuses)
            time.sleep(0.5)   # the folders of the round's calls are removed as they end
            leftovers = [p for p in work.rglob("*") if p.is_file() and p.name != ".lock"]
            rows.append({"round": number, "calls": calls,
                         "statuses": {s: statuses.count(s) for s in sorted(set(statuses))},
                         "server_rss_mib": status_kib(proc.pid, "VmRSS") / 1024,
                         "server_peak_rss_mib": status_kib(proc.pid, "VmHWM") / 1024,
                         "workers_rss_mib": sum(status_kib(p, "VmRSS") for p in children(proc.pid)) / 1024,
                         "leftover_files": len(leftovers), "seconds": time.perf_counter() - started})
        for row in rows:
            print(f"| {row['round']} | {row['calls']} | {row['statuses']} | {row['server_rss_mib']:.0f} | "
                  f"{row['server_peak_rss_mib']:.0f} | {row['workers_rss_mib']:.0f} | {row['leftover_files']} | "
                  f"{row['seconds']:.1f} |")
        if args.json:
            args.json.write_text(json.dumps({"upload_mb": args.upload_mb, "concurrency": args.concurrency,
                                             "env": env, "rows": rows}, indent=2))
        return 0
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
