"""Optional bearer-token check for every call but health (probes carry no token)."""
from __future__ import annotations

import hmac

import grpc

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def _aborting_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def abort(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(abort, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str):
        if not token:
            raise ValueError("an empty bearer token would let anyone in")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return handler
        reason = "missing authorization metadata" if not given else "wrong bearer token"
        return _aborting_handler(handler, f"{reason}: send 'authorization: Bearer <token>'")
