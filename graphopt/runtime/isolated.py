"""ONNX Runtime work of ``optimize`` in fresh processes, one at a time, so that the calling
process never holds a training step. Each is forked from a warm parent that has the libraries
imported (:mod:`graphopt.runtime.warm`), or started as a fresh interpreter where there is none.

Annotating, computing the original's outputs, and checking a rewritten model (its outputs
against the original's, then ORT's order) each run in a child (``graphopt.tasks``) that loads
the model and inputs from files of a :class:`Workspace` and exits when done: its step and
whatever its allocator kept go back to the OS with it. The caller holds its ModelProtos
(weights once per copy) and, at any time, one child's step. The original's outputs are
computed once per workspace and written to disk; each rewritten model's outputs are compared
with them one array at a time. Measured on BERT-base 8x256 (``benchmarks/annotate_memory.py
--modes step,optimize``): see docs/results.md, "graphopt's own memory".
"""
from __future__ import annotations

import os
import shutil
import tempfile

import onnx

from graphopt.errors import GraphoptError
from graphopt.runtime.session import PROTOBUF_LIMIT_BYTES
from graphopt.runtime.weights import _copy_without, _subgraph_references, write_in_pieces  # noqa: F401


class IsolatedTaskError(GraphoptError):
    """A child running ONNX Runtime work failed without a graphopt error (crash, killed for
    memory, an unexpected exception); the message carries its exit status and stderr tail."""


# glibc's default mmap threshold rises to the size of each mmapped buffer freed (up to 32 MiB),
# after which such buffers come from the heap and stay in RSS when freed: annotating BERT-base
# at 8x256 tokens (attention probabilities 24 MiB each) passed 11 GiB that way, against a 4 GiB
# step. A fixed threshold keeps every buffer of 64 KiB or more in mmap, returned when freed.
TASK_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(TASK_MALLOC_ENV)
    return env


def save_model(model: onnx.ModelProto, path) -> None:
    """Save a model, its initializers serialized one at a time; one over protobuf's 2 GB limit
    gets its weights as external data beside it (graphopt.runtime.weights.save_model)."""
    from graphopt.runtime.weights import save_model as save
    save(model, path)


# The file of a workspace that holds the weights of the models in it (`copy_keeping_weights_on_disk`),
# and the least size of a tensor moved there (smaller ones, such as shape constants, stay inline).
WEIGHTS_FILE = "weights.bin"
WEIGHTS_ON_DISK_MIN_BYTES = 1024


class Workspace:
    """A temporary folder for one ``optimize`` call: the inputs saved once, models saved under
    labels, the original's reference outputs. Use as a context manager (removed on exit)."""

    def __init__(self, inputs: dict | None = None) -> None:
        self.folder = tempfile.mkdtemp(prefix="graphopt-")
        self.inputs_path = os.path.join(self.folder, "inputs.npz")
        if inputs is not None:
            self.save_inputs(inputs)
        self.reference_path: str | None = None   # outputs of the original (optimizations off)
        self._saved: dict[str, str] = {}

    def save_inputs(self, inputs: dict) -> None:
        """The inputs every run of this workspace feeds (`inputs_path`), written once."""
        from graphopt.runtime.arrays import save_arrays
        save_arrays(self.inputs_path, inputs)

    def save(self, model: onnx.ModelProto, label: str) -> str:
        """Write ``model`` as ``label`` (replacing what was there); its path."""
        path = os.path.join(self.folder, f"{label}.onnx")
        for stale in (path, path + ".data"):
            if os.path.exists(stale):
                os.remove(stale)
        save_model(model, path)
        self._saved[label] = path
        return path

    def copy_keeping_weights_on_disk(self, model: onnx.ModelProto, weights=None) -> onnx.ModelProto:
        """A copy of `model` (left untouched) whose initializers of WEIGHTS_ON_DISK_MIN_BYTES or
        more are in the workspace's weights file (`WEIGHTS_FILE`), the copy holding references:
        every model derived from it and saved here carries references, not copies, and the
        children that load them from this folder read the weights from the file. This process
        then holds the graph, not the weights (a 5x-weights parent on the MLP example: 229 MiB
        for 15.6 MiB of weights). Made one initializer at a time: the graph is copied without
        its initializers, and each tensor's data is written to the file before the next, so that
        no second copy of all the weights is ever held. The stubs of `model` (graphopt.runtime.weights:
        external data under `weights.folder`, data `weights` holds) are copied into the file in
        pieces, never whole in this process: a model loaded with its weights on disk is
        optimized without them ever being in memory."""
        from graphopt.runtime.weights import Weights, data_bytes, is_stub
        weights = weights if weights is not None else Weights()
        working = _copy_without(model, "graph")
        working.graph.CopyFrom(_copy_without(model.graph, "initializer"))
        path = os.path.join(self.folder, WEIGHTS_FILE)
        with open(path, "ab") as out:
            for tensor in model.graph.initializer:
                if is_stub(tensor):
                    if not weights.owns(tensor):
                        raise GraphoptError(f"initializer {tensor.name!r} references external data, and graphopt "
                                            "was not told the folder to read it from")
                    if data_bytes(tensor) < WEIGHTS_ON_DISK_MIN_BYTES:    # small ones inline, as below
                        working.graph.initializer.append(weights.tensor(tensor))
                        continue
                elif data_bytes(tensor) < WEIGHTS_ON_DISK_MIN_BYTES or not tensor.HasField("raw_data"):
                    working.graph.initializer.append(tensor)    # small ones (and typed fields) inline
                    continue
                working.graph.initializer.append(weights.append_data(tensor, out, WEIGHTS_FILE))
        return working

    def hand_over(self, model: onnx.ModelProto):
        """The files of this workspace that `model` references, moved to a folder of their own
        that outlives the workspace: a `graphopt.runtime.weights.Weights` over it (removed by its
        `close`), for `graphopt.runtime.weights.save_model` to write `model` one tensor at a time."""
        from graphopt.runtime.weights import Weights, is_stub, stub_location
        folder = tempfile.mkdtemp(prefix="graphopt-weights-")
        for location in {stub_location(t) for t in model.graph.initializer if is_stub(t)}:
            source = os.path.join(self.folder, location)
            target = os.path.join(folder, location)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.exists(source):
                os.replace(source, target)
            elif not os.path.exists(target):
                shutil.rmtree(folder, ignore_errors=True)
                raise GraphoptError(f"the returned model references {location!r}, which is not in the workspace")
        return Weights(folder=folder, owned=True)

    def save_with_weights(self, model: onnx.ModelProto, label: str) -> str:
        """`model` saved as ``label`` with the weights it references in this workspace written
        into the file, as `with_weights` then `save` would, one tensor at a time
        (`write_in_pieces`): this process holds one tensor's data at a time, not two copies of all
        of them (the loaded model and its serialization). Over protobuf's 2 GB limit: its weights
        in ``<label>.onnx.data`` beside it, copied there one tensor at a time; with references in
        subgraphs: `save` of the model loaded whole. Its path."""
        from onnx.external_data_helper import uses_external_data
        referenced = sum(int(e.value) for t in model.graph.initializer if uses_external_data(t)
                         for e in t.external_data if e.key == "length")
        if _subgraph_references(model.graph):
            return self.save(self.with_weights(model, copy=True), label)
        if model.ByteSize() + referenced > PROTOBUF_LIMIT_BYTES:
            # as it leaves graphopt past 2 GB: its weights in a file of their own beside it, copied
            # there one tensor at a time
            from graphopt.runtime.weights import Weights, save_model as save
            path = os.path.join(self.folder, f"{label}.onnx")
            save(model, path, Weights(folder=self.folder))
            self._saved[label] = path
            return path
        path = os.path.join(self.folder, f"{label}.onnx")
        for stale in (path, path + ".data"):
            if os.path.exists(stale):
                os.remove(stale)
        write_in_pieces(model, path, weights_folder=self.folder)
        self._saved[label] = path
        return path

    def with_weights(self, model: onnx.ModelProto, copy: bool = False) -> onnx.ModelProto:
        """`model` with the weights it references in this workspace loaded back into it (in
        place, or into a copy), for a model that leaves the workspace: every model the pipeline
        derives from the one it was given (`copy_keeping_weights_on_disk`) references them."""
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
