"""The one exception type a trainer needs to catch."""

from __future__ import annotations

import grpc

__all__ = ["FeedError", "as_raised", "status_of"]


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


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, details) of a failed call: a FeedError's, an RpcError's; UNKNOWN otherwise."""
    if isinstance(error, FeedError):
        return error.code, str(error)
    if isinstance(error, grpc.RpcError):
        return error.code(), error.details() or ""
    return grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}"


def as_raised(error: BaseException, address: str) -> BaseException:
    """What to raise for ``error`` from the server at ``address``: a FeedError for an
    RpcError, anything else as it is."""
    return FeedError.from_rpc(error, address) if isinstance(error, grpc.RpcError) else error
