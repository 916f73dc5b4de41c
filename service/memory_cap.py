"""A worker's memory limit enforced by the kernel, not by a poll (issue 27).

Each worker (and so each job: a worker runs one at a time) gets its own cap, the first of
these that this server process may create:

- ``cgroup2``: a child of this process's cgroup v2 group, with ``memory.max`` = the limit,
  ``memory.swap.max`` = 0 and ``memory.oom.group`` = 1 (where the parent delegates the memory
  controller: containers and Kubernetes pods that give their process a writable group);
- ``cgroup1``: a child of this process's group in the v1 memory hierarchy, with
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap is accounted);
- ``rlimit``: ``RLIMIT_DATA`` on the worker, inherited by every process it starts: each
  process's heap and anonymous mappings are bounded by the limit (an allocation past it fails
  at once), but not their sum, so the server still polls the sum (workers.py).

The worker enters its cap first thing (``enter_from_environment``, before its imports), so
every page of it, its warm measuring parent and their children is charged to the group. When
the group reaches the limit the kernel reclaims, then kills (the whole group under cgroup v2;
the largest process under v1, mostly the ONNX Runtime run); its count of such kills
(``oom_kills``) is how the pool learns that a job ended over the limit. ``peak_bytes`` is the
kernel's own high-water mark of the group.
"""
from __future__ import annotations

import itertools
import os
import resource
import time

CGROUP_ENV = "GRAPHOPT_WORKER_CGROUP"          # the group's folder: the worker writes its pid there
RLIMIT_ENV = "GRAPHOPT_WORKER_RLIMIT_DATA"     # bytes: the worker sets RLIMIT_DATA to that
DISABLE_ENV = "GRAPHOPT_KERNEL_MEMORY_CAP"     # "0": no kernel cap, the poll alone (as before)
CGROUP_ROOT = "/sys/fs/cgroup"
GROUP_PREFIX = "graphopt-worker-"   # then the server's pid and a count
_names = itertools.count()


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def _own_group(hierarchy: str) -> str | None:
    """This process's group in the v2 hierarchy ("") or the v1 one holding `hierarchy`'s
    controller, as a path under its mount; None when it has none."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if (hierarchy == "" and controllers == "") or hierarchy in controllers.split(","):
                    return path
    except OSError:
        return None
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _sweep_stale(parent: str) -> None:
    """Remove the empty groups of servers that are gone (killed before they could remove them):
    GROUP_PREFIX, then the server's pid."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(GROUP_PREFIX):
            continue
        pid = name[len(GROUP_PREFIX):].partition("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.rmdir(os.path.join(parent, name))   # refused while processes are still in it
            except OSError:
                pass


class MemoryCap:
    """One worker's kernel-enforced memory limit (see the module's docstring)."""

    def __init__(self, kind: str, limit_bytes: int, folder: str | None = None):
        self.kind, self.limit_bytes, self.folder = kind, limit_bytes, folder

    @classmethod
    def create(cls, limit_bytes: int) -> "MemoryCap":
        """The first cap this process may create: cgroup v2, cgroup v1, else RLIMIT_DATA."""
        if os.environ.get(DISABLE_ENV) != "0":
            for make in (cls._cgroup2, cls._cgroup1):
                try:
                    cap = make(limit_bytes)
                except OSError:
                    cap = None
                if cap is not None:
                    return cap
        return cls("rlimit", limit_bytes)

    @classmethod
    def _new_folder(cls, parent: str) -> str:
        _sweep_stale(parent)
        folder = os.path.join(parent, f"{GROUP_PREFIX}{os.getpid()}-{next(_names)}")
        os.mkdir(folder)
        return folder

    @classmethod
    def _cgroup2(cls, limit_bytes: int) -> "MemoryCap | None":
        own = _own_group("")
        if own is None:
            return None
        parent = os.path.join(CGROUP_ROOT, own.lstrip("/"))
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                if "memory" not in f.read().split():
                    return None
        except OSError:
            return None
        folder = cls._new_folder(parent)
        try:
            _write(os.path.join(folder, "memory.max"), str(limit_bytes))
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if os.path.exists(os.path.join(folder, name)):
                    _write(os.path.join(folder, name), value)
        except OSError:
            os.rmdir(folder)
            raise
        return cls("cgroup2", limit_bytes, folder)

    @classmethod
    def _cgroup1(cls, limit_bytes: int) -> "MemoryCap | None":
        own = _own_group("memory")
        mount = os.path.join(CGROUP_ROOT, "memory")
        if own is None or not os.path.isdir(mount):
            return None
        folder = cls._new_folder(os.path.join(mount, own.lstrip("/")))
        try:
            _write(os.path.join(folder, "memory.limit_in_bytes"), str(limit_bytes))
            swap = os.path.join(folder, "memory.memsw.limit_in_bytes")
            if os.path.exists(swap):
                _write(swap, str(limit_bytes))   # memory and swap together: no swap beyond the limit
        except OSError:
            os.rmdir(folder)
            raise
        return cls("cgroup1", limit_bytes, folder)

    @property
    def enforced_by_kernel_for_the_sum(self) -> bool:
        """Whether the kernel bounds the worker's processes together (a group), not each alone."""
        return self.kind in ("cgroup1", "cgroup2")

    def worker_environment(self) -> dict[str, str]:
        """What the worker reads at start to enter this cap (`enter_from_environment`)."""
        if self.folder is not None:
            return {CGROUP_ENV: self.folder}
        return {RLIMIT_ENV: str(self.limit_bytes)}

    def oom_kills(self) -> int:
        """The processes the kernel has killed in this group for its limit (0 for rlimit)."""
        if self.folder is None:
            return 0
        name = "memory.events" if self.kind == "cgroup2" else "memory.oom_control"
        try:
            with open(os.path.join(self.folder, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def peak_bytes(self) -> int | None:
        """The kernel's high-water mark of the group's memory (None: not a group, or not kept)."""
        if self.folder is None:
            return None
        name = "memory.peak" if self.kind == "cgroup2" else "memory.max_usage_in_bytes"
        return _read_int(os.path.join(self.folder, name))

    def close(self, attempts: int = 50) -> None:
        """Remove the group once its processes are gone (the worker was killed: the kernel may
        take a moment to let go of it)."""
        if self.folder is None:
            return
        for _ in range(attempts):
            try:
                os.rmdir(self.folder)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)


def enter_from_environment() -> int | None:
    """In the worker, first thing: join the group named by CGROUP_ENV, or set RLIMIT_DATA to
    RLIMIT_ENV's bytes. Returns the RLIMIT_DATA bytes set (None for a group or no cap): under
    that cap an allocation past the limit fails in the process that asks (`allocation_failed`)."""
    folder = os.environ.pop(CGROUP_ENV, None)
    if folder:
        _write(os.path.join(folder, "cgroup.procs"), str(os.getpid()))
        return None
    limit = os.environ.pop(RLIMIT_ENV, None)
    if limit:
        resource.setrlimit(resource.RLIMIT_DATA, (int(limit), int(limit)))
        return int(limit)
    return None


# how a failed allocation reads: Python's MemoryError, C++'s std::bad_alloc (ONNX Runtime's
# kernels), ONNX Runtime's own allocators
ALLOCATION_FAILURES = ("MemoryError", "std::bad_alloc", "Failed to allocate memory")


def allocation_failed(exc: BaseException) -> str | None:
    """How `exc` (or an error in its chain, a measuring process's included, whose text the
    library passes on) says that an allocation failed (one of ALLOCATION_FAILURES), else None."""
    seen = exc
    while seen is not None:
        if isinstance(seen, MemoryError):
            return "MemoryError"
        for text in ALLOCATION_FAILURES:
            if text in str(seen):
                return text
        seen = seen.__cause__ or seen.__context__
    return None
