"""Worker processes for the CPU-heavy work, so that the server's threads stay free to answer
health checks and new calls; admission with a bounded queue; stopping work by killing.

Each worker is a `python -m graphopt_service.worker` process in its own process group (the
measuring subprocesses it starts are in that group too). A job whose call is cancelled, whose
deadline passes, that runs past the server's job time limit or whose processes use more memory
than the server's limit per job, kills the group; a fresh worker takes its place. A worker
found dead while idle is replaced before it is handed a call. A worker kills its own group when
its server dies (worker.py: the end of its stdin).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from .memory_cap import MemoryCap, human_bytes
from .status import (CallCancelledError, JobMemoryError, JobTimeoutError, QueueFullError, ShuttingDownError,
                     WorkerFailedError)

log = logging.getLogger(__name__)
POLL_SECONDS = 0.1
WORKER_START_SECONDS = 120.0   # a worker's imports and warm parent, on a loaded machine
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc/PID/task/TID/children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{current}/task/{tid}/children") as f:
                    todo.extend(int(child) for child in f.read().split())
            except OSError:
                pass
    return found


def _process_bytes(pid: int) -> int:
    """One process's share of resident memory: its proportional set size (a page shared by n
    processes counts 1/n in each; measuring processes are forked from a warm parent and share
    its imported libraries), else its resident set when smaps_rollup cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0   # it ended meanwhile


def resident_bytes(pid: int) -> int:
    """The resident memory of `pid` and all its descendants (a worker, its warm parent and its
    measuring processes), each page counted once (`_process_bytes`)."""
    return sum(_process_bytes(process) for process in process_tree(pid))


class Worker:
    def __init__(self, env: dict[str, str] | None = None, memory_bytes: int | None = None):
        # its memory limit, enforced by the kernel (memory_cap.py): the worker enters it first thing
        self.memory_cap = MemoryCap.create(memory_bytes) if memory_bytes is not None else None
        if self.memory_cap is not None:
            env = {**(os.environ if env is None else env), **self.memory_cap.worker_environment()}
        # the end of its stdin (this process gone: no one holds the pipe's write end) makes the
        # worker kill its process group, measuring processes included (worker.py)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "graphopt_service.worker"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         start_new_session=True, env=env)
        except BaseException:
            if self.memory_cap is not None:
                self.memory_cap.close(attempts=1)
            raise
        if self.memory_cap is not None:
            log.info("worker memory cap", extra={"fields": {"worker_pid": self.proc.pid, "memory_cap": self.memory_cap.kind,
                                                            "cgroup": self.memory_cap.folder,
                                                            "memory_limit_bytes": self.memory_cap.limit_bytes}})
        self._buffer = bytearray()
        self.ready = False   # it said so (its imports are done)
        # what the libraries print in the worker becomes structured log lines of the server
        threading.Thread(target=self._forward_stderr, name=f"worker-{self.proc.pid}-stderr", daemon=True).start()

    def _forward_stderr(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            if line:
                log.warning("worker output", extra={"fields": {"worker_pid": self.proc.pid, "line": line}})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, job: dict) -> None:
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()

    def read_event(self, timeout_seconds: float) -> dict | None:
        """The next message, or None when none arrived in time; EOFError when the worker died."""
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout_seconds)
            if not ready:
                return None
            data = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not data:
                raise EOFError
            self._buffer += data
        line, _, rest = bytes(self._buffer).partition(b"\n")
        self._buffer = bytearray(rest)
        return json.loads(line)

    def wait_ready(self, timeout_seconds: float) -> None:
        """Until the worker says it is ready (its imports done, its warm measuring parent
        started); WorkerFailedError when it dies or takes longer."""
        deadline = time.monotonic() + timeout_seconds
        while not self.ready:
            left = deadline - time.monotonic()
            try:
                event = self.read_event(max(0.0, left)) if left > 0 else None
            except EOFError:
                raise WorkerFailedError(f"a worker process failed to start (exit code {self.proc.wait()})") from None
            if event is None:
                raise WorkerFailedError(f"a worker process did not start within {timeout_seconds:g} s")
            self.ready = "ready" in event

    def kill(self) -> None:
        if self.proc.returncode is not None and self.proc.stdin.closed:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):  # stderr closes with its reader
            try:
                stream.close()
            except OSError:
                pass
        if self.memory_cap is not None:
            self.memory_cap.close()


class WorkerPool:
    """`size` workers; at most `size + queue_limit` calls admitted at once (waiting, working or
    sending back; a call is admitted once its upload is complete); more are refused with
    QueueFullError. Uploads in progress are counted apart (`uploading`), up to `upload_limit`.

    `job_seconds` bounds one job's time on a worker, `job_memory_bytes` the resident memory of a
    worker and its measuring processes while it works on a job (None: no limit)."""

    def __init__(self, size: int, queue_limit: int, env: dict[str, str] | None = None, *,
                 upload_limit: int | None = None, job_seconds: float | None = None,
                 job_memory_bytes: int | None = None):
        if size < 1 or queue_limit < 0:
            raise ValueError("a pool needs at least one worker and a queue limit of at least 0")
        self.size, self.queue_limit, self._env = size, queue_limit, env
        self.upload_limit = upload_limit if upload_limit is not None else size + queue_limit
        self.job_seconds, self.job_memory_bytes = job_seconds, job_memory_bytes
        self._cond = threading.Condition()
        self._idle = [Worker(env, job_memory_bytes) for _ in range(size)]
        self._all = set(self._idle)   # idle and busy
        try:
            for worker in self._idle:    # they start together; the first calls find them ready
                worker.wait_ready(WORKER_START_SECONDS)
        except BaseException:
            for worker in self._idle:
                worker.kill()
            raise
        self._uploading = 0
        self._line: collections.deque = collections.deque()   # calls waiting for a worker, in order
        self._admitted = 0
        self._closed = False

    @property
    def admitted(self) -> int:
        return self._admitted

    @property
    def uploading(self) -> int:
        return self._uploading

    @contextmanager
    def upload_slot(self):
        """One upload in progress; QueueFullError when `upload_limit` are."""
        with self._cond:
            if self._closed:
                raise ShuttingDownError("the server is shutting down and takes no new work")
            if self._uploading >= self.upload_limit:
                raise QueueFullError(f"{self.upload_limit} uploads are in progress, the most this server "
                                     "takes at once; try again later")
            self._uploading += 1
        try:
            yield
        finally:
            with self._cond:
                self._uploading -= 1
                self._cond.notify_all()

    @contextmanager
    def admit(self):
        with self._cond:
            if self._closed:
                raise ShuttingDownError("the server is shutting down and takes no new work")
            if self._admitted >= self.size + self.queue_limit:
                raise QueueFullError(f"all {self.size} workers are busy and the queue of {self.queue_limit} "
                                     "is full; try again later")
            self._admitted += 1
        try:
            yield
        finally:
            with self._cond:
                self._admitted -= 1
                self._cond.notify_all()

    def run(self, job: dict, is_cancelled: Callable[[], bool]) -> Iterator[dict]:
        """Run `job` on a worker: yields its progress events, then its final message."""
        worker = self._acquire(is_cancelled)
        finished = False
        started = time.monotonic()
        cap = worker.memory_cap
        kills_before = cap.oom_kills() if cap is not None else 0

        def over_memory() -> JobMemoryError | None:
            """The kernel stopped a process of this job for the limit (memory_cap.py)."""
            if cap is None or cap.oom_kills() <= kills_before:
                return None
            return JobMemoryError(
                f"the job needed more memory than this server's limit of {human_bytes(self.job_memory_bytes)} "
                "a job (--job-memory); the kernel stopped it")
        try:
            worker.send(job)
            while True:
                if is_cancelled():
                    raise CallCancelledError("the call was cancelled or its deadline passed; the work was stopped")
                if self.job_seconds is not None and time.monotonic() - started > self.job_seconds:
                    raise JobTimeoutError(f"the job ran past this server's limit of {self.job_seconds:g} s a job "
                                          "(--job-timeout); the work was stopped")
                if self.job_memory_bytes is not None and not cap.enforced_by_kernel_for_the_sum:
                    # each process is bounded by RLIMIT_DATA alone: their sum is polled
                    used = resident_bytes(worker.pid)
                    if used > self.job_memory_bytes:
                        raise JobMemoryError(
                            f"the job used {human_bytes(used)} of memory, over this server's limit of "
                            f"{human_bytes(self.job_memory_bytes)} a job (--job-memory); the work was stopped")
                try:
                    event = worker.read_event(POLL_SECONDS)
                except EOFError:
                    code = worker.proc.wait()
                    stopped = over_memory()
                    if stopped is not None:
                        raise stopped from None
                    raise WorkerFailedError(f"the worker process died (exit code {code}) while working "
                                            "on this model (out of memory?)") from None
                if event is not None and "ready" in event:
                    worker.ready = True
                    started = time.monotonic()   # a fresh worker's imports are not the job's time
                    continue
                if event is None:
                    continue
                if "progress" in event:
                    yield event
                    continue
                stopped = over_memory()     # a measuring process killed for the limit: the job's error says
                if stopped is not None:     # only that it died; the worker is replaced (finally)
                    raise stopped
                finished = True
                yield event
                return
        finally:
            if finished:
                self._release(worker)
            else:
                fields = {"worker_pid": worker.pid}
                if cap is not None and cap.folder is not None:
                    fields.update(memory_cap=cap.kind, memory_peak_bytes=cap.peak_bytes(),
                                  memory_limit_bytes=cap.limit_bytes)
                log.info("stopping a worker", extra={"fields": fields})
                worker.kill()
                with self._cond:
                    self._all.discard(worker)
                self._release(None if self._closed else self._spawn())

    def _spawn(self) -> Worker:
        worker = Worker(self._env, self.job_memory_bytes)
        with self._cond:
            self._all.add(worker)
        return worker

    def _acquire(self, is_cancelled: Callable[[], bool]) -> Worker:
        """A live free worker, first come first served. A worker that died while idle is reaped
        and replaced, never handed out."""
        while True:
            worker = self._take_idle(is_cancelled)
            if worker.is_alive():
                return worker
            code = worker.proc.poll()
            log.warning("an idle worker had died; replacing it", extra={"fields": {"worker_pid": worker.pid,
                                                                                   "exit_code": code}})
            worker.kill()
            with self._cond:
                self._all.discard(worker)
            try:
                replacement = self._spawn()
            except BaseException:
                self._release(None)
                raise
            with self._cond:
                if self._closed:
                    replacement.kill()
                    raise ShuttingDownError("the server is shutting down")
                # the replacement goes to the head of the line's own hands: this call is first
                return replacement

    def _take_idle(self, is_cancelled: Callable[[], bool]) -> Worker:
        """A free worker, first come first served: a call takes one only at the head of the line."""
        ticket = object()
        with self._cond:
            self._line.append(ticket)
            try:
                while not (self._idle and self._line[0] is ticket):
                    if self._closed:
                        raise ShuttingDownError("the server is shutting down")
                    if is_cancelled():
                        raise CallCancelledError("the call was cancelled or its deadline passed while queued")
                    self._cond.wait(POLL_SECONDS)
                return self._idle.pop()
            finally:
                self._line.remove(ticket)
                self._cond.notify_all()

    def _release(self, worker: Worker | None) -> None:
        with self._cond:
            if worker is not None:
                if self._closed:
                    worker.kill()
                else:
                    self._idle.append(worker)
            self._cond.notify_all()

    def wait_idle(self, timeout_seconds: float) -> bool:
        """Wait until no call is admitted or uploading; False when the time ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._admitted == 0 and self._uploading == 0, timeout_seconds)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._idle = []
            self._cond.notify_all()
        for worker in list(self._all):
            worker.kill()

    def memory_cap_kind(self) -> str | None:
        """How the job memory limit is enforced: "cgroup2", "cgroup1", "rlimit" (with the poll) or
        None (no limit)."""
        with self._cond:
            caps = [w.memory_cap for w in self._all if w.memory_cap is not None]
        return caps[0].kind if caps else None

    def worker_pids(self) -> list[int]:
        with self._cond:
            return [w.pid for w in self._idle]

    def all_worker_pids(self) -> list[int]:
        with self._cond:
            return [w.pid for w in self._all]
