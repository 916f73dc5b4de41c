"""Child runs that time nothing (a step's peak memory, its outputs) started in a thread of
their own while the caller goes on (planning, verifying), so that optimize does not wait for
them one after another; every run that times a step first waits until they are done
(`quiet`), so that nothing of the caller's runs beside it.

One run at a time in the background: with the caller's own work, two at once, which is what
the machine graphopt is built on (two cores) runs without one slowing the other much, and what
a job's memory then holds is at most its two largest processes, not all of them.
"""
from __future__ import annotations

import concurrent.futures
import contextvars
import threading


class Overlap:
    """A queue of background child runs (`start`); `enabled=False`: each runs at once, in the
    caller's thread (where processes at once would not fit: under a memory limit)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future] = []
        self._lock = threading.Lock()

    def start(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        """`fn(*args, **kwargs)` in the background (in the caller's context: what the caller
        tracks of its children, `runtime.rss.tracking_children`, sees this run's too); its Future."""
        if not self.enabled:
            done: concurrent.futures.Future = concurrent.futures.Future()
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - given back by .result(), as a pool would
                done.set_exception(exc)
            return done
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphopt-overlap")
            future = self._pool.submit(contextvars.copy_context().run, fn, *args, **kwargs)
            self._pending = [f for f in self._pending if not f.done()] + [future]
        return future

    def quiet(self) -> None:
        """Wait until every run started is done (their errors stay with their Futures)."""
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending)

    def close(self) -> None:
        """Drop the runs not begun and wait for the one running (its files must outlive it)."""
        with self._lock:
            pool, self._pool, self._pending = self._pool, None, []
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
