"""Resident-memory probes of the current process (Linux /proc), shared by the measuring
workers: peak RSS since a reset, the process's own peak over its life (what graphopt reports
of its own memory), and returning freed heap to the OS."""
from __future__ import annotations

import contextlib
import contextvars
import ctypes

# the highest VmHWM seen before a reset (KiB): the process's peak over its life
_PEAK_BEFORE_RESETS_KB = 0


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
    The peak before is kept for `process_peak_bytes`."""
    global _PEAK_BEFORE_RESETS_KB
    _PEAK_BEFORE_RESETS_KB = max(_PEAK_BEFORE_RESETS_KB, status_kb("VmHWM") or 0)
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


# -- the peaks of graphopt's child processes, per kind, while `tracking_children` is open -------
_CHILD_PEAKS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("graphopt_child_peaks", default=None)


@contextlib.contextmanager
def tracking_children():
    """Collect the peak RSS every child process reports (`record_child`) while open: yields a
    dict {kind: the largest peak in bytes of a child of that kind}."""
    peaks: dict[str, int] = {}
    token = _CHILD_PEAKS.set(peaks)
    try:
        yield peaks
    finally:
        _CHILD_PEAKS.reset(token)


def record_child(kind: str, result: dict) -> None:
    """Note the peak a child reported in its result (``process_peak_bytes``), if tracking."""
    peaks = _CHILD_PEAKS.get()
    value = result.get("process_peak_bytes") if isinstance(result, dict) else None
    if peaks is not None and value:
        peaks[kind] = max(peaks.get(kind, 0), int(value))
