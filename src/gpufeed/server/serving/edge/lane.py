"""A stream's lane: its batches and releases over a Unix socket, beside its gRPC call.

The batches of a shared-memory stream (shm, cuda_ipc) are a few hundred bytes
of metadata; their pixels never travel. Yet each gRPC message costs the
trainer several thread hand-offs (grpc's channel thread, the iterator's
condition, the request-sending thread and its completion), about a
millisecond of CPU per batch, and the server a send and its completion. So
the server offers each such stream a lane: a ``SOCK_SEQPACKET`` socket under
/dev/shm with a random name (mode 0600; swept with the server's segments if it
dies). A trainer on the same host connects, sends the header's token and
says ``Attached{lane: true}``; from then on each batch is one message on the
lane and each Release one message back. The call stays open for everything
else: the status comes there, after the server has closed the lane.

One connection per lane: its name is unlinked as soon as the trainer has
connected (or the stream ends). A message is whole or not sent: a batch's
message over ``LANE_MESSAGE_BYTES`` goes on the call, announced on the lane.
At the stream's end the server half-closes the lane; the trainer reads the
batches left, then the end of file, and closes its end; then the server
closes the lane and ends the call.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import threading
import time

from gpufeed.v1.vocabulary import LANE_MESSAGE_BYTES, SHM_DIR

from ..errors import BadClientMessage

__all__ = ["StreamLane"]


class StreamLane:
    """One stream's lane, from its offer in the header to its close.

    Raises OSError if its socket cannot be made (the stream then goes on the
    call). ``accept`` takes the trainer's connection; ``send`` and ``receive``
    then carry whole messages; ``shutdown`` wakes a thread blocked in either
    (from any thread); ``close`` waits for ``reader`` (the thread that receives)
    before it lets go of the socket, so no thread uses a closed descriptor.
    """

    def __init__(self, name: str):
        self.name = name
        self.token = secrets.token_bytes(16)
        self.reader: threading.Thread | None = None
        self._path = os.path.join(SHM_DIR, name)
        self._listener: socket.socket | None = socket.socket(socket.AF_UNIX,
                                                             socket.SOCK_SEQPACKET)
        self._connection: socket.socket | None = None
        try:
            # Linux gives the socket's file the socket's mode, less the umask: owner only.
            os.fchmod(self._listener.fileno(), 0o600)
            self._listener.bind(self._path)
            self._listener.listen(1)
        except BaseException:
            self.close()
            raise

    def accept(self, timeout: float) -> None:
        """Take the trainer's connection and check its token, within ``timeout`` seconds.

        Raises BadClientMessage if the trainer, which said it connected, did not,
        or sent something else first.
        """
        listener = self._listener
        assert listener is not None, "a lane takes one connection"
        deadline = time.monotonic() + timeout
        try:
            listener.settimeout(timeout)
            connection, _ = listener.accept()
        except OSError:
            raise BadClientMessage(f"attached: lane is true, but the client did not connect "
                                   f"to the header's lane_name within {timeout:g} s") from None
        finally:
            self._close_listener()
        try:
            connection.settimeout(max(deadline - time.monotonic(), 0.001))
            token = connection.recv(len(self.token) + 1)
        except OSError:
            token = b""
        if not hmac.compare_digest(token, self.token):
            connection.close()
            raise BadClientMessage("attached: the lane's first message was not the "
                                   "header's lane_token")
        connection.settimeout(None)
        # Room for a whole message of the largest size (Linux doubles what is asked).
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * LANE_MESSAGE_BYTES)
        self._connection = connection

    def send(self, data: bytes) -> None:
        """One message (at most LANE_MESSAGE_BYTES); blocks while the trainer's queue is
        full. Raises OSError once the lane is shut or the trainer has gone."""
        assert len(data) <= LANE_MESSAGE_BYTES, "larger messages go on the call"
        if self._connection is None:
            raise OSError("the lane is closed")
        self._connection.send(data, socket.MSG_NOSIGNAL)  # EPIPE, not SIGPIPE, if it has gone

    def receive(self) -> bytes | None:
        """The trainer's next message; None once it has closed the lane, or the lane is
        shut. Raises BadClientMessage for a message over LANE_MESSAGE_BYTES."""
        connection = self._connection
        if connection is None:
            return None
        try:
            data, _, flags, _ = connection.recvmsg(LANE_MESSAGE_BYTES)
        except OSError:  # closed by the handler meanwhile
            return None
        if flags & socket.MSG_TRUNC:
            raise BadClientMessage(f"lane: a message over {LANE_MESSAGE_BYTES} bytes")
        return data or None

    def shutdown(self) -> None:
        """Wake whatever blocks on the lane; its sends and receives end from now on."""
        if self._connection is not None:
            try:
                self._connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def finish(self, timeout: float) -> None:
        """The stream's end: say so to the trainer (end of file after the batches sent),
        and close once it has closed its end, or after ``timeout`` seconds.

        Closing first would discard Releases the trainer sent meanwhile, and a socket
        closed with unread messages resets its peer, which could then lose the batches
        it has not read yet.
        """
        if self._connection is not None:
            try:
                self._connection.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            if self.reader is not None and self.reader is not threading.current_thread():
                self.reader.join(timeout)  # it returns at the trainer's end of file
        self.close()

    def close(self) -> None:
        """Shut the lane and remove its name; the descriptor goes once ``reader`` has
        stopped. Safe to call twice."""
        self._close_listener()
        self.shutdown()
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(timeout=10)  # it returns at the shutdown's end of file
        if self._connection is not None:
            self._connection.close()

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
