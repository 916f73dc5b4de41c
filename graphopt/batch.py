"""Optimize every model of a folder: `graphopt batch ZOO_DIR -o OUT_DIR`.

    discover -> prepare (a training graph for forward models) -> run (in parallel) -> summarize

* Every `.onnx` under ZOO_DIR is a job, keyed by the SHA-256 of its files (the model and its
  external data) and of the batch options. A training graph goes straight in; a forward
  model first gets one from `build_training_graph` with `--loss`.
* A runner optimizes one prepared job and returns the library's report: in worker
  processes by default (`LocalRunner`: a `graphopt optimize` process per job, so a crash
  fails only its model), or on servers (graphopt_service.batch.RemoteRunner).
* OUT_DIR/<model path without .onnx>/ gets `optimized.onnx` and `report.json`; the report is
  written last and holds the key, so a rerun skips what is done and retries what failed.
* One failing model never stops the batch; the summary says which failed and why.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Protocol

from .options import option_args
from .errors import GraphoptError, InvalidModelError
from .options import NOT_JSON, OptimizeOptions, option_specs

REPORT_NAME = "report.json"
TIMELINE_NAME = "timeline.png"   # `graphopt optimize --plot`: the predicted bytes alive over the step
OPTIMIZED_NAME = "optimized.onnx"
TRAINING_NAME = "training.onnx"


# the batch's options before it held an OptimizeOptions: their fingerprint keeps these names, so
# that a rerun of an older batch finds its jobs done (None: the library's default)
LEGACY_FINGERPRINT_FIELDS = ("memory_limit_bytes", "strategy", "measure", "objective", "max_overhead",
                             "graph_optimizations")


@dataclass
class BatchOptions:
    loss: str | None = "cross_entropy"    # for forward models (their training graph's loss)
    budget_fraction: float | None = None  # budget = fraction x predicted peak of the original
    sweep: int | None = None              # points of the memory-time front (in-process only)
    # every model's options (its budget comes from budget_fraction; no inputs: each model's own)
    optimize: OptimizeOptions = field(default_factory=OptimizeOptions)

    def fingerprint(self) -> str:
        """The options as part of each job's key: the legacy fields always (their default as
        None), every other option only where it differs from its default."""
        record = {"loss": self.loss, "budget_fraction": self.budget_fraction, "sweep": self.sweep}
        for spec in option_specs():
            if spec.name in NOT_JSON:
                continue
            value = getattr(self.optimize, spec.name)
            if spec.name in LEGACY_FINGERPRINT_FIELDS:
                record[spec.name] = None if value == spec.default and spec.name != "measure" else value
            elif value != spec.default:
                record[spec.name] = value
        return json.dumps(record, sort_keys=True)

    def check(self) -> None:
        """Refuse a bad option once, before any model (the library's own check, without the
        budget: each model's budget is known only once its peak is predicted)."""
        if self.optimize.budget_bytes is not None:
            raise GraphoptError("a batch's budget is a fraction of each model's peak: give budget_fraction "
                                "(--budget-fraction), not budget_bytes")
        if self.optimize.inputs is not None:
            raise GraphoptError("a batch synthesizes each model's inputs: its options take no inputs")
        self.optimize.check()


@dataclass
class BatchJob:
    name: str                  # the model's path under ZOO_DIR, e.g. "vision/resnet.onnx"
    source: Path
    out_dir: Path
    key: str
    kind: str = ""             # "training" or "forward", once prepared
    training_path: Path | None = None

    @property
    def optimized_path(self) -> Path:
        return self.out_dir / OPTIMIZED_NAME

    @property
    def report_path(self) -> Path:
        return self.out_dir / REPORT_NAME


@dataclass
class BatchOutcome:
    name: str
    status: str                # "ok", "failed" or "skipped" (done by an earlier run)
    kind: str = ""
    error: str = ""
    seconds: float = 0.0
    report: dict = field(default_factory=dict)


class Runner(Protocol):
    def optimize(self, job: BatchJob, options: BatchOptions) -> dict: ...


def model_files(path: Path) -> list[Path]:
    """The model file and its external-data files (just the file when it cannot be read:
    that model's job fails later, with the reason, and the others go on)."""
    from .ingest import external_data_files
    try:
        return [path] + [path.parent / p for p in external_data_files(path)]
    except GraphoptError:
        return [path]


def content_key(path: Path, options: BatchOptions) -> str:
    digest = hashlib.sha256(options.fingerprint().encode())
    for file in model_files(path):
        digest.update(file.relative_to(path.parent).as_posix().encode())
        with open(file, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def discover(zoo: Path, out: Path, options: BatchOptions) -> list[BatchJob]:
    """Every .onnx file under `zoo` (not under `out`), sorted, as a job."""
    zoo, out = zoo.resolve(), out.resolve()
    jobs = []
    for path in sorted(zoo.rglob("*.onnx")):
        if out == path or out in path.parents:
            continue
        name = path.relative_to(zoo).as_posix()
        jobs.append(BatchJob(name=name, source=path, out_dir=out / name[:-len(".onnx")],
                             key=content_key(path, options)))
    return jobs


def done_before(job: BatchJob) -> dict | None:
    """The report of an earlier run of this exact job, if it succeeded."""
    try:
        report = json.loads(job.report_path.read_text())
    except (OSError, ValueError):
        return None
    batch = report.get("graphopt_batch", {})
    if batch.get("key") == job.key and batch.get("status") == "ok" and job.optimized_path.is_file():
        return report
    return None


def prepare(job: BatchJob, options: BatchOptions) -> None:
    """Classify the model; a forward model gets its training graph in the job's folder."""
    from .analyze import analyze
    from .builder.train_graph import build_training_graph
    from .ingest import load_graph, name_nodes
    from .runtime.weights import save_model
    # the graph alone: the weights stay on disk, copied into the training graph's file in pieces
    model, weights = load_graph(job.source)
    try:
        probe = onnx_copy(model)
        analyze(name_nodes(probe))
        job.kind, job.training_path = "training", job.source
    except InvalidModelError:
        job.kind = "forward"
        job.out_dir.mkdir(parents=True, exist_ok=True)
        job.training_path = job.out_dir / TRAINING_NAME
        save_model(build_training_graph(model, loss=options.loss, weights=weights), job.training_path, weights)


def onnx_copy(model):
    import onnx
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


class LocalRunner:
    """Each job in a `graphopt optimize` process of its own (a crash fails only that model)."""

    def __init__(self, threads: int = 1, timeout_seconds: float | None = None):
        self.threads, self.timeout_seconds = threads, timeout_seconds

    def optimize(self, job: BatchJob, options: BatchOptions) -> dict:
        job.out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".graphopt-batch-", dir=job.out_dir) as tmp:
            report_path, output = Path(tmp) / "report.json", Path(tmp) / OPTIMIZED_NAME
            budget = None if options.budget_fraction is None else self._budget(job, options)
            command = [sys.executable, "-m", "graphopt.cli", "optimize", str(job.training_path), "-o", str(output),
                       "--report", str(report_path),
                       *option_args(replace(options.optimize, threads=self.threads, budget_bytes=budget))]
            if options.sweep:
                command += ["--sweep", str(options.sweep)]
            else:   # the predicted memory over the step, beside the report
                command += ["--plot", str(Path(tmp) / TIMELINE_NAME)]
            proc = subprocess.run(command, capture_output=True, text=True, timeout=self.timeout_seconds)
            if proc.returncode != 0:
                lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
                raise GraphoptError(lines[-1] if lines else f"graphopt optimize exited with {proc.returncode}")
            report = json.loads(report_path.read_text())
            for produced in Path(tmp).iterdir():   # the model, its sweep files, its external data
                if produced.name != "report.json":
                    os.replace(produced, job.out_dir / produced.name)
        return report

    @staticmethod
    def _budget(job: BatchJob, options: BatchOptions) -> int:
        from .ingest import load_graph
        from .optimize import analyze_model
        model, weights = load_graph(job.training_path)
        analysis = analyze_model(model, OptimizeOptions(), weights=weights)
        return int(options.budget_fraction * analysis.predicted_peak_bytes.original_optimizations_off)


def run_batch(jobs: list[BatchJob], runner: Runner, options: BatchOptions, workers: int = 1,
              progress: Callable[[BatchOutcome], None] | None = None) -> list[BatchOutcome]:
    """Run every job not done before; `progress` is called once per job as it ends."""
    progress = progress or (lambda outcome: None)
    lock = threading.Lock()

    def one(job: BatchJob) -> BatchOutcome:
        started = time.perf_counter()
        earlier = done_before(job)
        if earlier is not None:
            return BatchOutcome(job.name, "skipped", earlier.get("graphopt_batch", {}).get("kind", ""),
                                report=earlier)
        try:
            prepare(job, options)
            report = runner.optimize(job, options)
            outcome = BatchOutcome(job.name, "ok", job.kind, report=report)
        except Exception as exc:  # noqa: BLE001 - one model's failure is that model's status
            outcome = BatchOutcome(job.name, "failed", job.kind, error=_one_line(exc))
            report = {}
        outcome.seconds = time.perf_counter() - started
        report = dict(report)
        # what the runner says of where the model ran (RayRunner: its node and task), then the batch's own
        report["graphopt_batch"] = {**report.pop("graphopt_batch", {}), "key": job.key, "status": outcome.status, "kind": job.kind,
                                    "error": outcome.error, "seconds": outcome.seconds, "model": job.name,
                                    "nodes": _node_count(job.training_path)}
        job.out_dir.mkdir(parents=True, exist_ok=True)
        _write_atomically(job.report_path, json.dumps(report, indent=2))
        outcome.report = report
        return outcome

    outcomes: dict[str, BatchOutcome] = {}
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {pool.submit(one, job): job for job in jobs}
        for future in as_completed(futures):
            outcome = future.result()
            with lock:
                outcomes[outcome.name] = outcome
            progress(outcome)
    return [outcomes[job.name] for job in jobs]


def _node_count(path: Path | None) -> int | None:
    import onnx
    try:
        return len(onnx.load(str(path), load_external_data=False).graph.node) if path else None
    except Exception:  # noqa: BLE001 - an unreadable model has no count; its error says why
        return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    details = getattr(exc, "details", None)
    if callable(details):   # a grpc.RpcError, from a remote runner
        return f"{exc.code().name}: {details()}"
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
