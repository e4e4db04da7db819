"""What refuses a request or ends a stream, in the serving code's own terms.

The planning modules, running/sources.py and running/stream.py (and memory/budget.py's
``MemoryExhausted``) raise these and know nothing of gRPC; edge/service.py, the
gRPC edge, is the one place that turns each into the status code a client
sees (its ``_STATUS`` table), as grpc's examples keep status codes in the
servicer. A sample that fails is not an error here: it is data, sent in its
batch (failures.py).

Every exception's message is what the client reads; a refusal's message
starts with the request field at fault, which it also carries as ``field``.
"""

from __future__ import annotations

import re

__all__ = ["BadClientMessage", "ClientGone", "Draining", "FailureBudgetSpent", "Forbidden",
           "InvalidRequest", "LeaseExpired", "LimitExceeded", "NotFound", "Refused",
           "ServerFault", "StreamEnded", "UnpaddableBatch", "Unsupported"]

_FIELD = re.compile(r"[a-z_]*(\.[a-z_]+)*")  # a field's name, as messages start with it


class Refused(Exception):
    """A request the server will not serve; nothing of it has started.

    ``field`` is the request field at fault (``samples``, ``output.dtype``): given,
    or the name the message starts with, as every refusal's message does.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        if field is None:
            match = _FIELD.match(message)
            assert match is not None, "_FIELD matches the empty string, so any message"
            field = match.group()
        self.field = field


class InvalidRequest(Refused):
    """A field's value, or a combination of fields, that no server could serve."""


class NotFound(Refused):
    """Something the request names (a list file, the first array file, every shard,
    a class folder) does not exist under the data roots."""


class Forbidden(Refused):
    """The request names something outside the data roots."""


class LimitExceeded(Refused):
    """The request is over one of this server's limits (--max-samples,
    --max-batch-bytes, --max-list-bytes), or the memory for its slots is not there."""


class Unsupported(Refused):
    """This server lacks what the request needs (a compression library)."""


class StreamEnded(Exception):
    """A stream that ends before its last batch; the message says why, for the client."""

    def again(self) -> StreamEnded:
        """A fresh copy to raise: raising a stored exception again would tie its
        traceback's frames (and the stream they hold) into a reference cycle."""
        return type(self)(*self.args)


class ClientGone(StreamEnded):
    """The client cancelled or its connection dropped: there is nobody to tell."""


class LeaseExpired(StreamEnded):
    """The trainer held every slot, or read nothing, for longer than the lease timeout."""


class FailureBudgetSpent(StreamEnded):
    """More samples failed than the request's failure budget allows."""


class UnpaddableBatch(StreamEnded):
    """A batch of a split over ranks whose every sample failed, and no sample after it
    decoded to pad it with: the rank cannot yield the batch every rank must."""


class Draining(StreamEnded):
    """The server is shutting down and the grace period is over."""


class BadClientMessage(StreamEnded):
    """The client sent a message the protocol does not allow (a second open, the
    release of a batch it does not hold)."""


class ServerFault(StreamEnded):
    """A server bug ended the stream; the server's log has the traceback."""
