"""`graphopt batch ZOO -o OUT --ray auto|ADDRESS`: the batch's jobs as Ray tasks (issue 27).

An optional extra: ``pip install 'graphopt[ray]'``. The batch itself does not change (discover,
prepare, run, summarize: graphopt/batch.py); `RayRunner` is its `Runner`, beside `LocalRunner`
(worker processes here) and `RemoteRunner` (graphopt servers):

* Each model is one Ray task that runs the local runner on whichever node Ray picks: the
  model's files go to the task in pieces of CHUNK_BYTES (nodes need not share a disk; a model
  past 2 GB travels as any other), the task runs
  `graphopt optimize` in a process of its own there, as the local batch does, and returns the
  report and the produced files, which the driver writes into OUT. So a model's result is
  written once, by the driver, only when a task returned it.
* Its resources are declared: `cpus_per_job` CPUs (the optimize's threads too), the memory
  given (Ray's `memory`: it schedules on a node with that much unreserved) and one GPU when
  the model's execution provider is CUDA's.
* A task whose node is lost is run again on another node (Ray's `max_retries`, `retries`
  here); a model that fails for itself fails once, with its error, as in the local batch.
* Resumable as the local batch: the driver skips the jobs whose report says done.
* Each report says where its model ran: ``report["graphopt_batch"]``'s ``ray_node_id`` and
  ``ray_task_id``.
"""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import replace
from pathlib import Path

from .batch import BatchJob, BatchOptions, LocalRunner, model_files
from .errors import GraphoptError

RETRIES = 3
TASK_FOLDER_PREFIX = "graphopt-ray-"    # then the model's name (task_folder_name) and a random part


def task_folder_name(name: str) -> str:
    """The model's name as its task's temporary folder carries it ("vision/resnet.onnx" ->
    "vision_resnet.onnx"): what runs where can be seen on the node."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


# files travel in pieces of at most this many bytes: no single object, message or buffer of a
# model past protobuf's 2 GB (or msgpack's 4 GB) limit, and the driver reads one piece at a time
CHUNK_BYTES = 256 << 20


def _chunks(path: Path):
    with open(path, "rb") as f:
        while piece := f.read(CHUNK_BYTES):
            yield piece


def _optimize_task(name: str, files: dict[str, list], options: BatchOptions, threads: int) -> tuple[dict, dict]:
    """In a Ray worker, on some node: the local runner on the model written to a folder of
    this node, each file from its pieces (object refs the driver put, fetched one at a time).
    Returns (report, {produced file name: [its pieces as bytes]})."""
    import ray
    with tempfile.TemporaryDirectory(prefix=f"{TASK_FOLDER_PREFIX}{task_folder_name(name)}-") as folder:
        model_dir, out_dir = Path(folder) / "model", Path(folder) / "out"
        for relative, pieces in files.items():
            target = model_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                for piece in pieces:
                    f.write(ray.get(piece))
        model = model_dir / next(iter(files))
        job = BatchJob(name=name, source=model, out_dir=out_dir, key="", kind="training", training_path=model)
        report = LocalRunner(threads=threads).optimize(job, options)
        produced = {p.name: list(_chunks(p)) for p in out_dir.iterdir() if p.is_file()}
    context = ray.get_runtime_context()
    report["graphopt_batch"] = {"ray_node_id": context.get_node_id(), "ray_task_id": context.get_task_id()}
    return report, produced


class RayRunner:
    """Runs each job as a Ray task (see the module's docstring). `address`: "auto" (a running
    cluster this machine is part of), "local" (start one here, for trying it out) or a cluster's
    address ("ray://HOST:10001" or "HOST:6379")."""

    def __init__(self, address: str = "auto", cpus_per_job: int = 1, memory_bytes: int | None = None,
                 retries: int = RETRIES):
        try:
            import ray
        except ImportError:
            raise GraphoptError("--ray needs Ray: pip install 'graphopt[ray]'") from None
        self._ray = ray
        if not ray.is_initialized():
            ray.init(address=None if address == "local" else address, include_dashboard=False,
                     log_to_driver=False, logging_level="ERROR",
                     # the tasks import graphopt from where this driver does
                     runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                         p for p in (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH"))
                         if p)}})
        self.cpus_per_job, self.memory_bytes, self.retries = cpus_per_job, memory_bytes, retries
        self._remote = ray.remote(_optimize_task)

    def resources(self, options: BatchOptions) -> dict:
        """What each task declares to Ray's scheduler."""
        declared = {"num_cpus": self.cpus_per_job, "max_retries": self.retries, "retry_exceptions": False}
        if self.memory_bytes is not None:
            declared["memory"] = self.memory_bytes
        if any("CUDA" in provider for provider in options.optimize.providers or []):
            declared["num_gpus"] = 1
        return declared

    def optimize(self, job: BatchJob, options: BatchOptions) -> dict:
        folder = job.training_path.parent
        files = {p.relative_to(folder).as_posix(): [self._ray.put(piece) for piece in _chunks(p)]
                 for p in model_files(job.training_path)}
        ref = self._remote.options(**self.resources(options)).remote(job.name, files, options, self.cpus_per_job)
        try:
            report, produced = self._ray.get(ref)
        except self._ray.exceptions.RayTaskError as exc:   # the model's own failure, as the local batch says it
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            raise GraphoptError(str(cause).strip().splitlines()[-1] if str(cause).strip() else repr(cause)) from None
        job.out_dir.mkdir(parents=True, exist_ok=True)
        for name, pieces in produced.items():
            _write(job.out_dir / name, pieces)
        return report

    def close(self) -> None:
        self._ray.shutdown()


def _write(path: Path, pieces: list[bytes]) -> None:
    tmp = path.with_name(f".{path.name}.ray-tmp")
    with open(tmp, "wb") as f:
        for piece in pieces:
            f.write(piece)
    os.replace(tmp, path)
