"""Train with a training graph whose optimizer step is inside it (`graphopt train-graph
--optimizer`, graphopt/builder/optimizer.py), on ONNX Runtime.

Step i (from 0) feeds rows ``[i*B, (i+1)*B)`` of every data array, modulo the number of
samples; every ``<name>_updated`` output becomes input ``<name>`` at the next step. The model
runs with the session settings in its metadata (graphopt's, for an optimized model). The
state (parameters, optimizer state, running statistics) stays in ONNX Runtime's memory on
the provider's device between steps: the outputs are bound with IOBinding to a second set of
buffers, and the two sets swap after each step, so no step allocates them.
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from .analyze import fed_back_outputs
from .errors import InvalidModelError, InvalidOptionError, MemoryLimitError
from .runtime.weights import Weights


@dataclass
class TrainResult:
    losses: list[float]                      # per step: the loss of its forward pass (before the update)
    state: dict[str, np.ndarray]             # the final value of every fed-back input
    steps: int = 0
    batch_size: int = 0
    data_inputs: list[str] = field(default_factory=list)


def _static_dims(value: onnx.ValueInfoProto) -> list[int | None]:
    dims = value.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else None for d in dims]


def plan_inputs(model: onnx.ModelProto) -> tuple[list[str], dict[str, str]]:
    """(data inputs: graph inputs without a default that are not fed back, {output: input fed
    back}). Raises InvalidModelError when the graph has nothing to feed back (no optimizer)."""
    feedback = fed_back_outputs(model)
    if not feedback:
        raise InvalidModelError("the model has no <input>_updated outputs: build it with graphopt train-graph "
                                "--optimizer so that it updates its parameters")
    defaults = {t.name for t in model.graph.initializer}
    fed_back = set(feedback.values())
    missing = [i for i in fed_back if i not in defaults]
    if missing:
        raise InvalidModelError(f"inputs {missing[:5]} are fed back but have no initial value in the model")
    data = [v.name for v in model.graph.input if v.name not in defaults and v.name not in fed_back]
    return data, feedback


def _batch_size(model: onnx.ModelProto, data_inputs: list[str], arrays: dict[str, np.ndarray],
                batch_size: int | None) -> int:
    values = {v.name: v for v in model.graph.input}
    declared = {name: (_static_dims(values[name]) or [None])[0] for name in data_inputs}
    fixed = {d for d in declared.values() if d}
    if batch_size is None:
        if len(fixed) != 1:
            raise InvalidOptionError("the graph's data inputs do not declare one batch dimension "
                                     f"({declared}): give --batch-size")
        batch_size = fixed.pop()
    if batch_size <= 0:
        raise InvalidOptionError(f"batch size must be positive, got {batch_size}")
    for name, d in declared.items():
        if d and d != batch_size:
            raise InvalidOptionError(f"input {name!r} has batch dimension {d} in the graph, not {batch_size}")
    counts = {name: arrays[name].shape[0] if arrays[name].ndim else 0 for name in data_inputs}
    if len(set(counts.values())) != 1:
        raise InvalidOptionError(f"the data arrays have different sample counts: {counts}")
    samples = next(iter(counts.values()))
    if samples == 0 or samples % batch_size:
        raise InvalidOptionError(f"{samples} samples is not a multiple of the batch size {batch_size}")
    return batch_size


def _check_data(model: onnx.ModelProto, data_inputs: list[str], data: dict[str, np.ndarray]) -> None:
    missing = [n for n in data_inputs if n not in data]
    if missing:
        raise InvalidOptionError(f"the data has no arrays for the graph's inputs {missing} "
                                 f"(it has {sorted(data)})")
    values = {v.name: v for v in model.graph.input}
    for name in data_inputs:
        expected = onnx.helper.tensor_dtype_to_np_dtype(values[name].type.tensor_type.elem_type)
        if data[name].dtype != expected:
            raise InvalidOptionError(f"data array {name!r} is {data[name].dtype}, the graph's input is {expected}")


def train(model: onnx.ModelProto | str | os.PathLike, data: dict[str, np.ndarray], steps: int, *,
          batch_size: int | None = None, log: str | os.PathLike | None = None,
          providers: list | None = None, threads: int | None = None, progress: bool = False,
          on_step: Callable[[int, float], None] | None = None,
          memory_limit_bytes: int | None = None) -> TrainResult:
    """Run `steps` training steps of `model` (a ModelProto or a path) on `data` (arrays named like
    the graph's data inputs, first axis the samples); see the module docstring. `log`: a CSV file
    ``step,loss`` (step from 1). `threads=None`: ONNX Runtime's default.

    `memory_limit_bytes`: what the training may hold at once: the weights, the state buffers
    and the batch, held outside ONNX Runtime's arena, and the arena (the step's buffers) capped
    at the rest (graphopt/runtime/limit.py; on the CPU the cap is process-wide). A step that needs more is
    a MemoryLimitError naming the limit and ONNX Runtime's refusal."""
    import onnxruntime as ort

    from .runtime.limit import out_of_memory
    from .runtime.session import default_providers, open_session

    if steps < 0:
        raise InvalidOptionError(f"steps must be >= 0, got {steps}")
    # a path: the graph read without its weights (ONNX Runtime reads them from the model's folder)
    folder = None if isinstance(model, onnx.ModelProto) else os.path.dirname(os.path.abspath(os.fspath(model)))
    proto = model if folder is None else onnx.load(os.fspath(model), load_external_data=False)
    data_inputs, feedback = plan_inputs(proto)
    _check_data(proto, data_inputs, data)
    batch = _batch_size(proto, data_inputs, data, batch_size)
    samples = data[data_inputs[0]].shape[0] if data_inputs else batch
    batches = samples // batch
    loss_name = proto.graph.output[0].name

    fed_back = set(feedback.values())
    cap = None
    if memory_limit_bytes is not None:
        outside = outside_session_bytes(proto, data, data_inputs, batch, fed_back)
        cap = memory_limit_bytes - outside
        if cap <= 0:
            raise MemoryLimitError(f"memory limit of {memory_limit_bytes} bytes: the weights, the state and the "
                                   f"batch alone take {outside} bytes")
    session = open_session(_without_state_defaults(proto, fed_back, model), None,
                           providers=providers or default_providers(), threads=threads, cap_bytes=cap,
                           weights_folder=folder)
    provider = session.get_providers()[0]
    device = "cuda" if provider == "CUDAExecutionProvider" else "cpu"
    current, spare = {}, {}     # this step's state, and the buffers its outputs are written into
    for t in proto.graph.initializer:
        if t.name in fed_back:
            value = numpy_helper.to_array(t, base_dir=folder or "")
            current[t.name] = ort.OrtValue.ortvalue_from_numpy(value, device, 0)
            spare[t.name] = ort.OrtValue.ortvalue_from_shape_and_type(list(value.shape), value.dtype, device, 0)
    binding = session.io_binding()
    losses: list[float] = []
    writer, handle = None, None
    if log is not None:
        handle = open(log, "w", newline="")
        writer = csv.writer(handle)
        writer.writerow(["step", "loss"])
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=steps, unit="step", desc="train")
    try:
        for i in range(steps):
            start = (i % batches) * batch
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            for name in data_inputs:
                binding.bind_cpu_input(name, np.ascontiguousarray(data[name][start:start + batch]))
            for name, value in current.items():
                binding.bind_ortvalue_input(name, value)
            binding.bind_output(loss_name, "cpu")
            for output, name in feedback.items():
                binding.bind_ortvalue_output(output, spare[name])
            for output in session.get_outputs():
                if output.name != loss_name and output.name not in feedback:
                    binding.bind_output(output.name, device)    # other extras (Dropout masks)
            try:
                session.run_with_iobinding(binding)
            except Exception as exc:
                if cap is None or not out_of_memory(exc):
                    raise
                raise MemoryLimitError(
                    f"training step {i + 1} does not fit in the memory limit of {memory_limit_bytes} bytes "
                    f"(ONNX Runtime's arena capped at {cap} bytes, the rest held by the weights, the state and the batch): "
                    f"ONNX Runtime: {exc}") from None
            loss = float(np.array(binding.get_outputs()[0].numpy()).reshape(-1)[0])
            current, spare = spare, current
            losses.append(loss)
            if writer is not None:
                writer.writerow([i + 1, repr(loss)])
                handle.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4g}")
            if on_step is not None:
                on_step(i + 1, loss)
    finally:
        if handle is not None:
            handle.close()
        if bar is not None:
            bar.close()
    # copies: an OrtValue's numpy() may share its buffer, which dies with the OrtValue
    state = {name: np.array(value.numpy(), copy=True) for name, value in current.items()}
    return TrainResult(losses, state, steps, batch, data_inputs)


def outside_session_bytes(model: onnx.ModelProto, data: dict[str, np.ndarray], data_inputs: list[str],
                          batch: int, fed_back: set[str]) -> int:
    """Bytes `train` holds outside ONNX Runtime's arena (graphopt/runtime/limit.py): the
    weights that are not state (initializers the session keeps), two buffers per fed-back
    state tensor (this step's and the next's; the session does not keep their defaults:
    `_without_state_defaults`) and one batch of every data input."""
    from .runtime.limit import initializer_bytes
    held = initializer_bytes(model) + initializer_bytes(model, fed_back)   # the state a second time
    batch_bytes = sum(data[name][:batch].nbytes for name in data_inputs)
    return int(held + batch_bytes)


def _without_state_defaults(model: onnx.ModelProto, fed_back: set[str], path):
    """What the session opens: `model` without the initializers of its fed-back inputs (every
    step binds them, so the session's copies of their defaults would only take memory: a third
    copy of the parameters and optimizer state); `path` (the file as given) when there are none."""
    if not fed_back:
        return path
    from .runtime.weights import _copy_without
    out = _copy_without(model, "graph")         # the graph copied, and the weights kept: not copied
    out.graph.CopyFrom(_copy_without(model.graph, "initializer"))
    out.graph.initializer.extend(t for t in model.graph.initializer if t.name not in fed_back)
    return out


def with_state(model: onnx.ModelProto, state: dict[str, np.ndarray], weights: Weights | None = None
               ) -> onnx.ModelProto:
    """A copy of `model` whose initializers named in `state` hold those values (the defaults a
    resumed training starts from). With `weights`, each large one is a stub whose tensor
    `weights` holds (write the model with `graphopt.runtime.weights.save_model(out, path, weights)`),
    and the other initializers are kept as they are (references to external data stay so)."""
    from .runtime.weights import DETACH_MIN_BYTES, HELD, _copy_without, make_stub
    if weights is None:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    else:                  # the graph copied, each initializer kept as it is (one at a time)
        out = _copy_without(model, "graph")
        out.graph.CopyFrom(_copy_without(model.graph, "initializer"))
        out.graph.initializer.extend(t if t.name not in state else onnx.TensorProto(name=t.name)
                                     for t in model.graph.initializer)
        # (each state's slot holds only its name until it is set below: the old values are not copied)
        dims = {t.name: (list(t.dims), t.data_type) for t in model.graph.initializer if t.name in state}
        for t in out.graph.initializer:
            if t.name in dims:
                t.dims.extend(dims[t.name][0])
                t.data_type = dims[t.name][1]
    for k, t in enumerate(out.graph.initializer):
        if t.name in state:
            value = state[t.name]
            if tuple(value.shape) != tuple(t.dims):
                raise InvalidModelError(f"state {t.name!r} has shape {value.shape}, its initializer {tuple(t.dims)}")
            tensor = numpy_helper.from_array(value.astype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type),
                                                          copy=False), t.name)
            if weights is not None and value.nbytes >= DETACH_MIN_BYTES:
                weights.held[t.name] = tensor
                tensor = make_stub(t.name, t.data_type, t.dims, HELD)
            out.graph.initializer[k].CopyFrom(tensor)
    return out
