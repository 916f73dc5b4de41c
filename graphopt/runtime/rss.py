"""Resident-memory probes of the current process (Linux /proc), shared by the measuring
workers: peak RSS since a reset, the process's own peak over its life (what graphopt reports
of its own memory), and returning freed heap to the OS."""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import threading

# the highest VmHWM seen before a reset (KiB): the process's peak over its life
_PEAK_BEFORE_RESETS_KB = 0
# a one-session child's RSS when its session began (`mark_session_start`), and the highest VmHWM
# seen since, before later resets (KiB)
_SESSION_START_KB: int | None = None
_SESSION_PEAK_KB = 0


def status_kb(field: str) -> int | None:
    """A field of /proc/self/status in KiB (e.g. "VmRSS", "VmHWM"), None when unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int | None:
    """This process's peak RSS since it started or since the last reset, None when unreadable."""
    kib = status_kb("VmHWM")
    return None if kib is None else kib * 1024


def malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc), so RSS shows what is live."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; False if not possible.
    The peak before is kept for `process_peak_bytes` (and `session_footprint`)."""
    global _PEAK_BEFORE_RESETS_KB, _SESSION_PEAK_KB
    hwm = status_kb("VmHWM") or 0
    _PEAK_BEFORE_RESETS_KB = max(_PEAK_BEFORE_RESETS_KB, hwm)
    if _SESSION_START_KB is not None:
        _SESSION_PEAK_KB = max(_SESSION_PEAK_KB, hwm)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return status_kb("VmHWM") is not None


def process_peak_bytes() -> int | None:
    """This process's peak RSS over its whole life (resets of VmHWM included), None when
    unreadable."""
    kib = status_kb("VmHWM")
    return None if kib is None else max(kib, _PEAK_BEFORE_RESETS_KB) * 1024


# -- the peaks of graphopt's child processes, while `tracking_children` is open -------------------

@dataclasses.dataclass
class ChildPeaks:
    """What graphopt's child processes reported of their memory during one call.

    ``by_kind``: the largest peak RSS of a child of each kind (annotate, measure, timing ...).
    ``largest_session_bytes``: the largest footprint of ONE session in a process that held only
    it (the measuring, timing and limit children): the growth of that process's RSS from just
    before the session opened to the process's peak, i.e. the weights as ONNX Runtime holds
    them, its structures, the inputs and the steps, in the allocator set-up that child runs
    (a timing child: ONNX Runtime's arena on, as a plain session has it).
    ``baseline_bytes``: the largest RSS of a child after its imports, before it loaded anything
    (the interpreter, numpy, onnx, onnxruntime and graphopt)."""
    by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    largest_session_bytes: int = 0
    largest_session: str | None = None      # the kind of child that ran it
    baseline_bytes: int = 0


_CHILD_PEAKS: contextvars.ContextVar[ChildPeaks | None] = contextvars.ContextVar("graphopt_child_peaks", default=None)
_RECORD_LOCK = threading.Lock()   # children end in more than one thread (runtime/overlap.py)


@contextlib.contextmanager
def tracking_children():
    """Collect what every child process reports of its memory (`record_child`) while open:
    yields a `ChildPeaks`."""
    peaks = ChildPeaks()
    token = _CHILD_PEAKS.set(peaks)
    try:
        yield peaks
    finally:
        _CHILD_PEAKS.reset(token)


def record_child(kind: str, result: dict) -> None:
    """Note what a child reported in its result, if tracking: its peak (``process_peak_bytes``),
    the footprint of its one session (``session_bytes``) and its RSS after imports
    (``start_bytes``)."""
    peaks = _CHILD_PEAKS.get()
    if peaks is None or not isinstance(result, dict):
        return
    value = result.get("process_peak_bytes")
    session = int(result.get("session_bytes") or 0)
    with _RECORD_LOCK:
        if value:
            peaks.by_kind[kind] = max(peaks.by_kind.get(kind, 0), int(value))
        if session > peaks.largest_session_bytes:
            peaks.largest_session_bytes, peaks.largest_session = session, kind
        peaks.baseline_bytes = max(peaks.baseline_bytes, int(result.get("start_bytes") or 0))


def rss_bytes() -> int | None:
    """This process's resident memory now, None when unreadable."""
    kib = status_kb("VmRSS")
    return None if kib is None else kib * 1024


def mark_session_start() -> None:
    """Called by a one-session child just before it opens its session: from here its peak is the
    session's (`session_footprint`); what the process peaked at before (imports, a model read
    for its metadata) is not."""
    global _SESSION_START_KB, _SESSION_PEAK_KB
    if reset_peak_rss():
        _SESSION_START_KB, _SESSION_PEAK_KB = status_kb("VmRSS"), 0


def session_footprint() -> dict:
    """The memory fields a one-session child reports at its end (see `ChildPeaks`): its peak,
    and the growth from its RSS when the session began (`mark_session_start`) to the highest
    it reached since (absent where VmHWM cannot be reset)."""
    out = {"process_peak_bytes": process_peak_bytes()}
    hwm = status_kb("VmHWM")
    if _SESSION_START_KB is not None and hwm is not None:
        out["session_bytes"] = max(0, max(_SESSION_PEAK_KB, hwm) - _SESSION_START_KB) * 1024
    return out
