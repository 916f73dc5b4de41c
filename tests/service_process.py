"""A real `graphopt serve` process on a loopback port, for the service tests."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path


class ServerProcess:
    def __init__(self, work_dir: Path, *args: str, env: dict | None = None, start_seconds: float = 60.0):
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.work_dir.parent / f"{self.work_dir.name}.log"
        self._log = open(self.log_path, "w")
        command = [sys.executable, "-m", "graphopt.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                   "--work-dir", str(self.work_dir), *args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], start_seconds)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.kill()
            raise RuntimeError(f"the server did not start in {start_seconds} s:\n{self.log_path.read_text()}")
        self.port = json.loads(line)["listening"]
        self.target = f"127.0.0.1:{self.port}"

    def logs(self) -> list[dict]:
        self._log.flush()
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def leftover_files(self) -> list[str]:
        """Everything under the work dir (the server's root folder and the lock file it holds
        there aside). The server may be removing a call's folder while it is walked: then it is
        walked again."""
        while True:
            try:
                return [str(p) for p in self.work_dir.rglob("*")
                        if (p.is_file() and not (p.name == ".lock" and p.parent.parent == self.work_dir)) or
                        (p.is_dir() and p.parent != self.work_dir)]
            except FileNotFoundError:
                time.sleep(0.05)

    def wait_no_leftovers(self, timeout_seconds: float = 15.0) -> list[str]:
        """Leftover files once the server had time to clean up after a call's end."""
        deadline = time.monotonic() + timeout_seconds
        while (left := self.leftover_files()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def entries(self, message: str, **fields) -> list[dict]:
        """The log entries with this message (and these field values), as written so far."""
        return [e for e in self.logs()
                if e.get("message") == message and all(e.get(k) == v for k, v in fields.items())]

    def wait_for_logs(self, message: str, count: int, timeout_seconds: float = 30.0, **fields) -> list[dict]:
        """At least `count` log entries with this message (and these field values), waiting for
        them: the server writes a call's lines on its own threads, often after the client has
        seen the call end (a call's "call finished" comes after its status reached the client)."""
        deadline = time.monotonic() + timeout_seconds
        while len(found := self.entries(message, **fields)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(found)} of {count} {message!r} entries {fields or ''} in "
                                     f"{timeout_seconds:g} s; the server's log:\n{self.log_path.read_text()}")
            time.sleep(0.1)
        return found

    def wait_for_log(self, message: str, timeout_seconds: float = 30.0, **fields) -> dict:
        """The first log entry with this message (and these field values), waiting for it."""
        return self.wait_for_logs(message, 1, timeout_seconds, **fields)[0]

    def terminate(self, timeout_seconds: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_seconds)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._log.close()
