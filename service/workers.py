"""Worker processes for the CPU-heavy work, so that the server's threads stay free to answer
health checks and new calls; admission with a bounded queue; stopping work by killing.

Each worker is a `python -m graphopt_service.worker` process in its own process group (the
measuring subprocesses it starts are in that group too). A job whose call is cancelled, or
whose deadline passes, kills the group; a fresh worker takes its place.
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
from contextlib import contextmanager
from typing import Callable, Iterator

from .status import CallCancelledError, QueueFullError, ShuttingDownError, WorkerFailedError

log = logging.getLogger(__name__)
POLL_SECONDS = 0.1


class Worker:
    def __init__(self, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "graphopt_service.worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True, env=env)
        self._buffer = bytearray()
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


class WorkerPool:
    """`size` workers; at most `size + queue_limit` calls admitted at once (uploading,
    waiting, working or sending back); more are refused with QueueFullError."""

    def __init__(self, size: int, queue_limit: int, env: dict[str, str] | None = None):
        if size < 1 or queue_limit < 0:
            raise ValueError("a pool needs at least one worker and a queue limit of at least 0")
        self.size, self.queue_limit, self._env = size, queue_limit, env
        self._cond = threading.Condition()
        self._idle = [Worker(env) for _ in range(size)]
        self._all = set(self._idle)   # idle and busy
        self._line: collections.deque = collections.deque()   # calls waiting for a worker, in order
        self._admitted = 0
        self._closed = False

    @property
    def admitted(self) -> int:
        return self._admitted

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
        try:
            worker.send(job)
            while True:
                if is_cancelled():
                    raise CallCancelledError("the call was cancelled or its deadline passed; the work was stopped")
                try:
                    event = worker.read_event(POLL_SECONDS)
                except EOFError:
                    code = worker.proc.wait()
                    raise WorkerFailedError(f"the worker process died (exit code {code}) while working "
                                            "on this model (out of memory?)") from None
                if event is None or "ready" in event:
                    continue
                if "progress" in event:
                    yield event
                    continue
                finished = True
                yield event
                return
        finally:
            if finished:
                self._release(worker)
            else:
                log.info("stopping a worker", extra={"fields": {"worker_pid": worker.pid}})
                worker.kill()
                with self._cond:
                    self._all.discard(worker)
                self._release(None if self._closed else self._spawn())

    def _spawn(self) -> Worker:
        worker = Worker(self._env)
        with self._cond:
            self._all.add(worker)
        return worker

    def _acquire(self, is_cancelled: Callable[[], bool]) -> Worker:
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
        """Wait until no call is admitted; False when the time ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._admitted == 0, timeout_seconds)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._idle = []
            self._cond.notify_all()
        for worker in list(self._all):
            worker.kill()

    def worker_pids(self) -> list[int]:
        with self._cond:
            return [w.pid for w in self._idle]
