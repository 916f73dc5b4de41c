"""The worker pool: admission, first-come-first-served hand-out, cancellation while queued."""
from __future__ import annotations

import threading
import time

import pytest

from graphopt_service.status import CallCancelledError, QueueFullError
from graphopt_service.workers import WorkerPool


@pytest.fixture
def pool():
    p = WorkerPool(1, 3)
    yield p
    p.close()


def _wait_until(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_waiting_calls_get_the_worker_in_arrival_order(pool):
    held = pool._acquire(lambda: False)
    order, threads = [], []
    for k in range(4):
        def take(k=k):
            worker = pool._acquire(lambda: False)
            order.append(k)
            time.sleep(0.02)   # a late arrival must not overtake while this one works
            pool._release(worker)
        threads.append(threading.Thread(target=take))
        threads[-1].start()
        _wait_until(lambda: len(pool._line) == k + 1)
    pool._release(held)
    for t in threads:
        t.join(10)
    assert order == [0, 1, 2, 3]


def test_a_cancelled_waiter_leaves_the_line(pool):
    held = pool._acquire(lambda: False)
    cancelled = threading.Event()
    errors = []

    def wait():
        try:
            pool._acquire(cancelled.is_set)
        except CallCancelledError as exc:
            errors.append(exc)
    thread = threading.Thread(target=wait)
    thread.start()
    _wait_until(lambda: len(pool._line) == 1)
    cancelled.set()
    thread.join(10)
    assert errors and len(pool._line) == 0
    pool._release(held)
    assert pool._acquire(lambda: False) is held   # the next call is not blocked by the one that left


def test_admission_is_bounded_by_workers_plus_queue(pool):
    with pool.admit(), pool.admit(), pool.admit(), pool.admit():
        with pytest.raises(QueueFullError, match="queue of 3"):
            with pool.admit():
                pass
    with pool.admit():
        assert pool.admitted == 1
