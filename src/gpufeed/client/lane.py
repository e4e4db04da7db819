"""A stream's lane, the trainer's side: batches in and releases out over a Unix socket.

A server offers a lane for a stream of shared memory (the header's
``lane_name``; why, and the protocol: gpufeed/server/serving/edge/lane.py).
Reading a batch is then one ``recvmsg`` on the thread that iterates, and a
release one ``send`` from whichever thread gives the slot back (a message on
a ``SOCK_SEQPACKET`` socket is whole: sends from several threads do not
interleave). A trainer that cannot reach the lane (another /dev/shm) reads
the call as before.

Nothing on the lane is taken on trust more than on the call: each message
must be a whole ServerMessage of at most ``LANE_MESSAGE_BYTES``, and the
stream checks it as it checks the call's.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
import threading

import grpc
from google.protobuf.message import DecodeError

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import LANE_MESSAGE_BYTES, SHM_DIR

from .checks import data_loss
from .errors import FeedError

__all__ = ["Lane", "connect_lane"]

_log = logging.getLogger(__name__)
# As the server names its segments and lanes (gpufeed-<server id>-<random>): nothing else
# of this user's in /dev/shm is connected to.
_LANE_NAME = re.compile(r"gpufeed-[0-9a-f]{16}-[0-9a-f]{16}")


class Lane:
    """A connected lane (``connect_lane``); ``close()`` ends it, from any thread."""

    def __init__(self, connection: socket.socket):
        self._connection = connection
        self._pid = os.getpid()  # a forked child (a DataLoader worker) must not release
        self._closed = False
        # send() and close() never overlap, so a send never meets a closed descriptor.
        # Reentrant: a garbage collection inside close() may run a finaliser that sends.
        self._lock = threading.RLock()

    def receive(self) -> feed_pb2.ServerMessage | None:
        """The server's next message; None once it has closed the lane (the call then
        says how the stream ended), or this process has. Raises FeedError: DATA_LOSS for
        a message that is not a whole ServerMessage, UNAVAILABLE if the lane fails."""
        try:
            data, _, flags, _ = self._connection.recvmsg(LANE_MESSAGE_BYTES)
        except OSError as e:
            # This process closed it (the loader's close, the call's end), or the server
            # did (a reset): the call says how the stream ended, and whether all came.
            if self._closed or isinstance(e, ConnectionResetError):
                return None
            raise FeedError(grpc.StatusCode.UNAVAILABLE,
                            f"the stream's lane failed: {e}") from None
        if not data:
            return None
        if flags & socket.MSG_TRUNC:
            raise data_loss(f"the server sent a message over {LANE_MESSAGE_BYTES} bytes on "
                            f"the stream's lane")
        try:
            return feed_pb2.ServerMessage.FromString(data)
        except DecodeError as e:
            raise data_loss(f"the server sent a message on the stream's lane that is not a "
                            f"ServerMessage: {e}") from None

    def send(self, message: feed_pb2.ClientMessage) -> bool:
        """Send ``message`` from any thread, a finaliser's included, without blocking;
        False if it was not sent (closed, full, or another process): send it on the call."""
        if os.getpid() != self._pid:
            return False
        data = message.SerializeToString()
        with self._lock:
            if self._closed:
                return False
            try:
                self._connection.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except OSError:
                return False
        return True

    def shutdown(self, *_) -> None:
        """Wake a thread in ``receive()`` (from any thread; a gRPC done-callback's
        argument is ignored); the lane carries nothing from now on."""
        self._closed = True
        try:
            self._connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.shutdown()
        with self._lock:
            self._connection.close()


def connect_lane(header: feed_pb2.StreamHeader) -> Lane | None:
    """The header's lane, connected and given its token; None if the header offers
    none, or this process cannot reach it (another /dev/shm)."""
    name = header.lane_name
    if not name:
        return None
    if not _LANE_NAME.fullmatch(name):
        raise data_loss(f"the server's lane_name {name!r} is not a gpufeed name in {SHM_DIR}")
    path = os.path.join(SHM_DIR, name)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):  # no symbolic link to another socket
            raise data_loss(f"the server's lane_name {name!r} is not a socket")
        connection.settimeout(10.0)  # a listening socket answers at once
        connection.connect(path)
        connection.send(header.lane_token)
        connection.settimeout(None)
    except OSError as e:
        connection.close()
        _log.debug("the stream's lane %s cannot be reached (%s): batches come on the call",
                   name, e)
        return None
    except BaseException:
        connection.close()
        raise
    return Lane(connection)
