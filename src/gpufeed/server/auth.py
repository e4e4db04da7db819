"""Optional TLS and bearer-token checks.

The token is compared on every RPC except the standard health service, which
liveness probes (Docker HEALTHCHECK, Kubernetes gRPC probes) call without
credentials and which reveals nothing but "serving". A call without the right
``authorization: Bearer <token>`` metadata ends with UNAUTHENTICATED before the
servicer sees it. The token is read from a file, not the command line, so it
does not show in ``ps``.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

__all__ = ["TokenInterceptor", "read_token", "server_credentials"]

_UNCHECKED = ("/grpc.health.v1.Health/",)


def read_token(path: str) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path!r} is empty")
    return token


def server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    """TLS with the server's certificate; with ``client_ca``, clients must present one it signed."""
    pair = [(Path(key).read_bytes(), Path(cert).read_bytes())]
    if client_ca is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=Path(client_ca).read_bytes(),
                                       require_client_auth=True)


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_UNCHECKED):
            return handler
        presented = dict(handler_call_details.invocation_metadata).get("authorization", "")
        if isinstance(presented, str) and hmac.compare_digest(presented.encode(), self._expected):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler that ends the call UNAUTHENTICATED at once.

    Served as a bidirectional stream whatever ``handler``'s shape (the wire
    format is the same), so it reads no request: a unary handler would wait
    for one first, holding a worker thread for as long as the client likes.
    """

    def refuse(requests, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "missing or wrong bearer token (metadata `authorization: Bearer <token>`)")

    return grpc.stream_stream_rpc_method_handler(
        refuse, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)
