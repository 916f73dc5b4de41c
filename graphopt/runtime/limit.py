"""The memory limit: what a training session may hold at once on its device (its weights,
the state a trainer keeps, the step's buffers), enforced where the model runs.

What ONNX Runtime caps is its arena, which holds the buffers of the step (and, on the CPU,
prepacked copies of weights): measured on onnxruntime 1.32, a model with 64 MiB of weights
ran under a 2 MiB CPU cap: initializers are not allocated from it. The limit is therefore
accounted in two parts: what is held outside the arena (the weights, as many bytes as the
initializers declare, the inputs and the state buffers a trainer binds) is counted by the
caller (`outside_bytes`), and the arena is capped at the rest (`providers_within`):

- On the CPU the arena is one region of the whole cap, reserved at its first allocation
  (``initial_chunk_size_bytes`` = the cap; untouched pages are not resident), in which every
  free chunk is split to the size asked (``max_dead_bytes_per_chunk`` 256: ONNX Runtime's
  default leaves a chunk unsplit unless it is twice the request, up to 128 MiB unused in it)
  and freed neighbours merge. Regions added as the arena grows never merge with each other.
  Least cap under which the leanest plan of an example ran (MiB, bisected to 0.5 MiB; plan's
  peak measured arena off / kNextPowerOfTwo by 1 MiB regions, ONNX Runtime's default /
  kSameAsRequested / one region, split): densenet 29.0 / 39.0 / 79.5 / 36.5, randwire
  24.9 predicted / 33.5 / 36.5 / 30.5, the MLP 25.1 predicted / 32.5 / 27.5 / 27.5, resnet
  15.7 predicted / 21.0 / 23.0 / 20.0.
- CUDA: the CUDA provider's ``gpu_mem_limit`` on its arena, with
  ``session.use_device_allocator_for_initializers=1`` so that the weights are allocated
  outside it there too.
- CPU: a shared arena allocator with that maximum registered with ONNX Runtime's environment
  (``create_and_register_allocator``), which a session uses when opened with
  ``session.use_env_allocators=1``; past the cap ``run`` fails with the same message as
  CUDA's ("Available memory of X is smaller than requested bytes of Y"). With
  ``session.disable_prepacking=1``: measured on the MLP example, a cap below the prepacked
  weights' copies was silently not applied (the step ran and took 181 MiB under a 20 MiB
  cap), while with prepacking off every cap tried held; the copies also double the memory of
  every Gemm weight (MLP example: 55 against 26 MiB held by the session before its first
  step), for 1-3% of step time on the examples. The registered allocator is process-wide (a
  later registration replaces it).
"""
from __future__ import annotations

import re

# What a session under a memory limit is opened with, on top of the model's own settings.
LIMIT_SESSION_CONFIG = (("session.disable_prepacking", "1"), ("session.use_env_allocators", "1"),
                        ("session.use_device_allocator_for_initializers", "1"))

# a free chunk of the capped CPU arena is split when more than this would lie unused in it
ARENA_SPLIT_BYTES = 256

_SHORTFALL = re.compile(r"Available memory of (\d+) is smaller than requested bytes of (\d+)")
# ONNX Runtime's messages when an allocation under a cap fails (the arena's; the CUDA
# allocator's own out-of-memory; the C++ allocator's)
_OUT_OF_MEMORY = ("Available memory of", "Failed to allocate memory", "out of memory", "bad_alloc")


def out_of_memory(error: BaseException | str) -> bool:
    """Whether `error` (an exception of `run`, or its message) is an allocation refused."""
    message = str(error)
    return any(marker in message for marker in _OUT_OF_MEMORY)


def shortfall_bytes(error: BaseException | str) -> int | None:
    """How many more bytes the failed allocation needed than the arena had left (None: the
    message does not say)."""
    match = _SHORTFALL.search(str(error))
    return None if match is None else int(match.group(2)) - int(match.group(1))


def initializer_bytes(model, names=None) -> int:
    """The bytes of `model`'s initializers (an onnx.ModelProto; of those in `names` when given),
    from their declared dims and types, so external data need not be loaded."""
    import numpy as np
    import onnx

    return int(sum(int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                   for t in model.graph.initializer if names is None or t.name in names))


def providers_within(provider: str, cap_bytes: int, device_id: int = 0) -> list:
    """The providers list of a session capped at `cap_bytes` on `provider`'s device; on the
    CPU this registers the capped arena with ONNX Runtime's environment (process-wide)."""
    import onnxruntime as ort

    if cap_bytes <= 0:
        raise ValueError(f"a session cannot be capped at {cap_bytes} bytes")
    if provider == "CUDAExecutionProvider":
        return [(provider, {"device_id": str(device_id), "gpu_mem_limit": str(int(cap_bytes)),
                            "arena_extend_strategy": "kNextPowerOfTwo"}), "CPUExecutionProvider"]
    if provider != "CPUExecutionProvider":
        raise ValueError(f"a memory limit on {provider} is not supported (CPU and CUDA are)")
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    # max_mem, arena_extend_strategy 0 (kNextPowerOfTwo, never used: the first region is the
    # whole cap), initial_chunk_size_bytes, max_dead_bytes_per_chunk (see the module docstring)
    cap = int(cap_bytes)
    ort.create_and_register_allocator(info, ort.OrtArenaCfg(cap, 0, cap, ARENA_SPLIT_BYTES))
    return [provider]


__all__ = ["LIMIT_SESSION_CONFIG", "out_of_memory", "shortfall_bytes", "initializer_bytes", "providers_within"]
