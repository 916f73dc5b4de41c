"""The gRPC service against the in-process library: latency and throughput under concurrent
clients, and the service's overhead on a ~100 MB model. One run, markdown tables.

    python benchmarks/service_bench.py [--levels 1,4,16] [--calls 8,16,32] [--repeats 3]
        [--big-width 2048] [--big-depth 7] [--no-measure-big] [--skip-big] [--json out.json]

It starts a real `graphopt serve --host 127.0.0.1 --port 0 --workers 2 --queue 16` subprocess
(the OS picks a free loopback port; the server prints it) and stops it at the end whatever
happens (SIGTERM, then SIGKILL to its process group and to its workers' groups).

1. Latency and throughput. Every client (its own channel, one thread each) optimizes the same
   small training graph (mlp 64x128x8, ~0.5 MB) a few times; per concurrency level: calls,
   errors by status code, p50 / p95 latency (nearest rank), the wait for a worker, throughput
   (successful calls per second of the level's wall time), and the in-process time of one call
   on the same file (load + optimize + save, median of 3, run in this process while the server
   idles) beside it. Options for every call: the default strategy, verify on, measure OFF
   (measuring starts fresh processes that time a training step; off, the numbers are about the
   service).
2. Overhead on a ~100 MB model (mlp, wide layers, batch 8: weights dominate, the step is cheap).
   The real default job: verify and measure ON, default strategy. In-process = load from disk +
   optimize() + save, as `graphopt optimize` does; service = Client.optimize (upload, the same
   work in a worker, download). Alternated, --repeats times each; medians, the overhead ratio
   against the 10% target, a breakdown from the progress events' arrival times, and the
   transfer's pieces (sha256, chunking, receiving) timed alone on the same file.
3. The same tables go to benchmarks/results/service_bench.md when benchmarks/results exists.

Everything (client threads, the server, its 2 workers, their measuring subprocesses) shares
this machine's cores; the tables say how many, and how much CPU other processes on the
machine took meanwhile ("others", in cores), since a shared machine moves these numbers.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from graphopt.examples import training_example
from graphopt.ingest import load_model
from graphopt.optimize import OptimizeOptions, optimize, save_model
from graphopt_service._proto import graphopt_pb2 as pb
from graphopt_service.client import Client, make_options, upload_messages
from graphopt_service.transfer import FileReceiver
from graphopt_service.workers import process_tree

HERE = Path(__file__).resolve().parent
SMALL = dict(batch=64, width=128, depth=8, d_in=64)
WORKERS, QUEUE = 2, 16
TARGET_OVERHEAD = 0.10
_TICKS = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------ server --
class Server:
    """`graphopt serve` on 127.0.0.1, a free port; its JSON log goes to a file."""

    def __init__(self, folder: Path, workers: int, queue: int, start_seconds: float = 120.0):
        self.log_path = folder / "server.log"
        self._log = open(self.log_path, "w")
        work_dir = folder / "server-work"
        work_dir.mkdir()
        command = [sys.executable, "-m", "graphopt.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                   "--workers", str(workers), "--queue", str(queue), "--work-dir", str(work_dir)]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, start_new_session=True)
        self.worker_pids: set[int] = set()
        ready, _, _ = select.select([self.proc.stdout], [], [], start_seconds)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            raise RuntimeError(f"the server did not start in {start_seconds} s:\n{self.log_path.read_text()}")
        self.port = json.loads(line)["listening"]
        self.target = f"127.0.0.1:{self.port}"
        self.note_workers()

    def note_workers(self) -> None:
        """Remember the worker processes (each in its own session) to kill them if need be."""
        try:
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                self.worker_pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            pass

    def log_entries(self) -> list[dict]:
        self._log.flush()
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def stop(self, drain_seconds: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.note_workers()
            self.proc.send_signal(signal.SIGTERM)          # drain: calls in flight finish, workers killed
            try:
                self.proc.wait(drain_seconds)
            except subprocess.TimeoutExpired:
                pass
        for pgid in [self.proc.pid, *self.worker_pids]:   # whatever is left of it
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        self._log.close()


class CpuMeter:
    """CPU used on the whole machine against CPU used by this benchmark (this process and its
    waited children; every process below it and their waited children: the server, its workers,
    the in-process library's own warm measuring parent) over a stretch of time: other jobs on a
    shared machine show up as `others_cores`."""

    @staticmethod
    def _machine_busy() -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:3]) + sum(v[5:8])) / _TICKS     # user nice system, irq softirq steal

    def _ours(self) -> float:
        t = os.times()
        total = t.user + t.system + t.children_user + t.children_system
        # the server, its workers, the warm measuring parents (ours in-process, and the workers':
        # their reaped children's CPU is in their cutime and cstime) and whatever runs below now
        for pid in process_tree(os.getpid())[1:]:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += sum(int(x) for x in fields[11:15]) / _TICKS   # utime stime cutime cstime
            except OSError:
                pass
        return total

    def __enter__(self):
        self._start = (time.perf_counter(), self._machine_busy(), self._ours())
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self._start[0]
        machine, ours = self._machine_busy() - self._start[1], self._ours() - self._start[2]
        self.result = {"wall_seconds": wall, "ours_cores": ours / wall,
                       "others_cores": max(0.0, machine - ours) / wall}


# ------------------------------------------------------------------------------ helpers --
def nearest_rank(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def fmt_s(seconds: float) -> str:
    if seconds != seconds:
        return "-"
    return f"{seconds * 1000:.0f} ms" if abs(seconds) < 10 else f"{seconds:.1f} s"


def in_process(model_path: Path, output_path: Path, events: list | None = None, **options) -> float:
    """What `graphopt optimize` does: load from disk, optimize, save. Returns the seconds."""
    started = time.perf_counter()
    progress = (lambda stage, fraction: events.append((stage, time.perf_counter() - started))) \
        if events is not None else None
    result = optimize(load_model(model_path), OptimizeOptions(progress=progress, **options))
    save_model(result.model, output_path)
    return time.perf_counter() - started


def service_call(target: str, model_path: Path, output_path: Path, timeout: float, events: list | None = None,
                 **options) -> float:
    started = time.perf_counter()
    progress = (lambda stage, fraction: events.append((stage, time.perf_counter() - started))) \
        if events is not None else None
    with Client(target) as client:
        client.optimize(model_path, output_path, progress=progress, timeout_seconds=timeout, **options)
    return time.perf_counter() - started


# ------------------------------------------------------------------ 1. latency / throughput --
def run_level(server: Server, model_path: Path, out_dir: Path, clients: int, calls: int, timeout: float,
              kind: str = "optimize") -> dict:
    """`clients` clients, `calls` calls in all: optimize calls (verify on, measure off) or Analyze calls."""
    per_client = [calls // clients + (1 if i < calls % clients else 0) for i in range(clients)]
    latencies, dispatch, errors = [], [], {}
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client_thread(index: int) -> None:
        with Client(server.target) as client:
            client.health()                      # connected before the clock starts
            barrier.wait()
            for k in range(per_client[index]):
                marks = []
                started = time.perf_counter()
                try:
                    if kind == "analyze":
                        client.analyze(model_path, timeout_seconds=timeout)
                    else:
                        client.optimize(model_path, out_dir / f"c{index}-{k}.onnx", timeout_seconds=timeout,
                                        progress=lambda stage, f: marks.append((stage, time.perf_counter())),
                                        verify=True, measure=False)
                    seconds = time.perf_counter() - started
                    with lock:
                        latencies.append(seconds)
                        # "queued" comes right after the upload; the next event is the worker's
                        if len(marks) >= 2:
                            dispatch.append((marks[0][1], marks[1][1]))
                except grpc.RpcError as exc:
                    with lock:
                        errors[exc.code().name] = errors.get(exc.code().name, 0) + 1

    threads = [threading.Thread(target=client_thread, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    with CpuMeter() as meter:
        barrier.wait()
        for t in threads:
            t.join()
    # overtaken: a call that got its worker after a call queued later than it got one
    overtaken = sum(any(q2 > q1 and w2 < w1 for q2, w2 in dispatch) for q1, w1 in dispatch)
    return dict(clients=clients, calls=calls, ok=len(latencies), errors=errors, latencies=latencies,
                worker_waits=[w - q for q, w in dispatch], overtaken=overtaken, **meter.result)


def latency_table(levels: list[dict], single: float, cores: int) -> list[str]:
    lines = [f"### Latency and throughput: mlp {SMALL['batch']}x{SMALL['width']}x{SMALL['depth']} "
             "training graph, verify on, measure off, default strategy",
             "",
             f"Server: --workers {WORKERS} --queue {QUEUE} on 127.0.0.1. This machine has {cores} cores, shared by "
             "the client threads, the server and its workers, and by whatever else runs on it (CPU others = "
             "what processes outside this benchmark used meanwhile, in cores). In-process = load + optimize + "
             "save of the same file in this process, median of 3, server idle. Latencies: nearest rank. "
             "Wait = from 'queued' (upload done) to the worker's first event. Overtaken = calls that got a "
             "worker after a call queued later than them got one. Ideal = min(clients, workers, cores) / "
             "in-process single call.",
             "",
             "| clients | calls | ok | errors | p50 | p95 | p50 / in-process | wait p50 / p95 | overtaken "
             "| throughput calls/s | in-process single call | ideal calls/s | throughput / ideal "
             "| CPU ours / others (cores) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for level in levels:
        lat, waits = level["latencies"], level["worker_waits"]
        errors = ", ".join(f"{k} x{v}" for k, v in sorted(level["errors"].items())) or "0"
        p50 = nearest_rank(lat, 50)
        throughput = level["ok"] / level["wall_seconds"]
        ideal = min(WORKERS, level["clients"], cores) / single
        lines.append(f"| {level['clients']} | {level['calls']} | {level['ok']} | {errors} | {fmt_s(p50)} "
                     f"| {fmt_s(nearest_rank(lat, 95))} | {p50 / single:.2f}x "
                     f"| {fmt_s(nearest_rank(waits, 50))} / {fmt_s(nearest_rank(waits, 95))} "
                     f"| {level['overtaken']} | {throughput:.2f} | {fmt_s(single)} | {ideal:.2f} "
                     f"| {throughput / ideal:.2f} | {level['ours_cores']:.2f} / {level['others_cores']:.2f} |")
    return lines


def analyze_table(levels: list[dict], cores: int, size_bytes: int) -> list[str]:
    lines = [f"### Tiny Analyze calls: mlp small training graph ({size_bytes / 1e3:.0f} kB)", "",
             f"Server: --workers {WORKERS} --queue {QUEUE} on 127.0.0.1, {cores} cores shared with the clients. "
             "Each client its own channel and thread, its calls one after another; throughput = successful "
             "calls / the level's wall time; latencies: nearest rank.", "",
             "| clients | calls | ok | errors | p50 | p95 | max | throughput calls/s | CPU ours / others (cores) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for level in levels:
        lat = level["latencies"]
        errors = ", ".join(f"{k} x{v}" for k, v in sorted(level["errors"].items())) or "0"
        lines.append(f"| {level['clients']} | {level['calls']} | {level['ok']} | {errors} | "
                     f"{fmt_s(nearest_rank(lat, 50))} | {fmt_s(nearest_rank(lat, 95))} | {fmt_s(max(lat, default=float('nan')))} "
                     f"| {level['ok'] / level['wall_seconds']:.2f} "
                     f"| {level['ours_cores']:.2f} / {level['others_cores']:.2f} |")
    return lines


# ------------------------------------------------------------------------- 2. overhead --
SEGMENTS = ["upload: start -> 'queued'",
            "load: to 'analyze' (service: from 'queued', handing the job to a worker included)",
            "library work: 'analyze' -> 'done'",
            "after 'done': save (service: + send back, download, checks)"]


def segments(events: list[tuple[str, float]], total: float, service: bool) -> dict:
    """Seconds between progress events (their arrival times at the caller)."""
    at = {}
    for stage, t in events:
        at.setdefault(stage, t)
    upload = at["queued"] if service else 0.0
    return dict(zip(SEGMENTS, [upload, at["analyze"] - upload, at["done"] - at["analyze"], total - at["done"]]))


def transfer_costs(model_path: Path, scratch: Path) -> dict:
    """The transfer's pieces on this file, timed alone in this process (no network)."""
    costs = {}
    t = time.perf_counter()
    data = model_path.read_bytes()
    costs["read the file"] = time.perf_counter() - t
    t = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    costs["sha256 of the bytes in memory (once)"] = time.perf_counter() - t
    del data
    t = time.perf_counter()
    for message in upload_messages(model_path, make_options()):
        message.SerializeToString()
    costs["sender: upload_messages (sha256 pass + 1 MiB FileChunk messages) + serialize"] = time.perf_counter() - t
    messages = [m.SerializeToString() for m in upload_messages(model_path, make_options())]
    t = time.perf_counter()
    receiver = FileReceiver(scratch)
    for blob in messages:
        message = pb.OptimizeRequest.FromString(blob)
        item = message.WhichOneof("item")
        if item == "file":
            receiver.header(message.file)
        elif item == "chunk":
            receiver.chunk(message.chunk)
    receiver.finish()
    costs["receiver: parse + FileReceiver (write + sha256)"] = time.perf_counter() - t
    return {"bytes": model_path.stat().st_size, "seconds": costs}


def overhead_section(rows: list[dict], breakdown: dict, transfer: dict, big: dict, cores: int,
                     options_note: str) -> list[str]:
    inproc = [r for r in rows if r["kind"] == "in-process"]
    service = [r for r in rows if r["kind"] == "service"]
    m_in = statistics.median(r["seconds"] for r in inproc)
    m_sv = statistics.median(r["seconds"] for r in service)
    overhead = m_sv / m_in - 1
    transfer_only = sum(breakdown["service"][n] - breakdown["in-process"][n] for n in SEGMENTS if "library" not in n)
    lines = [f"### Service overhead on a {big['bytes'] / 1e6:.0f} MB model (mlp batch {big['size']['batch']}, "
             f"width {big['size']['width']}, depth {big['size']['depth']}: weights "
             f"{big['weight_bytes'] / 1e6:.0f} MB), {options_note}",
             "",
             f"Alternated, {len(inproc)} runs each, same server as above; this machine has {cores} cores (CPU "
             "others = what processes outside this benchmark used during the run, in cores). In-process = "
             "load from disk + optimize() + save (as `graphopt optimize`); service = Client.optimize "
             "(upload, the same work in a worker, download of the optimized model).",
             "",
             "| run | in-process | CPU others | service | CPU others | service / in-process |",
             "|---|---|---|---|---|---|"]
    for i, (a, b) in enumerate(zip(inproc, service), 1):
        lines.append(f"| {i} | {fmt_s(a['seconds'])} | {a['others_cores']:.2f} | {fmt_s(b['seconds'])} "
                     f"| {b['others_cores']:.2f} | {b['seconds'] / a['seconds']:.3f}x |")
    lines.append(f"| **median** | **{fmt_s(m_in)}** | | **{fmt_s(m_sv)}** | | **{m_sv / m_in:.3f}x** |")
    paired = statistics.median(b["seconds"] / a["seconds"] for a, b in zip(inproc, service))
    lines += ["", f"Overhead (ratio of the medians): {overhead:+.1%}; target <= {TARGET_OVERHEAD:.0%}: "
              f"{'met' if overhead <= TARGET_OVERHEAD else 'NOT met'}. Median of the paired ratios (run i against "
              f"run i): {paired - 1:+.1%}. The transfer's share alone (the segments below other than the "
              f"library's work): {fmt_s(transfer_only)} = {transfer_only / m_in:+.1%} of the in-process median.",
              "",
              "Breakdown, medians over the runs, from the progress events' arrival times at the caller:", "",
              "| segment | in-process | service | service - in-process |",
              "|---|---|---|---|"]
    for name in SEGMENTS:
        a, b = breakdown["in-process"][name], breakdown["service"][name]
        lines.append(f"| {name} | {fmt_s(a) if a else '-'} | {fmt_s(b)} | {fmt_s(b - a)} |")
    lines.append(f"| total | {fmt_s(m_in)} | {fmt_s(m_sv)} | {fmt_s(m_sv - m_in)} |")
    lines += ["", f"Transfer pieces on this {transfer['bytes'] / 1e6:.0f} MB file, timed alone in one process, no "
              "network (a call pays the sender and receiver sides once per direction: the client sends, the "
              "server receives; the server sends the result, the client receives):", "",
              "| piece | seconds | MB/s |", "|---|---|---|"]
    for name, seconds in transfer["seconds"].items():
        lines.append(f"| {name} | {seconds:.3f} | {transfer['bytes'] / 1e6 / seconds:.0f} |")
    return lines


# --------------------------------------------------------------------------------- main --
def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default="1,4,16")
    parser.add_argument("--calls", default="8,16,32", help="total calls per level")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--big-width", type=int, default=2048)
    parser.add_argument("--big-depth", type=int, default=7)
    parser.add_argument("--big-batch", type=int, default=8)
    parser.add_argument("--no-measure-big", action="store_true",
                        help="verify on, measure off for the big model (when a call takes > ~2 min)")
    parser.add_argument("--skip-big", action="store_true")
    parser.add_argument("--json", help="also write the raw numbers here")
    parser.add_argument("--analyze-calls", type=int, default=20,
                        help="tiny Analyze calls per client at each level (0: skip that table)")
    parser.add_argument("--skip-optimize", action="store_true", help="skip the optimize latency table")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    calls = [int(x) for x in args.calls.split(",")]
    cores = os.cpu_count() or 1
    run_started = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - run_started:6.1f} s] {text}", file=sys.stderr, flush=True)

    def on_sigterm(signum, frame):
        raise SystemExit(128 + signum)      # so that `finally` stops the server
    signal.signal(signal.SIGTERM, on_sigterm)

    folder = Path(tempfile.mkdtemp(prefix="graphopt-service-bench-"))
    server = None
    out: list[str] = []
    raw: dict = {"cores": cores}
    try:
        small_dir = folder / "small"
        small_dir.mkdir()
        small_path = small_dir / "train.onnx"
        save_model(training_example("mlp", **SMALL)[0], small_path)
        say(f"small model {small_path.stat().st_size / 1e6:.2f} MB; starting the server")
        server = Server(folder, WORKERS, QUEUE)
        say(f"server on {server.target}")

        if args.analyze_calls:
            tiny_path = small_dir / "tiny.onnx"
            save_model(training_example("mlp", small=True)[0], tiny_path)
            with Client(server.target) as client:
                client.analyze(tiny_path, timeout_seconds=120)      # uncounted: the first sessions
            tiny = []
            for clients in levels:
                tiny.append(run_level(server, tiny_path, folder, clients, clients * args.analyze_calls, timeout=300,
                                      kind="analyze"))
                r = tiny[-1]
                say(f"tiny Analyze, {clients} clients: {r['ok']}/{r['calls']} ok, errors {r['errors']}, "
                    f"{r['ok'] / r['wall_seconds']:.2f} calls/s, p50 {fmt_s(nearest_rank(r['latencies'], 50))}")
            raw["tiny_analyze"] = tiny
            out += analyze_table(tiny, cores, tiny_path.stat().st_size) + [""]
            print("\n".join(out), flush=True)
        if not args.skip_optimize:
            # warm both paths once (imports, first sessions), uncounted
            in_process(small_path, folder / "warm_in.onnx", verify=True, measure=False)
            service_call(server.target, small_path, folder / "warm_sv.onnx", 120, verify=True, measure=False)
            server.note_workers()
            single = statistics.median(in_process(small_path, folder / "in.onnx", verify=True, measure=False)
                                       for _ in range(3))
            say(f"in-process single call {single:.3f} s")
            results = []
            for clients, n in zip(levels, calls):
                level_dir = folder / f"level{clients}"
                level_dir.mkdir()
                results.append(run_level(server, small_path, level_dir, clients, n, timeout=300))
                shutil.rmtree(level_dir, ignore_errors=True)
                r = results[-1]
                say(f"{clients} clients: {r['ok']}/{n} ok, errors {r['errors']}, {r['wall_seconds']:.1f} s, "
                    f"CPU others {r['others_cores']:.2f} cores")
            raw["latency"] = {"in_process_seconds": single, "levels": results}
            out += latency_table(results, single, cores)
            print("\n".join(out), flush=True)

        if not args.skip_big:
            big_dir = folder / "big"
            big_dir.mkdir()
            big_path = big_dir / "train.onnx"
            size = dict(batch=args.big_batch, width=args.big_width, depth=args.big_depth, d_in=256)
            model = training_example("mlp", **size)[0]
            weight_bytes = sum(math.prod(t.dims) * 4 for t in model.graph.initializer if t.data_type == 1)
            save_model(model, big_path)
            del model
            big = {"size": size, "bytes": big_path.stat().st_size, "weight_bytes": weight_bytes}
            measure = not args.no_measure_big
            note = "verify on, measure " + ("on (the real default job)" if measure else "OFF") + \
                ", default strategy"
            say(f"big model {big['bytes'] / 1e6:.1f} MB; {note}")
            rows, parts = [], {"in-process": [], "service": []}
            for i in range(args.repeats):
                for kind in ("in-process", "service"):
                    events: list = []
                    output = folder / f"big_out_{kind}.onnx"
                    with CpuMeter() as meter:
                        if kind == "in-process":
                            seconds = in_process(big_path, output, events, verify=True, measure=measure)
                        else:
                            seconds = service_call(server.target, big_path, output, 900, events,
                                                   verify=True, measure=measure)
                    output.unlink()
                    rows.append({"kind": kind, "seconds": seconds, "events": events, **meter.result})
                    parts[kind].append(segments(events, seconds, kind == "service"))
                    say(f"big run {i + 1} {kind}: {seconds:.2f} s, CPU others "
                        f"{meter.result['others_cores']:.2f} cores")
            breakdown = {kind: {name: statistics.median(p[name] for p in runs) for name in SEGMENTS}
                         for kind, runs in parts.items()}
            scratch = folder / "scratch"
            scratch.mkdir()
            transfer = transfer_costs(big_path, scratch)
            shutil.rmtree(scratch, ignore_errors=True)
            server_calls = [e for e in server.log_entries() if e.get("message") == "call finished"]
            raw["overhead"] = {"model": big, "runs": rows, "breakdown": breakdown, "transfer": transfer,
                               "server_call_seconds": [e.get("seconds") for e in server_calls[-args.repeats:]]}
            section = overhead_section(rows, breakdown, transfer, big, cores, note)
            print("\n" + "\n".join(section), flush=True)
            out += [""] + section
    finally:
        if server is not None:
            server.stop()
            say("server stopped")
        shutil.rmtree(folder, ignore_errors=True)

    total = time.perf_counter() - run_started
    out += ["", f"Run time: {total:.0f} s."]
    print(f"\nRun time: {total:.0f} s.")
    results_dir = HERE / "results"
    if results_dir.is_dir():
        (results_dir / "service_bench.md").write_text("\n".join(out) + "\n")
        say(f"wrote {results_dir / 'service_bench.md'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
