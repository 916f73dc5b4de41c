"""What keeps a silent or greedy client from holding the server: idle streams are ended, long
streams are bounded in number so that threads stay free for health checks, uploads reserve
their disk space.

The gRPC server runs every call on a thread of a fixed pool, and a streaming call holds its
thread while it waits for the client, so:
- `StreamWatchdog` cancels a call whose client neither sent a message nor took one for
  `idle_timeout_seconds` while the server waited on it (reading the upload, or sending a
  response the client does not read). The thread, the slot and the call's folder are freed.
- `StreamLimitInterceptor` refuses (RESOURCE_EXHAUSTED, at once) a streaming call beyond the
  number allowed for its kind, so that those calls can never take every thread of the pool.
  Health (grpc.health.v1) is never limited or wrapped: its Watch does not hold a thread.
- `UploadRate` ends an upload (DEADLINE_EXCEEDED) that brings fewer than the minimum bytes a
  second over a window: a client that trickles a byte now and then, never silent for the idle
  timeout, would otherwise hold its slot, thread and folder until the job timeout.
- `AddressUploads` refuses (RESOURCE_EXHAUSTED) an upload from an address that already has the
  most uploads in progress one address may have (off by default: behind a proxy or a NAT every
  client has the proxy's address).
- `DiskReservations` refuses an upload (RESOURCE_EXHAUSTED) whose declared size does not fit in
  the work disk's free space less what the other uploads in progress have declared.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

import grpc

from graphopt.errors import LimitExceededError

from .status import QueueFullError, UploadTooSlowError

log = logging.getLogger("graphopt_service")
UNLIMITED_PREFIXES = ("/grpc.health.v1.Health/",)


class StreamWatch:
    """One call's idle clock: `waiting()` around each wait on the client."""

    def __init__(self, watchdog: "StreamWatchdog", context, timeout_seconds: float):
        self._watchdog, self.context, self.timeout_seconds = watchdog, context, timeout_seconds
        self.waiting_since: float | None = None
        self.waiting_for = ""
        self.expired = False

    def waiting(self, what: str) -> "_Waiting":
        return _Waiting(self, what)

    def requests(self, request_iterator):
        """The request messages, each wait for the next one watched."""
        iterator = iter(request_iterator)
        while True:
            with self.waiting("the next request message"):
                try:
                    message = next(iterator)
                except StopIteration:
                    return
            yield message

    def close(self) -> None:
        self._watchdog._remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Waiting:
    def __init__(self, watch: StreamWatch, what: str):
        self.watch, self.what = watch, what

    def __enter__(self):
        self.watch.waiting_for = self.what
        self.watch.waiting_since = time.monotonic()

    def __exit__(self, *exc):
        self.watch.waiting_since = None


class StreamWatchdog:
    """One thread for all calls: cancels each call that waited on its client too long."""

    def __init__(self, check_seconds: float = 0.25):
        self._lock = threading.Lock()
        self._watches: set[StreamWatch] = set()
        self._check_seconds = check_seconds
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stream-watchdog", daemon=True)
        self._thread.start()

    def watch(self, context, timeout_seconds: float | None) -> StreamWatch:
        watch = StreamWatch(self, context, timeout_seconds or float("inf"))
        with self._lock:
            self._watches.add(watch)
        return watch

    def _remove(self, watch: StreamWatch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def _loop(self) -> None:
        while not self._stopped.wait(self._check_seconds):
            now = time.monotonic()
            with self._lock:
                expired = [w for w in self._watches if w.waiting_since is not None and not w.expired
                           and now - w.waiting_since > w.timeout_seconds]
                for watch in expired:
                    watch.expired = True
            for watch in expired:
                log.info("idle call ended", extra={"fields": {
                    "peer": watch.context.peer(), "waiting_for": watch.waiting_for,
                    "idle_timeout_seconds": watch.timeout_seconds}})
                watch.context.cancel()   # wakes the thread blocked on the client; the call ends CANCELLED

    def stop(self) -> None:
        self._stopped.set()


def _wrap(handler: grpc.RpcMethodHandler, wrap_behavior) -> grpc.RpcMethodHandler:
    kinds = {(False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
             (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
             (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
             (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler)}
    attribute, make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(wrap_behavior(getattr(handler, attribute), handler.response_streaming),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def wrap(behavior, response_streaming):
        def refuse(request_or_iterator, context):
            context.abort(code, message)
        return refuse
    return _wrap(handler, wrap)


class StreamLimitInterceptor(grpc.ServerInterceptor):
    """At most `limits[kind]` streaming calls of each kind at once, more refused at once.
    `kind_of(method)` names a method's kind (None: not limited, as the Graphopt calls, which
    count their own uploads and admissions and watch their own waits). Streams of every kind
    but `self_watched_kinds` are idle-watched here.

    The count is taken on the call's pool thread, when its handler starts (a call the server
    refuses before that, over its maximum of concurrent calls, never counts)."""

    def __init__(self, limits: dict[str, int], kind_of, watchdog: StreamWatchdog, idle_timeout_seconds: float | None,
                 self_watched_kinds: frozenset = frozenset()):
        self.limits, self.kind_of = limits, kind_of
        self.watchdog, self.idle_timeout_seconds = watchdog, idle_timeout_seconds
        self.self_watched_kinds = self_watched_kinds
        self._lock = threading.Lock()
        self.active = {kind: 0 for kind in limits}

    def _enter(self, kind: str, context) -> None:
        with self._lock:
            if self.active[kind] < self.limits[kind]:
                self.active[kind] += 1
                return
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"{self.limits[kind]} {kind} streams are open, the most this server takes at once; "
                      "try again later")

    def _leave(self, kind: str) -> None:
        with self._lock:
            self.active[kind] -= 1

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(UNLIMITED_PREFIXES):
            return handler
        if not (handler.request_streaming or handler.response_streaming):
            return handler
        kind = self.kind_of(method)
        if kind is None:
            return handler
        idle_seconds = None if kind in self.self_watched_kinds else self.idle_timeout_seconds

        def wrap(behavior, response_streaming):
            if response_streaming:
                def streaming(request_or_iterator, context):
                    self._enter(kind, context)
                    watch = self.watchdog.watch(context, idle_seconds)
                    try:
                        if idle_seconds is not None and handler.request_streaming:
                            request_or_iterator = watch.requests(request_or_iterator)
                        responses = iter(behavior(request_or_iterator, context))
                        while True:
                            try:
                                response = next(responses)
                            except StopIteration:
                                return
                            with watch.waiting("the client to read a response"):
                                yield response
                    finally:
                        watch.close()
                        self._leave(kind)
                return streaming

            def unary_response(request_iterator, context):
                self._enter(kind, context)
                watch = self.watchdog.watch(context, idle_seconds)
                try:
                    if idle_seconds is not None:
                        request_iterator = watch.requests(request_iterator)
                    return behavior(request_iterator, context)
                finally:
                    watch.close()
                    self._leave(kind)
            return unary_response
        return _wrap(handler, wrap)


class DiskReservations:
    """The bytes uploads in progress have declared, against the work disk's free space."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._lock = threading.Lock()
        self.reserved_bytes = 0

    def reserve(self, size_bytes: int, path: str) -> None:
        with self._lock:
            free = shutil.disk_usage(self.folder).free
            if size_bytes > free - self.reserved_bytes:
                raise LimitExceededError(
                    f"file {path!r} of {size_bytes} bytes does not fit on the server's work disk now "
                    f"({max(0, free - self.reserved_bytes)} bytes free for uploads); try again later")
            self.reserved_bytes += size_bytes

    def release(self, size_bytes: int) -> None:
        with self._lock:
            self.reserved_bytes -= size_bytes


class UploadRate:
    """An upload's pace: once it has run `window_seconds`, every message must find at least
    `min_bytes_per_second * window_seconds` bytes received in the `window_seconds` before it
    (that message included), else UploadTooSlowError. 0 bytes a second: no minimum."""

    def __init__(self, min_bytes_per_second: int, window_seconds: float, clock=time.monotonic):
        self.min_bytes_per_second, self.window_seconds, self._clock = min_bytes_per_second, window_seconds, clock
        self.started = clock()
        self._recent: list[tuple[float, int]] = []   # (when, bytes) within the window

    def received(self, nbytes: int) -> None:
        now = self._clock()
        self._recent = [(t, n) for t, n in self._recent if t > now - self.window_seconds] + [(now, nbytes)]
        if self.min_bytes_per_second <= 0 or now - self.started < self.window_seconds:
            return
        got = sum(n for _, n in self._recent)
        if got < self.min_bytes_per_second * self.window_seconds:
            raise UploadTooSlowError(
                f"the upload brought {got} bytes in the last {self.window_seconds:g} s, under this server's "
                f"minimum of {self.min_bytes_per_second} bytes a second (--min-upload-rate); the call was ended")


def peer_address(peer: str) -> str:
    """The client's address without its port: "ipv4:10.0.0.7:52114" -> "ipv4:10.0.0.7",
    "ipv6:[::1]:52114" -> "ipv6:[::1]" (a Unix socket's peer is kept whole)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return f"{kind}:{rest.rsplit(':', 1)[0]}"
    return peer


class AddressUploads:
    """Uploads in progress per client address, at most `limit` each (None: no limit)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def in_progress(self, address: str) -> int:
        with self._lock:
            return self._counts.get(address, 0)

    def __call__(self, address: str) -> "_AddressSlot":
        return _AddressSlot(self, address)


class _AddressSlot:
    def __init__(self, uploads: AddressUploads, address: str):
        self.uploads, self.address = uploads, address

    def __enter__(self):
        u = self.uploads
        with u._lock:
            count = u._counts.get(self.address, 0)
            if u.limit is not None and count >= u.limit:
                raise QueueFullError(f"{count} uploads from this address ({self.address}) are in progress, the most "
                                     "this server takes from one address (--uploads-per-address); try again later")
            u._counts[self.address] = count + 1
        return self

    def __exit__(self, *exc) -> None:
        u = self.uploads
        with u._lock:
            left = u._counts[self.address] - 1
            if left:
                u._counts[self.address] = left
            else:
                del u._counts[self.address]
