"""The client's messages after `open`, applied to its stream: from the call and the lane.

Each runs on a thread of its own per stream, started by the servicer, until
the client half-closes, leaves or closes the lane. A message the protocol does
not allow cancels the stream with BadClientMessage (INVALID_ARGUMENT), naming
what was wrong.
"""

from __future__ import annotations

import logging

import grpc
from google.protobuf.message import DecodeError

from gpufeed.v1 import feed_pb2

from ..errors import BadClientMessage, ServerFault
from ..running.stream import Stream
from .lane import StreamLane

__all__ = ["read_client", "read_lane"]

_log = logging.getLogger(__name__)


def read_client(request_iterator, stream: Stream) -> None:
    """Apply the client's messages after `open` until it half-closes or goes away."""
    try:
        for message in request_iterator:
            kind = message.WhichOneof("kind")
            if kind == "release":
                if not _released(stream, message.release):
                    return
            elif kind == "attached":
                stream.attach(lane=message.attached.lane)
            elif kind == "deal":
                try:
                    stream.deal(list(message.deal.batches), message.deal.last)
                except ValueError as e:
                    stream.cancel(BadClientMessage(str(e)))
                    return
            elif kind == "open":
                stream.cancel(BadClientMessage("open: a stream takes one `open` message, its "
                                               "first; this one sent another"))
                return
    except grpc.RpcError as e:  # the call ended; the handler cleans up
        # gRPC keeps this error in the call's state, which the traceback's frames refer
        # to: a cycle through this frame that would keep the stream (and its plan)
        # until a garbage collection.
        e.__traceback__ = None
    except Exception as e:
        _log.exception("client reader failed")
        stream.cancel(ServerFault(f"server error reading the client's messages: {e}"))


def read_lane(lane: StreamLane, stream: Stream) -> None:
    """Apply the releases the client sends on the lane, until it closes."""
    try:
        while (data := lane.receive()) is not None:
            message = feed_pb2.ClientMessage.FromString(data)
            kind = message.WhichOneof("kind")
            if kind != "release":
                raise BadClientMessage(f"lane: only `release` messages travel on the lane; "
                                       f"this one was {kind or 'empty'}")
            if not _released(stream, message.release):
                return
    except (BadClientMessage, DecodeError) as e:
        stream.cancel(e if isinstance(e, BadClientMessage)
                      else BadClientMessage(f"lane: a message that is not a ClientMessage: {e}"))
    except Exception as e:
        _log.exception("lane reader failed")
        stream.cancel(ServerFault(f"server error reading the lane: {e}"))


def _released(stream: Stream, release: feed_pb2.Release) -> bool:
    """Apply a Release (from the call or the lane); False if it ended the stream.

    Releases that come after the stream's end (its ring is gone) are read and
    dropped: the lane must be read to its end of file before it closes."""
    if stream.cancelled:
        return True
    # Before the slot goes back: the batch it unblocks may be the stream's last.
    stream.metrics.released(stream.plan.transport, release)
    try:
        stream.release(release.seqs)
    except KeyError as e:
        if stream.cancelled:  # it ended meanwhile
            return True
        stream.cancel(BadClientMessage(f"release: batch {e.args[0]} is not one this "
                                       f"stream sent and has not had back"))
        return False
    return True
