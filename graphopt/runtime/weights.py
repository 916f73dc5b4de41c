"""Weights kept out of the graph: models past protobuf's 2 GB limit, and graph work that never
touches (or copies) the weights.

A ModelProto cannot be serialized past 2 GB (ONNX's checker, shape inference and
``SerializeToString`` all serialize it), and every ``CopyFrom`` of a model copies its weights.
Graph work (the builder's passes, onnx-ad, checks) needs each initializer's name, type and
shape, never its data. So the builder works on a model whose large initializers are *stubs*:
a TensorProto with the name, type and dims and ``data_location`` EXTERNAL, whose data lives in a
`Weights`:

* a reference into a file of the model's folder (``location`` a relative path, as ONNX writes
  external data): `Weights.folder` is that folder;
* a tensor this process holds (``location`` `HELD`): the original TensorProto, by name, never
  copied;
* zeros (``location`` `ZEROS`): an optimizer's state starts at zero, made when written.

`save_model` writes a model and the data of its stubs one tensor at a time: inline under 2 GB,
as external data beside the model over it. `attach` puts the data back into the ModelProto for
callers that want a self-contained model in memory.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from graphopt.errors import InvalidModelError

# protobuf's limit on one serialized message (2 GiB), less a margin for the graph around the weights
PROTOBUF_LIMIT_BYTES = 2**31 - 2**24
HELD = "graphopt:held"        # data held in this process (Weights.held)
ZEROS = "graphopt:zeros"      # all zeros, made when written
# the least data of an initializer the builder detaches (smaller ones, shapes and axes, stay inline)
DETACH_MIN_BYTES = 1 << 20
# over the limit, initializers of this size or more go to the external data file (as onnx.save does)
EXTERNAL_MIN_BYTES = 1024
# the bytes of zeros, or of a file's data, written at a time
_PIECE_BYTES = 64 << 20


def is_stub(tensor: TensorProto) -> bool:
    """Whether `tensor`'s data is elsewhere (external data or a graphopt stub)."""
    return tensor.data_location == TensorProto.EXTERNAL


def stub_location(tensor: TensorProto) -> str | None:
    for entry in tensor.external_data:
        if entry.key == "location":
            return entry.value
    return None


def _entry(tensor: TensorProto, key: str) -> str | None:
    for entry in tensor.external_data:
        if entry.key == key:
            return entry.value
    return None


def data_bytes(tensor: TensorProto) -> int:
    """The bytes of `tensor`'s data, wherever it is."""
    if is_stub(tensor):
        length = _entry(tensor, "length")
        if length is not None:
            return int(length)
        return int(np.prod(tensor.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    return tensor.ByteSize()


def make_stub(name: str, data_type: int, dims, location: str) -> TensorProto:
    """A TensorProto with `name`, type and dims whose data is at `location` (`HELD`, `ZEROS`)."""
    tensor = TensorProto(name=name, data_type=data_type, dims=[int(d) for d in dims],
                         data_location=TensorProto.EXTERNAL)
    itemsize = helper.tensor_dtype_to_np_dtype(data_type).itemsize
    for key, value in (("location", location),
                       ("length", str(int(np.prod(dims, dtype=np.int64)) * itemsize))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def zeros_stub(name: str, data_type: int, dims) -> TensorProto:
    """An initializer of zeros that holds no data until it is written."""
    return make_stub(name, data_type, dims, ZEROS)


@dataclasses.dataclass
class Weights:
    """Where the data of a model's stubs is: `folder` for references into files, `held` for the
    tensors this process holds (by name)."""
    folder: str | None = None
    held: dict[str, TensorProto] = dataclasses.field(default_factory=dict)
    owned: bool = False       # `folder` is graphopt's own (a result's), removed by `close`

    def close(self) -> None:
        """Remove `folder` when it is graphopt's own (the weights of a returned model)."""
        if self.owned and self.folder is not None:
            import shutil
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def __enter__(self) -> "Weights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def detach(self, model: onnx.ModelProto, min_bytes: int = DETACH_MIN_BYTES) -> onnx.ModelProto:
        """A copy of `model` whose initializers of `min_bytes` or more (of data held inline) are
        `HELD` stubs, their TensorProtos kept here by reference (not copied): a copy of the graph,
        not of the weights. References to external data stay as they are."""
        light = _copy_without(model, "graph")
        light.graph.CopyFrom(_copy_without(model.graph, "initializer"))
        for tensor in model.graph.initializer:
            if not is_stub(tensor) and data_bytes(tensor) >= min_bytes:
                self.held[tensor.name] = tensor
                light.graph.initializer.append(make_stub(tensor.name, tensor.data_type, tensor.dims, HELD))
            else:
                light.graph.initializer.append(tensor)
        return light

    def tensor(self, stub: TensorProto) -> TensorProto:
        """The initializer `stub` stands for, with its data inline: the tensor held (not a copy),
        zeros made, or a reference under `folder` read (a new message); a reference with no
        `folder` is returned as it is (it stays a reference where it is written)."""
        location = stub_location(stub)
        if location == HELD:
            if stub.name not in self.held:
                raise InvalidModelError(f"initializer {stub.name!r}: its data is no longer held")
            return self.held[stub.name]
        if location == ZEROS:
            dtype = helper.tensor_dtype_to_np_dtype(stub.data_type)
            full = TensorProto(name=stub.name, data_type=stub.data_type, dims=stub.dims)
            full.raw_data = np.zeros(tuple(stub.dims), dtype).tobytes()
            return full
        from onnx.external_data_helper import load_external_data_for_tensor
        if self.folder is None:      # a reference that stays one (relative to where it is written)
            return stub
        full = TensorProto()
        full.CopyFrom(stub)
        load_external_data_for_tensor(full, self.folder)
        del full.external_data[:]
        full.data_location = TensorProto.DEFAULT
        return full

    def write_data(self, stub: TensorProto, out) -> int:
        """Write the data of `stub` to the binary file `out`, in pieces for zeros and references;
        the bytes written."""
        location = stub_location(stub)
        if location == ZEROS:
            remaining = data_bytes(stub)
            chunk = bytes(min(remaining, _PIECE_BYTES))
            while remaining:
                n = min(remaining, len(chunk))
                out.write(chunk[:n] if n < len(chunk) else chunk)
                remaining -= n
            return data_bytes(stub)
        if location == HELD:
            tensor = self.held[stub.name]
            data = tensor.raw_data if tensor.HasField("raw_data") else _raw(tensor)   # (typed fields)
            out.write(data)
            return len(data)
        if self.folder is None:
            raise InvalidModelError(f"initializer {stub.name!r}: external data {location!r} without the "
                                    "model's folder to read it from")
        offset = int(_entry(stub, "offset") or 0)
        length = _entry(stub, "length")
        with open(os.path.join(self.folder, location), "rb") as source:
            source.seek(offset)
            remaining = int(length) if length is not None else None
            written = 0
            while remaining is None or remaining > 0:
                piece = source.read(_PIECE_BYTES if remaining is None else min(remaining, _PIECE_BYTES))
                if not piece:
                    break
                out.write(piece)
                written += len(piece)
                if remaining is not None:
                    remaining -= len(piece)
            if remaining:
                raise InvalidModelError(f"initializer {stub.name!r}: external data file {location!r} ends "
                                        f"before its {length} bytes")
        return written

    def append_data(self, tensor: TensorProto, out, location: str) -> TensorProto:
        """Append the data of `tensor` (inline, or a stub's from where it is) to the binary file
        `out`, page-aligned (ONNX Runtime maps it from the file; onnx's writer aligns so too), the
        file being `location` beside the model; the reference to it that takes the tensor's place."""
        offset = out.tell()
        if offset % 4096:
            out.write(bytes(4096 - offset % 4096))
            offset = out.tell()
        if is_stub(tensor):
            length = self.write_data(tensor, out)
        else:
            data = tensor.raw_data if tensor.HasField("raw_data") else _raw(tensor)   # one tensor's copy
            out.write(data)
            length = len(data)
            del data
        ref = TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims,
                          data_location=TensorProto.EXTERNAL)
        if tensor.doc_string:
            ref.doc_string = tensor.doc_string
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
            entry = ref.external_data.add()
            entry.key, entry.value = key, value
        return ref

    def attach(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """In place: every stub of `model` (graphopt's and references under `folder`) replaced by
        its initializer with the data inline; returns `model`. Past 2 GB the result cannot be
        serialized whole: write it with `save_model`."""
        tensors = list(model.graph.initializer)
        if not any(is_stub(t) and self._resolvable(t) for t in tensors):
            return model
        model.graph.ClearField("initializer")
        for tensor in tensors:
            if is_stub(tensor) and self._resolvable(tensor):
                full = self.tensor(tensor)
                if full is self.held.get(tensor.name):
                    copied = TensorProto()
                    copied.CopyFrom(full)
                    full = copied
                model.graph.initializer.append(full)
            else:
                model.graph.initializer.append(tensor)
        return model

    def owns(self, tensor: TensorProto) -> bool:
        """Whether this Weights has the data of stub `tensor` (else it is a reference kept as is)."""
        return self._resolvable(tensor)

    def _resolvable(self, tensor: TensorProto) -> bool:
        location = stub_location(tensor)
        return location in (HELD, ZEROS) or self.folder is not None


def past_limit_error(exc: BaseException, what: str = "this command") -> InvalidModelError:
    """The error to raise for protobuf's refusal to serialize a message past 2 GB (EncodeError)
    where graphopt did not keep the weights apart: it names the limit and what to do."""
    from graphopt.errors import LimitExceededError
    return LimitExceededError(
        f"{what} tried to serialize a model whole past protobuf's 2 GB limit ({exc}). Keep its weights as "
        "external data beside the model file (onnx.save(model, path, save_as_external_data=True)) and run the "
        "graphopt command on that file: train-graph, optimize, analyze, measure, train, batch and the service "
        "keep the weights on disk; from Python, load it with graphopt.ingest.load_model(path, "
        "weights_on_disk=True), pass weights=graphopt.runtime.weights.Weights(folder=its folder), and write models with "
        "graphopt.runtime.weights.save_model")


def model_bytes(model: onnx.ModelProto) -> int:
    """The serialized size of `model` with the data of its stubs counted (top-level initializers)."""
    head = _copy_without(model, "graph")
    head.graph.CopyFrom(_copy_without(model.graph, "initializer"))
    # ByteSize of a message past 2 GB raises: count the initializers one at a time (each field's
    # tag and length prefix: a few bytes each, within the limit's margin)
    return head.ByteSize() + sum(data_bytes(t) if is_stub(t) else t.ByteSize() + 8
                                 for t in model.graph.initializer)


def save_model(model: onnx.ModelProto, path, weights: Weights | None = None, *,
               limit_bytes: int = PROTOBUF_LIMIT_BYTES) -> None:
    """Write `model` to `path`, the data of its stubs from `weights`, one tensor at a time: no
    serialization of the whole model, nor a second copy of all its weights, is ever held.

    Up to protobuf's 2 GB limit the file holds everything (external data references under
    `weights.folder` read into it). Past it, every initializer of EXTERNAL_MIN_BYTES or more goes
    to ``<path>.data`` beside the model, the model referencing it. Both files are written under
    temporary names and renamed when complete: a model is never left half written, and one
    read from the same path (weights under `weights.folder`) is read whole before it is replaced.
    `limit_bytes`: where external data begins (protobuf's limit; lower only to test that form)."""
    path = Path(path)
    weights = weights if weights is not None else Weights()
    if path.suffix not in ("", ".onnx", ".pb"):      # a text format onnx.save infers from the name
        size = model_bytes(model)
        if size > PROTOBUF_LIMIT_BYTES:
            from graphopt.errors import LimitExceededError
            raise LimitExceededError(
                f"{path.name}: the model is {size} bytes, past protobuf's 2 GB limit, and a text format holds "
                "every weight inline: write it as binary ONNX (a .onnx path), which keeps the weights as "
                "external data beside it")
        stubbed = any(is_stub(t) and weights.owns(t) for t in model.graph.initializer)
        onnx.save(weights.attach(_copied(model)) if stubbed else model, str(path))
        return
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    data_name = path.name + ".data"
    data_path = folder / data_name
    fd, model_tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)
    os.close(fd)
    _readable(model_tmp)
    try:
        if model_bytes(model) <= limit_bytes and not _subgraph_references(model.graph):
            write_in_pieces(model, model_tmp, tensor_of=lambda t: weights.tensor(t) if is_stub(t) else t)
            os.replace(model_tmp, path)
            if data_path.exists() and data_path.resolve() != path.resolve():
                data_path.unlink()       # a stale data file of an earlier, larger model of that name
            return
        fd, data_tmp = tempfile.mkstemp(prefix=f".{data_name}.", dir=folder)
        os.close(fd)
        _readable(data_tmp)
        try:
            head = _copy_without(model, "graph")
            head.graph.CopyFrom(_copy_without(model.graph, "initializer"))
            with open(data_tmp, "wb") as data:
                for tensor in model.graph.initializer:
                    if is_stub(tensor) and not weights.owns(tensor):
                        head.graph.initializer.append(tensor)    # a reference kept as it is
                        continue
                    if data_bytes(tensor) < EXTERNAL_MIN_BYTES:  # small ones inline (shapes, axes)
                        head.graph.initializer.append(weights.tensor(tensor) if is_stub(tensor) else tensor)
                        continue
                    head.graph.initializer.append(weights.append_data(tensor, data, data_name))
            with open(model_tmp, "wb") as f:
                f.write(head.SerializeToString())
            os.replace(data_tmp, data_path)
            os.replace(model_tmp, path)
        finally:
            if os.path.exists(data_tmp):
                os.remove(data_tmp)
    finally:
        if os.path.exists(model_tmp):
            os.remove(model_tmp)


def _readable(path: str) -> None:
    """The permissions a file written with open() would have (mkstemp makes it owner-only)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _raw(tensor: TensorProto) -> bytes:
    from onnx import numpy_helper
    array = numpy_helper.to_array(tensor)
    return array.astype(array.dtype.newbyteorder("<")).tobytes()


def _copied(model: onnx.ModelProto) -> onnx.ModelProto:
    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    return copied


def write_in_pieces(model: onnx.ModelProto, path, weights_folder: str | None = None, tensor_of=None) -> None:
    """The model file of `model`: the model without its initializers, then each initializer as a
    further occurrence of its graph, serialized one at a time (a protobuf parser merges repeated
    occurrences of a message field, appending to its repeated fields, so the file parses to the
    model, initializers in their order), so that no serialization of the whole model, a copy of
    all its weights, is ever held. With `weights_folder`, the data of initializers that reference
    external data there is read into the file, one tensor at a time; `tensor_of` (an initializer ->
    the initializer to write) generalizes that (graphopt.runtime.weights.Weights.tensor)."""
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data
    head = _copy_without(model, "graph")
    head.graph.CopyFrom(_copy_without(model.graph, "initializer"))
    with open(path, "wb") as f:
        f.write(head.SerializeToString())
        del head
        for initializer in model.graph.initializer:
            if tensor_of is not None:
                data = tensor_of(initializer).SerializeToString()
            elif weights_folder is not None and uses_external_data(initializer):
                tensor = onnx.TensorProto()      # a message of its own, freed whole after the write
                tensor.CopyFrom(initializer)
                load_external_data_for_tensor(tensor, weights_folder)
                del tensor.external_data[:]
                tensor.data_location = onnx.TensorProto.DEFAULT
                data = tensor.SerializeToString()
                del tensor
            else:
                data = initializer.SerializeToString()
            f.write(_length_delimited(_MODEL_GRAPH_TAG, _length_delimited(_GRAPH_INITIALIZER_TAG, data)))


# protobuf's wire tags of ModelProto.graph (field 7) and GraphProto.initializer (field 5), both
# length-delimited (wire type 2): `write_in_pieces` writes them itself
_MODEL_GRAPH_TAG = bytes([7 << 3 | 2])
_GRAPH_INITIALIZER_TAG = bytes([5 << 3 | 2])


def _length_delimited(tag: bytes, payload: bytes) -> bytes:
    """One length-delimited protobuf field: its tag, the payload's length as a varint, the payload."""
    size, varint = len(payload), bytearray()
    while True:
        byte = size & 0x7F
        size >>= 7
        if size:
            varint.append(byte | 0x80)
        else:
            varint.append(byte)
            return tag + bytes(varint) + payload


def _copy_without(message, field: str):
    """A copy of a protobuf message without one of its fields (the others copied as they are)."""
    copied = type(message)()
    for descriptor, value in message.ListFields():
        if descriptor.name == field:
            continue
        if descriptor.is_repeated:
            getattr(copied, descriptor.name).extend(value)
        elif descriptor.type == descriptor.TYPE_MESSAGE:
            getattr(copied, descriptor.name).CopyFrom(value)
        else:
            setattr(copied, descriptor.name, value)
    return copied


def _subgraph_references(graph: onnx.GraphProto) -> bool:
    """Whether a subgraph of `graph` (If, Loop, Scan bodies) has an initializer with external data."""
    from onnx.external_data_helper import uses_external_data
    for node in graph.node:
        for attr in node.attribute:
            for sub in list(attr.graphs) + ([attr.g] if attr.HasField("g") else []):
                if any(uses_external_data(t) for t in sub.initializer) or _subgraph_references(sub):
                    return True
    return False
