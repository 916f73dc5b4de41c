"""Optional bearer-token check for every call but health (probes carry no token).

Failed attempts are logged and throttled per client address: each address may fail
`burst_failures` times in a row, then once per `refill_seconds`; while an address is over that,
every call from it (right token or wrong) is refused without looking at the token, so guessing
is no faster than the throttle.
"""
from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import OrderedDict

import grpc

log = logging.getLogger("graphopt_service")
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
BURST_FAILURES = 10
REFILL_SECONDS = 1.0
MAX_TRACKED_ADDRESSES = 4096


def _replace_behavior(handler: grpc.RpcMethodHandler, make_behavior) -> grpc.RpcMethodHandler:
    kinds = {(False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
             (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
             (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
             (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler)}
    attribute, make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(make_behavior(getattr(handler, attribute)), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def peer_address(peer: str) -> str:
    """'ipv4:10.0.0.7:51234' -> 'ipv4:10.0.0.7', 'ipv6:[::1]:5555' -> 'ipv6:[::1]' (the port varies per connection)."""
    if peer.startswith(("ipv4:", "ipv6:")) and ":" in peer[5:]:
        return peer.rsplit(":", 1)[0]
    return peer


class FailureThrottle:
    """A bucket of `burst` failures per address, refilled by one every `refill_seconds`."""

    def __init__(self, burst: int = BURST_FAILURES, refill_seconds: float = REFILL_SECONDS,
                 max_addresses: int = MAX_TRACKED_ADDRESSES):
        self.burst, self.refill_seconds, self.max_addresses = burst, refill_seconds, max_addresses
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()   # address -> [tokens, at]

    def _level(self, address: str, now: float) -> list[float]:
        bucket = self._buckets.get(address)
        if bucket is None:
            return [float(self.burst), now]
        tokens = min(float(self.burst), bucket[0] + (now - bucket[1]) / self.refill_seconds)
        return [tokens, now]

    def wait_seconds(self, address: str) -> float:
        """0 when `address` may try now, else how long until it may."""
        with self._lock:
            tokens, _ = self._level(address, time.monotonic())
            return 0.0 if tokens >= 1 else (1 - tokens) * self.refill_seconds

    def failed(self, address: str) -> int:
        """Count a failure; returns the failures the address has left before it is throttled."""
        with self._lock:
            now = time.monotonic()
            bucket = self._level(address, now)
            bucket[0] = max(0.0, bucket[0] - 1)
            self._buckets[address] = bucket
            self._buckets.move_to_end(address)
            while len(self._buckets) > self.max_addresses:
                self._buckets.popitem(last=False)   # the address that failed longest ago
            return int(bucket[0])


class BearerTokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str, throttle: FailureThrottle | None = None):
        if not token or not token.strip():
            raise ValueError("an empty bearer token would let anyone in")
        self._expected = f"Bearer {token}".encode()
        self.throttle = throttle or FailureThrottle()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        right = hmac.compare_digest(given.encode(), self._expected)
        reason = None if right else ("missing authorization metadata" if not given else "wrong bearer token")
        method = handler_call_details.method
        throttle = self.throttle

        def make_behavior(behavior):
            # on the call's pool thread: the peer is known only there
            def checked(request_or_iterator, context):
                address = peer_address(context.peer())
                wait = throttle.wait_seconds(address)
                if wait > 0:
                    log.warning("authentication throttled", extra={"fields": {
                        "peer": context.peer(), "method": method, "retry_after_seconds": round(wait, 1)}})
                    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                  f"too many failed authentication attempts from this address; try again in "
                                  f"{wait:.0f} s" if wait >= 1 else "too many failed authentication attempts "
                                  "from this address; try again in a second")
                if reason is not None:
                    left = throttle.failed(address)
                    log.warning("authentication failed", extra={"fields": {
                        "peer": context.peer(), "method": method, "reason": reason, "attempts_left": left}})
                    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                  f"{reason}: send 'authorization: Bearer <token>'")
                return behavior(request_or_iterator, context)
            return checked
        return _replace_behavior(handler, make_behavior)
