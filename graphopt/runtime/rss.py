"""Resident-memory probes of the current process (Linux /proc), shared by the measuring
workers: peak RSS since a reset, and returning freed heap to the OS."""
from __future__ import annotations

import ctypes


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
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return status_kb("VmHWM") is not None
