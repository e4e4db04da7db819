"""The one exception type a trainer needs to catch."""

from __future__ import annotations

import grpc

__all__ = ["FeedError"]


class FeedError(RuntimeError):
    """A failed gpufeed call: ``code`` is the gRPC status, the message says what to do."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, address: str) -> FeedError:
        code, details = error.code(), error.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            details = f"gpufeed server at {address} is unavailable ({details})"
        return cls(code, details)
