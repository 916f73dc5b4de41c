"""ONNX Runtime work of ``optimize`` in fresh processes, one at a time, so that the calling
process never holds a training step.

Annotating, computing the original's outputs, and checking a rewritten model (its outputs
against the original's, then ORT's order) each run in a child (``_task_worker``) that loads
the model and inputs from files of a :class:`Workspace` and exits when done: its step and
whatever its allocator kept go back to the OS with it. The caller holds its ModelProtos
(weights once per copy) and, at any time, one child's step. The original's outputs are
computed once per workspace and written to disk; each rewritten model's outputs are compared
with them one array at a time. Measured on BERT-base 8x256 (``benchmarks/annotate_memory.py
--modes step,optimize``): see the README.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import onnx

from graphopt import errors
from graphopt.errors import GraphoptError
from graphopt.runtime.rss import record_child


class IsolatedTaskError(GraphoptError):
    """A child running ONNX Runtime work failed without a graphopt error (crash, killed for
    memory, an unexpected exception); the message carries its exit status and stderr tail."""


# glibc's default mmap threshold rises to the size of each mmapped buffer freed (up to 32 MiB),
# after which such buffers come from the heap and stay in RSS when freed: annotating BERT-base
# at 8x256 tokens (attention probabilities 24 MiB each) passed 11 GiB that way, against a 4 GiB
# step. A fixed threshold keeps every buffer of 64 KiB or more in mmap, returned when freed.
TASK_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(TASK_MALLOC_ENV)
    return env


def run_task(task: str, args: dict, timeout_seconds: float | None = None) -> dict:
    """Run ``task`` of :mod:`graphopt.runtime._task_worker` with ``args`` (JSON) in a child;
    its JSON result. A graphopt error in the child is raised here with its type and message."""
    cmd = [sys.executable, "-m", "graphopt.runtime._task_worker", task]
    try:
        proc = subprocess.run(cmd, input=json.dumps(args), capture_output=True, text=True,
                              timeout=timeout_seconds, env=_env())
    except subprocess.TimeoutExpired:
        raise IsolatedTaskError(f"{task} of {args.get('model')} timed out after {timeout_seconds} s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else None
    record_child(task, result)
    if result is not None and "error" in result:
        err = result["error"]
        cls = getattr(errors, err.get("type", ""), None)
        if isinstance(cls, type) and issubclass(cls, GraphoptError) and cls is not errors.BudgetInfeasibleError:
            raise cls(err["message"])
        raise IsolatedTaskError(f"{task} of {args.get('model')} failed: {err.get('type')}: {err['message']}\n"
                                f"{err.get('traceback', '')[-3000:]}")
    if proc.returncode != 0 or result is None:
        raise IsolatedTaskError(f"{task} of {args.get('model')} failed (exit {proc.returncode}); stderr tail:\n"
                                f"{proc.stderr[-3000:]}")
    return result


def save_model(model: onnx.ModelProto, path) -> None:
    """Save a model; one over protobuf's 2 GB limit gets its weights as external data."""
    path = str(path)
    if model.ByteSize() > 2**31 - 2**24:
        onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                  location=os.path.basename(path) + ".data")
    else:
        onnx.save(model, path)


# The file of a workspace that holds the weights of the models in it (`keep_weights_on_disk`),
# and the least size of a tensor moved there (smaller ones, such as shape constants, stay inline).
WEIGHTS_FILE = "weights.bin"
WEIGHTS_ON_DISK_MIN_BYTES = 1024


class Workspace:
    """A temporary folder for one ``optimize`` call: the inputs saved once, models saved under
    labels, the original's reference outputs. Use as a context manager (removed on exit)."""

    def __init__(self, inputs: dict) -> None:
        from graphopt.inputs import save_inputs
        self.folder = tempfile.mkdtemp(prefix="graphopt-")
        self.inputs_path = os.path.join(self.folder, "inputs.npz")
        save_inputs(self.inputs_path, inputs)
        self.reference_path: str | None = None   # outputs of the original (optimizations off)
        self._saved: dict[str, str] = {}

    def save(self, model: onnx.ModelProto, label: str) -> str:
        """Write ``model`` as ``label`` (replacing what was there); its path."""
        path = os.path.join(self.folder, f"{label}.onnx")
        for stale in (path, path + ".data"):
            if os.path.exists(stale):
                os.remove(stale)
        save_model(model, path)
        self._saved[label] = path
        return path

    def keep_weights_on_disk(self, model: onnx.ModelProto) -> None:
        """Move `model`'s initializers of WEIGHTS_ON_DISK_MIN_BYTES or more into the workspace's
        weights file (`WEIGHTS_FILE`), leaving references: every model derived from it and saved
        here carries references, not copies, and the children that load them from this folder
        read the weights from the file. The parent then holds the graph, not the weights (a
        5x-weights parent on the MLP example: 229 MiB for 15.6 MiB of weights)."""
        from onnx.external_data_helper import convert_model_to_external_data, write_external_data_tensors
        convert_model_to_external_data(model, all_tensors_to_one_file=True, location=WEIGHTS_FILE,
                                       size_threshold=WEIGHTS_ON_DISK_MIN_BYTES, convert_attribute=False)
        write_external_data_tensors(model, self.folder)

    def with_weights(self, model: onnx.ModelProto, copy: bool = False) -> onnx.ModelProto:
        """`model` with the weights it references in this workspace loaded back into it (in
        place, or into a copy), for a model that leaves the workspace: every model the pipeline
        derives from the one it was given (`keep_weights_on_disk`) references them."""
        if copy:
            copied = onnx.ModelProto()
            copied.CopyFrom(model)
            model = copied
        onnx.load_external_data_for_model(model, self.folder)
        return model

    def path(self, label: str) -> str | None:
        """The path ``label`` was saved to, or None."""
        return self._saved.get(label)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
