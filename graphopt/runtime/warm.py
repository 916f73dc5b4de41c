"""Warm measuring processes: every ONNX Runtime run of graphopt still happens in a process of
its own (its step, and whatever its allocator kept, go back to the OS with it), but that
process is forked from a warm parent that has already imported Python, numpy, onnx,
onnxruntime and graphopt's workers, instead of starting a fresh interpreter each time (about
0.45 s each on this project's 2-core machine; an ``optimize`` runs a dozen or more).

    run_module("graphopt.tasks", ["annotate"], input=..., env=...)
    popen_module("graphopt.runtime._timing_worker", [spec, "0"], env=..., stderr=file)

A worker module exposes ``main(argv) -> int``; the child runs it with the caller's
environment (sent with each request) and its own stdin, stdout and stderr, then exits.
glibc's allocator settings (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) are read
at process start, so in a forked child they are applied with ``mallopt``; the warm parent
itself runs with glibc's defaults.

One warm parent per process that uses it, started on first use and again if it died; it
lives in its caller's process group (a service worker that kills its group kills it and its
children too) and exits when its caller closes the connection, killing what it still runs.
``GRAPHOPT_WARM_PROCESSES=0`` (or a parent that cannot start) runs each worker in a fresh
interpreter as before.

The parent is a single-threaded loop over one Unix socket: a request (JSON, with the child's
stdin, stdout, stderr and a status pipe as file descriptors) is answered with the child's
pid; when the child ends, the parent reaps it and writes its exit code (negative: the signal
that ended it) and its CPU seconds into its status pipe, which is how ``wait`` learns them
(`children_cpu_seconds` adds those up).
"""
from __future__ import annotations

import atexit
import ctypes
import importlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback

SWITCH_ENV = "GRAPHOPT_WARM_PROCESSES"   # "0": a fresh interpreter per worker
# what the warm parent imports before it forks anything: the libraries and this package's
# workers, and the worker modules of the layers above that `preload` named before it started
PRELOADED_MODULES = [
    "numpy", "onnx", "onnxruntime", "graphopt.runtime.session",
    "graphopt.runtime.offline", "graphopt.runtime.limit", "graphopt.runtime._measure_worker",
    "graphopt.runtime._timing_worker", "graphopt.runtime._limit_worker",
]
# glibc's allocator settings read from the environment at start, and their mallopt parameters
MALLOC_ENV_PARAMETERS = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3}
START_TIMEOUT_SECONDS = 120.0
# the exit code `wait` reports for a child whose parent died before it could say how it ended
LOST_RETURNCODE = -int(signal.SIGKILL)


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def preload(*modules: str) -> None:
    """Have the warm parent import `modules` (worker modules of the layers above this package)
    before it forks anything. A parent already started keeps what it has: its children import
    the rest themselves."""
    for name in modules:
        if name not in PRELOADED_MODULES:
            PRELOADED_MODULES.append(name)


def cold_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a fresh interpreter: graphopt importable from where this copy of it lies."""
    env = dict(env)
    root = _package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# -- the caller's side ------------------------------------------------------------------------------

_CHILDREN_CPU_SECONDS = [0.0]
_CHILDREN_CPU_LOCK = threading.Lock()


def _add_children_cpu(seconds: float) -> None:
    with _CHILDREN_CPU_LOCK:
        _CHILDREN_CPU_SECONDS[0] += seconds


def children_cpu_seconds() -> float:
    """User and system CPU seconds of the warm children this process has waited for (they are
    the warm parent's children, so `os.times` of this process does not count them)."""
    with _CHILDREN_CPU_LOCK:
        return _CHILDREN_CPU_SECONDS[0]


class WarmProcess:
    """A child forked by the warm parent: the parts of ``subprocess.Popen`` graphopt uses."""

    def __init__(self, args, pid: int, status_fd: int, stdin=None, stdout=None):
        self.args, self.pid, self._status_fd = args, pid, status_fd
        self.stdin, self.stdout = stdin, stdout
        self.returncode: int | None = None
        self._lock = threading.Lock()   # a timer may kill it while another thread waits

    def _read_status(self, timeout_seconds: float | None) -> bool:
        with self._lock:
            if self.returncode is not None:
                return True
            poller = select.poll()
            poller.register(self._status_fd, select.POLLIN)
            if not poller.poll(None if timeout_seconds is None else max(0, int(timeout_seconds * 1000))):
                return False
            self._take_status()
            return True

    def _take_status(self) -> None:
        data = b""
        while not data.endswith(b"\n"):
            chunk = os.read(self._status_fd, 64)
            if not chunk:
                break
            data += chunk
        os.close(self._status_fd)
        fields = data.split()
        self.returncode = int(fields[0]) if fields else LOST_RETURNCODE
        if len(fields) > 1:
            _add_children_cpu(float(fields[1]))

    def poll(self) -> int | None:
        self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._read_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        # without the lock: another thread may be waiting on the status (holding it) for this end
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __del__(self):
        if self.returncode is None:
            try:
                os.close(self._status_fd)
            except OSError:
                pass


class WarmParent:
    """The warm parent process and the connection to it."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = cold_env({k: v for k, v in os.environ.items() if k not in MALLOC_ENV_PARAMETERS})
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "graphopt.runtime.warm", str(theirs.fileno()),
                                          *PRELOADED_MODULES],
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self._sock = ours
        self._reader = ours.makefile("rb")
        self._lock = threading.Lock()
        ours.settimeout(START_TIMEOUT_SECONDS)
        try:
            hello = json.loads(self._reader.readline() or b"null")
        except (OSError, ValueError):
            hello = None
        ours.settimeout(None)
        if not isinstance(hello, dict) or "ready" not in hello:
            self.close()
            raise RuntimeError(f"the warm parent did not start (exit {self.proc.poll()})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, module: str, argv: list[str], env: dict[str, str], stdin: int, stdout: int, stderr: int,
              stdin_file=None, stdout_file=None) -> WarmProcess:
        status_read, status_write = os.pipe()
        request = json.dumps({"module": module, "argv": list(argv), "env": dict(env), "cwd": os.getcwd()})
        try:
            with self._lock:
                socket.send_fds(self._sock, [request.encode() + b"\n"], [stdin, stdout, stderr, status_write])
                reply = json.loads(self._reader.readline() or b"null")
        except BaseException:
            os.close(status_read)
            raise
        finally:
            os.close(status_write)
        if not isinstance(reply, dict) or "pid" not in reply:
            os.close(status_read)
            raise RuntimeError(f"the warm parent did not start {module}: {reply}")
        return WarmProcess([module, *argv], int(reply["pid"]), status_read, stdin_file, stdout_file)

    def close(self) -> None:
        try:
            self._reader.close()   # the socket's descriptor stays open while its file object is
            self._sock.close()
        finally:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_PARENT: WarmParent | None = None
_PARENT_PID: int | None = None
_PARENT_LOCK = threading.Lock()
_ATEXIT_REGISTERED: list[bool] = []


def warm_parent() -> WarmParent | None:
    """This process's warm parent (started on first use, again if it died); None when switched
    off or when it cannot start (each worker then runs in a fresh interpreter)."""
    global _PARENT, _PARENT_PID
    if os.environ.get(SWITCH_ENV, "1") == "0" or not hasattr(os, "fork"):
        return None
    with _PARENT_LOCK:
        if _PARENT is not None and _PARENT_PID == os.getpid() and _PARENT.alive():
            return _PARENT
        if _PARENT is not None and _PARENT_PID == os.getpid():
            _PARENT.close()
        _PARENT = None
        try:
            _PARENT, _PARENT_PID = WarmParent(), os.getpid()
            if not _ATEXIT_REGISTERED:
                # a caller that ends waits for its warm parent to end (a CLI leaves nothing behind)
                atexit.register(stop_warm_parent)
                _ATEXIT_REGISTERED.append(True)
        except (OSError, RuntimeError) as e:
            print(f"graphopt: no warm parent ({e}); each run starts a fresh interpreter", file=sys.stderr)
            return None
        return _PARENT


def stop_warm_parent() -> None:
    """End this process's warm parent (a later run starts another)."""
    global _PARENT
    with _PARENT_LOCK:
        if _PARENT is not None and _PARENT_PID == os.getpid():
            _PARENT.close()
        _PARENT = None


def run_module(module: str, argv: list[str], *, input: str | None = None, env: dict[str, str] | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """``python -m module *argv`` with ``input`` on its stdin, its stdout and stderr captured as
    text: forked from the warm parent, else in a fresh interpreter. Raises
    ``subprocess.TimeoutExpired`` (with the stderr so far) after ``timeout`` seconds, the child
    killed."""
    env = dict(os.environ if env is None else env)
    parent = warm_parent()
    if parent is None:
        return subprocess.run([sys.executable, "-m", module, *argv], input=input, capture_output=True, text=True,
                              timeout=timeout, env=cold_env(env))
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stdout, \
            tempfile.TemporaryFile() as stderr:
        if input is not None:
            stdin.write(input.encode())
            stdin.seek(0)
        child = parent.spawn(module, argv, env, stdin.fileno(), stdout.fileno(), stderr.fileno())

        def text(f) -> str:
            f.seek(0)
            return f.read().decode(errors="replace")
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise subprocess.TimeoutExpired(child.args, timeout, output=text(stdout), stderr=text(stderr)) from None
        return subprocess.CompletedProcess(child.args, child.returncode, text(stdout), text(stderr))


def popen_module(module: str, argv: list[str], *, env: dict[str, str] | None = None, stderr=None):
    """``python -m module *argv`` with text pipes to its stdin and stdout and ``stderr`` (a file)
    as its stderr: a ``WarmProcess`` forked from the warm parent, else a ``subprocess.Popen``."""
    env = dict(os.environ if env is None else env)
    parent = warm_parent()
    if parent is None:
        return subprocess.Popen([sys.executable, "-m", module, *argv], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=cold_env(env))
    stdin_read, stdin_write = os.pipe()
    stdout_read, stdout_write = os.pipe()
    errfd = stderr.fileno() if stderr is not None else 2
    try:
        child = parent.spawn(module, argv, env, stdin_read, stdout_write, errfd,
                             io.TextIOWrapper(io.FileIO(stdin_write, "w"), write_through=True),
                             io.TextIOWrapper(io.FileIO(stdout_read, "r")))
    except BaseException:
        os.close(stdin_write)
        os.close(stdout_read)
        raise
    finally:
        os.close(stdin_read)
        os.close(stdout_write)
    return child


# -- the warm parent --------------------------------------------------------------------------------

def _mallopt(env: dict[str, str]) -> None:
    """The allocator settings `env` asks glibc for, applied in this (forked) process."""
    wanted = {key: value for key, value in env.items() if key in MALLOC_ENV_PARAMETERS}
    if not wanted:
        return
    libc = ctypes.CDLL("libc.so.6")
    for key, value in wanted.items():
        if not libc.mallopt(MALLOC_ENV_PARAMETERS[key], int(value)):
            raise OSError(f"mallopt({key}={value}) failed")


def _file_pages_present() -> list[tuple[int, int]]:
    """(address, length) runs of this process's file-backed pages that are mapped (resident in
    its page tables), from /proc/self/pagemap; [] where it cannot be read."""
    runs: list[tuple[int, int]] = []
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
            for line in maps:
                fields = line.split()
                if len(fields) < 6 or not fields[5].startswith("/") or "r" not in fields[1]:
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                pagemap.seek(start // page * 8)
                entries = pagemap.read((end - start) // page * 8)
                run_start = None
                for i in range(len(entries) // 8):
                    present = entries[8 * i + 7] & 0x80
                    address = start + i * page
                    if present and run_start is None:
                        run_start = address
                    elif not present and run_start is not None:
                        runs.append((run_start, address - run_start))
                        run_start = None
                if run_start is not None:
                    runs.append((run_start, end - run_start))
    except OSError:
        return []
    return runs


MADV_POPULATE_READ = 22   # Linux 5.14+


def _map_file_pages(runs: list[tuple[int, int]]) -> None:
    """Map in this forked child the file pages its parent had mapped (fork copies the page
    tables of private writable memory, not those of file mappings such as the libraries' code):
    the child starts as a process that did the imports itself, and what its session faults in
    is the session's, not libraries the parent had already touched (a timing child's session
    measured 46.5 MiB forked without this, 38.3 MiB in a fresh interpreter)."""
    if not runs:
        return
    madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for address, length in runs:
        madvise(address, length, MADV_POPULATE_READ)   # best effort: an older kernel leaves them unmapped


def _child(request: dict, fds: list[int], inherited: list[int], file_pages: list[tuple[int, int]]) -> None:
    """In the forked child: become the worker `request` names; never returns."""
    code = 1
    try:
        _map_file_pages(file_pages)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        os.close(fds[3])     # the status pipe is the parent's to write
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in set(fds[:3]):
            if fd > 2:
                os.close(fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False))
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        os.environ.clear()
        os.environ.update(request["env"])
        _mallopt(request["env"])
        os.chdir(request["cwd"])
        module = importlib.import_module(request["module"])
        sys.argv = [module.__file__, *request["argv"]]
        code = module.main(list(request["argv"]))
        code = 0 if code is None else int(code)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(fd: int, preloaded: list[str]) -> int:
    """The warm parent's loop on the connected socket `fd`, once it has imported `preloaded`."""
    sock = socket.socket(fileno=fd)
    for name in preloaded:
        importlib.import_module(name)
    file_pages = _file_pages_present()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    status_of: dict[int, int] = {}     # running child -> the write end of its status pipe
    sock.sendall(json.dumps({"ready": os.getpid()}).encode() + b"\n")
    pending, pending_fds = b"", []
    try:
        while True:
            try:
                readable, _, _ = select.select([sock, wake_read], [], [])
            except InterruptedError:
                continue
            if wake_read in readable:
                os.read(wake_read, 4096)
                while status_of:
                    try:
                        pid, status, usage = os.wait4(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    out = status_of.pop(pid, None)
                    if out is not None:
                        try:
                            os.write(out, b"%d %.6f\n" % (os.waitstatus_to_exitcode(status),
                                                           usage.ru_utime + usage.ru_stime))
                        except OSError:
                            pass
                        os.close(out)
            if sock in readable:
                data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
                if not data:
                    return 0
                pending += data
                pending_fds += fds
                if b"\n" not in pending:
                    continue
                line, pending = pending.split(b"\n", 1)
                fds, pending_fds = pending_fds, []
                try:
                    request = json.loads(line)
                    if len(fds) != 4:
                        raise ValueError(f"a request carries 4 file descriptors, not {len(fds)}")
                except ValueError as e:
                    for received in fds:
                        os.close(received)
                    sock.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(request, fds, [sock.fileno(), wake_read, wake_write, *status_of.values()], file_pages)
                for received in fds[:3]:
                    os.close(received)
                status_of[pid] = fds[3]
                sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    finally:
        for pid in status_of:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), sys.argv[2:]))
