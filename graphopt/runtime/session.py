"""Session settings a plan depends on, stored in the model, and a helper that opens
an ONNX Runtime session the way the plan needs.

A checkpointing plan is only valid for the execution order ONNX Runtime really runs,
and ORT's graph optimizers change that order (see docs/ort-facts.md, section 3). The
settings the plan was made for therefore travel with the model, as JSON in
``model.metadata_props["graphopt.session"]``, so that any consumer (in any language)
can open the session the same way. :func:`open_session` does that for Python users.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Mapping

import onnx
import onnxruntime as ort

from graphopt.errors import InvalidModelError

METADATA_KEY = "graphopt.session"

_OPT_LEVELS = tuple(ort.GraphOptimizationLevel.__members__)
# MEMORY_EFFICIENT exists in the enum but raises on stock (non-training) wheels.
_EXEC_ORDERS = ("DEFAULT", "PRIORITY_BASED")

# Models at or above this serialized size cannot go through protobuf bytes
# (2 GiB limit); they are handed to ORT as a file with external data.
from graphopt.runtime.weights import PROTOBUF_LIMIT_BYTES  # noqa: E402

_FIELDS = (
    "graph_optimization_level",
    "execution_order",
    "disabled_optimizers",
    "session_config",
    "enable_mem_reuse",
    "enable_mem_pattern",
)


def _session_config_tuple(value: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(value, Mapping):
        items = list(value.items())
    else:
        items = [tuple(p) for p in value]
    out = []
    for pair in items:
        if len(pair) != 2:
            raise InvalidModelError(f"session settings: session_config entry {pair!r} is not a (key, value) pair")
        k, v = pair
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidModelError(
                f"session settings: session_config entry {k!r}={v!r} must map a string to a string"
            )
        out.append((k, v))
    return tuple(sorted(out))


@dataclass(frozen=True)
class SessionSettings:
    """How ONNX Runtime must open the model.

    ``session_config`` is stored as a sorted tuple of ``(key, value)`` pairs (so the
    settings stay hashable); a dict is accepted in the constructor and converted.
    :attr:`session_config_dict` gives it back as a dict.
    """

    graph_optimization_level: str = "ORT_ENABLE_ALL"
    execution_order: str = "DEFAULT"
    disabled_optimizers: tuple[str, ...] = ()
    session_config: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    enable_mem_reuse: bool = True
    enable_mem_pattern: bool = True

    def __post_init__(self) -> None:
        if self.graph_optimization_level not in _OPT_LEVELS:
            raise InvalidModelError(
                f"session settings: graph_optimization_level {self.graph_optimization_level!r} "
                f"is not one of {list(_OPT_LEVELS)}"
            )
        if self.execution_order not in _EXEC_ORDERS:
            raise InvalidModelError(
                f"session settings: execution_order {self.execution_order!r} is not one of {list(_EXEC_ORDERS)}"
            )
        if isinstance(self.disabled_optimizers, str) or not all(
            isinstance(x, str) for x in self.disabled_optimizers
        ):
            raise InvalidModelError(
                f"session settings: disabled_optimizers {self.disabled_optimizers!r} must be a list of strings"
            )
        object.__setattr__(self, "disabled_optimizers", tuple(self.disabled_optimizers))
        object.__setattr__(self, "session_config", _session_config_tuple(self.session_config))
        for name in ("enable_mem_reuse", "enable_mem_pattern"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidModelError(f"session settings: {name} {getattr(self, name)!r} must be a boolean")

    @property
    def session_config_dict(self) -> dict[str, str]:
        return dict(self.session_config)

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph_optimization_level": self.graph_optimization_level,
            "execution_order": self.execution_order,
            "disabled_optimizers": list(self.disabled_optimizers),
            "session_config": dict(self.session_config),
            "enable_mem_reuse": self.enable_mem_reuse,
            "enable_mem_pattern": self.enable_mem_pattern,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SessionSettings":
        if not isinstance(d, Mapping):
            raise InvalidModelError(f"session settings: expected a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_FIELDS))
        if unknown:
            raise InvalidModelError(f"session settings: unknown key {unknown[0]!r} (known: {list(_FIELDS)})")
        kw: dict[str, Any] = dict(d)
        if "disabled_optimizers" in kw:
            v = kw["disabled_optimizers"]
            if not isinstance(v, (list, tuple)):
                raise InvalidModelError(f"session settings: disabled_optimizers {v!r} must be a list of strings")
            kw["disabled_optimizers"] = tuple(v)
        if "session_config" in kw:
            v = kw["session_config"]
            if not isinstance(v, (Mapping, list, tuple)):
                raise InvalidModelError(f"session settings: session_config {v!r} must be an object of strings")
        for key in ("graph_optimization_level", "execution_order"):
            if key in kw and not isinstance(kw[key], str):
                raise InvalidModelError(f"session settings: {key} {kw[key]!r} must be a string")
        return cls(**kw)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, s: str | bytes) -> "SessionSettings":
        try:
            d = json.loads(s)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
            raise InvalidModelError(f"session settings: not valid JSON ({e})") from e
        return cls.from_dict(d)


DEFAULT_SETTINGS = SessionSettings()
"""What a user gets from a plain ``onnxruntime.InferenceSession``."""

UNOPTIMIZED_SETTINGS = SessionSettings(graph_optimization_level="ORT_DISABLE_ALL",
                                       enable_mem_pattern=False, enable_mem_reuse=False)
"""Graph optimizations off, ORT's default order, no memory pattern (it costs about one
activation) and no buffer reuse (a reused buffer stays allocated from its last read to its
reuser's: measured 1-15% more, e.g. transformer 149 vs 126 MiB). How graphopt runs a training
graph it has not rewritten: the leanest session for it, and the cost model's rules. The
training-graph builder writes it into the graphs it builds (with ``PRIORITY_BASED`` order into
those with a fused optimizer step, whose file order it chooses)."""


def read_settings(model: onnx.ModelProto) -> SessionSettings | None:
    """The settings stored in ``model.metadata_props[METADATA_KEY]``, or None."""
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            return SessionSettings.from_json(prop.value)
    return None


def write_settings(model: onnx.ModelProto, settings: SessionSettings) -> None:
    """Store ``settings`` in the model's metadata, replacing an existing entry."""
    _set_metadata(model, METADATA_KEY, settings.to_json())


def _set_metadata(model: onnx.ModelProto, key: str, value: str) -> None:
    keep = [(p.key, p.value) for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    for k, v in keep:
        model.metadata_props.add(key=k, value=v)
    model.metadata_props.add(key=key, value=value)


# ONNX Runtime's session config key: "0" makes idle intra-op threads sleep instead of spin
ALLOW_SPINNING_CONFIG = "session.intra_op.allow_spinning"

# what ONNX Runtime raises when it refuses a model at load (bad input, not a fault of graphopt's)
LOAD_ERRORS = (ort.capi.onnxruntime_pybind11_state.Fail,
               ort.capi.onnxruntime_pybind11_state.InvalidGraph,
               ort.capi.onnxruntime_pybind11_state.InvalidArgument,
               ort.capi.onnxruntime_pybind11_state.NoSuchFile,
               ort.capi.onnxruntime_pybind11_state.InvalidProtobuf)


def session_options(
    settings: SessionSettings,
    *,
    threads: int | None = 1,
    arena: bool = False,
    profile_prefix: str | None = None,
    deterministic: bool = False,
    spinning: bool = True,
) -> ort.SessionOptions:
    """SessionOptions for ``settings``.

    ``disabled_optimizers`` cannot be expressed in SessionOptions: ORT takes it as a
    keyword of ``InferenceSession`` (``open_session`` passes it).
    ``threads=None`` leaves ORT's thread defaults. ``spinning=False``: the intra-op threads
    sleep when idle instead of spinning for work (ONNX Runtime's default, kept wherever a step is
    timed); for the runs whose time nobody reads (a peak, a capped run, sizes), which often run
    beside graphopt's other work: their spinning threads took the cores that work needed.
    """
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.__members__[settings.graph_optimization_level]
    so.execution_order = ort.ExecutionOrder.__members__[settings.execution_order]
    so.enable_mem_reuse = settings.enable_mem_reuse
    so.enable_mem_pattern = settings.enable_mem_pattern
    so.enable_cpu_mem_arena = arena
    for k, v in settings.session_config:
        so.add_session_config_entry(k, v)
    if threads is not None:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile_prefix)
    if deterministic:
        so.use_deterministic_compute = True
    if not spinning:
        so.add_session_config_entry(ALLOW_SPINNING_CONFIG, "0")
    so.log_severity_level = 3
    return so


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity; a container's CPU set): the CLI's
    default ONNX Runtime intra-op threads for the runs that judge a plan."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_providers() -> list[str]:
    """CUDAExecutionProvider first when this onnxruntime has it, then CPU."""
    avail = ort.get_available_providers()
    out = []
    if "CUDAExecutionProvider" in avail:
        out.append("CUDAExecutionProvider")
    out.append("CPUExecutionProvider")
    return out


def _load_for_metadata(path: str) -> onnx.ModelProto:
    # Only the metadata is needed: do not pull external tensors into memory.
    return onnx.load(path, load_external_data=False)


def open_session(
    model: onnx.ModelProto | str | os.PathLike,
    settings: SessionSettings | None = None,
    *,
    providers: list | None = None,
    threads: int | None = 1,
    arena: bool = False,
    profile_prefix: str | None = None,
    deterministic: bool = False,
    cap_bytes: int | None = None,
    spinning: bool = True,
    weights_folder: str | os.PathLike | None = None,
) -> ort.InferenceSession:
    """Open an ORT session as the plan needs.

    ``settings=None`` reads them from the model's metadata, else uses
    :data:`DEFAULT_SETTINGS`. ``cap_bytes``: the session may hold at most that many bytes
    on its provider's device (graphopt/runtime/limit.py: a capped arena, prepacking off);
    a ``run`` that needs more fails with ONNX Runtime's "Available memory of ..." error. ``model`` may be a ModelProto or a path (use a path,
    with external data, for models over 2 GB; a ModelProto that big is written to a
    temporary directory with external data first). ``weights_folder``: where the external data a
    ModelProto references is (a model loaded without it, from that folder).
    """
    is_path = isinstance(model, (str, os.PathLike))
    if settings is None:
        meta_model = _load_for_metadata(os.fspath(model)) if is_path else model
        settings = read_settings(meta_model) or DEFAULT_SETTINGS
    if providers is None:
        providers = default_providers()
    if cap_bytes is not None:
        from .limit import LIMIT_SESSION_CONFIG, providers_within
        first = providers[0] if isinstance(providers[0], str) else providers[0][0]
        settings = dataclasses.replace(settings, session_config=dict(settings.session_config) | dict(LIMIT_SESSION_CONFIG))
        providers = providers_within(first, cap_bytes)
        arena = True
    so = session_options(
        settings, threads=threads, arena=arena, profile_prefix=profile_prefix, deterministic=deterministic,
        spinning=spinning,
    )
    if cap_bytes is not None:
        so.log_severity_level = 4   # an allocation refused under the cap is the caller's to report
    kwargs: dict[str, Any] = {}
    if weights_folder is not None and not is_path:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", os.fspath(weights_folder))
    if settings.disabled_optimizers:
        kwargs["disabled_optimizers"] = list(settings.disabled_optimizers)
    try:
        if is_path:
            return ort.InferenceSession(os.fspath(model), so, providers=providers, **kwargs)
        from graphopt.runtime.weights import Weights, model_bytes, save_model
        if model_bytes(model) < PROTOBUF_LIMIT_BYTES:
            return ort.InferenceSession(model.SerializeToString(), so, providers=providers, **kwargs)
        tmp = tempfile.mkdtemp(prefix="graphopt-model-")
        try:
            path = os.path.join(tmp, "model.onnx")
            # (references under weights_folder copied beside it: the file is read from its own folder)
            save_model(model, path, Weights(folder=os.fspath(weights_folder) if weights_folder else None))
            return ort.InferenceSession(path, so, providers=providers, **kwargs)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except LOAD_ERRORS as e:
        raise InvalidModelError(f"onnxruntime cannot load the model: {e}") from e
