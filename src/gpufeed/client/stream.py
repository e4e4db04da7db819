"""The Stream call's protocol, the trainer's side: open, header, attach, batches, release.

A stream sends ``open`` with the request, reads the header, opens the memory
it names with the transport's ``BatchReader`` (batches.py) and says
``attached`` if that memory is the server's; then it reads one Batch message
per batch and sends one ``Release`` per batch, carrying how long the trainer
waited for it. The reader decides when a slot goes back: a slot it gives back
while the stream reads that batch (owned tensors) rides on that batch's
Release; one given back later (a dropped view) gets a Release of its own.
When the header offers a lane (lane.py) and the trainer can reach it, batches
come and releases go there instead of on the call, whose status still ends
the stream.

Nothing the server sends is taken on trust (checks.py): the header must fit
the request, each batch must come in order, and its tensors lie within the
memory the header declared, or the stream ends with DATA_LOSS.

Opening is separate from reading so that a loader can open its first stream
when it is made: the server's refusal of the request, and the header's facts
(classes, batch count), are then known at ``loader(...)``, and the server
starts decoding while the trainer sets up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence

import grpc
import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import NO_SLOT_MEMORY

from .batches import BatchReader, Release
from .checks import BatchOrder, check_header, check_rows, data_loss, expect
from .connection import Connection
from .inline import InlineBatches
from .lane import Lane, connect_lane
from .shm import ShmBatches

__all__ = ["OpenStream", "open_stream"]

_log = logging.getLogger(__name__)


class OpenStream:
    """A Stream call to ``server`` for ``request``, open and attached; ``close()`` ends it.

    ``header`` is the server's StreamHeader; ``batches()`` reads the batches to
    the stream's end. Raises what the call raises (grpc.RpcError, FeedError) if
    the server refuses the request or the stream's memory cannot be opened.
    Not thread-safe: one thread iterates it (slots may be released from any).
    """

    def __init__(self, server: Connection, request: feed_pb2.StreamRequest, copy: bool):
        self.request = request
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe from GC callbacks
        self._outbox.put(feed_pb2.ClientMessage(open=request))
        self._call = server.stub.Stream(iter(self._outbox.get, None), metadata=server.metadata)
        self._reader: BatchReader | None = None
        self._lane: Lane | None = None  # where batches come and releases go, if offered
        # The batch being read, by the thread reading it, and whether its reader gave
        # its slot back meanwhile (it then rides on the batch's Release).
        self._reading: tuple[int, int] | None = None
        self._given_back = False
        try:
            first = expect(next(self._call, None), "header")
            server.answered = True
            self.header: feed_pb2.StreamHeader = first.header
            check_header(self.header, request)
            self._order = BatchOrder(self.header, request)
            self._reader = _batch_reader(self.header, self._release, copy)
            if self._reader.shared:  # mapped or opened: say so, and where batches will come
                self._lane = connect_lane(self.header)
                if self._lane is not None:  # a call that ends (a server gone quiet) wakes it
                    self._call.add_done_callback(self._lane.shutdown)
                self._outbox.put(feed_pb2.ClientMessage(
                    attached=feed_pb2.Attached(lane=self._lane is not None)))
        except BaseException:
            self.close()
            raise

    def batches(self) -> Iterator[tuple[int, Sequence[feed_pb2.SampleFailure],
                                        dict[str, torch.Tensor] | None]]:
        """(seq, failures, tensors) of each batch to the stream's end; slots go back as
        soon as the tensors are owned, or once the trainer drops them (views).
        ``tensors`` is None for a batch whose every sample failed."""
        reader = self._reader
        assert reader is not None
        while True:
            reader.make_room()
            waiting = time.perf_counter()
            message = self._next_message()
            waited = time.perf_counter() - waiting
            if message is None:
                return
            expect(message, "batch")
            batch = message.batch
            self._order.check(batch)
            tensors = None
            if batch.tensors:  # else every sample failed: the server sent no rows
                self._reading, self._given_back = (batch.seq, threading.get_ident()), False
                try:
                    tensors = reader.tensors(batch)
                finally:
                    self._reading = None
                check_rows(tensors, self.request.batch_size)
            given_back = tensors is None or self._given_back
            self._send(feed_pb2.ClientMessage(release=feed_pb2.Release(
                seqs=[batch.seq] if given_back else [], wait_seconds=waited)))
            yield batch.seq, batch.failures, tensors

    def _next_message(self) -> feed_pb2.ServerMessage | None:
        """The server's next message: from the lane while it is open, else the call's."""
        lane = self._lane
        if lane is None:
            return next(self._call, None)
        message = lane.receive()
        if message is None:  # the server closed the lane: the call says how the stream ended
            self._lane = None
            lane.close()
            message = next(self._call, None)
            if message is not None:
                raise data_loss("the server sent a message on the call after closing the "
                                "stream's lane")
            return None
        if message.WhichOneof("kind") == "on_call":  # too large for the lane
            return next(self._call, None)
        return message

    def _send(self, message: feed_pb2.ClientMessage) -> None:
        """A release, on the lane while it is open, else on the call (from any thread)."""
        lane = self._lane
        if lane is None or not lane.send(message):
            self._outbox.put(message)

    def deal(self, batches: list[int], last: bool = False) -> None:
        """Hand a ``dealt`` stream the pass's batches ``batches`` to make next (from any
        thread); ``last``: no more will come, so the stream ends after them."""
        self._outbox.put(feed_pb2.ClientMessage(deal=feed_pb2.Deal(batches=batches, last=last)))

    def close(self) -> None:
        lane = self._lane  # once: the reading thread may let go of it meanwhile
        if lane is not None:
            lane.close()
        if self._reader is not None:
            self._reader.close()
        self._call.cancel()
        self._outbox.put(None)

    def _release(self, seq: int) -> None:
        """The reader gives batch ``seq``'s slot back (from any thread)."""
        if self._reading == (seq, threading.get_ident()):  # during tensors(): ride along
            self._given_back = True
        else:
            self._send(feed_pb2.ClientMessage(release=feed_pb2.Release(seqs=[seq])))


def _batch_reader(header: feed_pb2.StreamHeader, release: Release, copy: bool) -> BatchReader:
    """The reader of the transport the header names (shm, cuda_ipc: mapped or opened now)."""
    if header.transport == feed_pb2.TRANSPORT_SHM:
        return ShmBatches(header, release, copy)
    if header.transport == feed_pb2.TRANSPORT_CUDA_IPC:
        from .cuda_ipc import CudaBatches  # CUDA only for a stream that uses it

        return CudaBatches(header, release, copy)
    return InlineBatches(header, release, copy)


def open_stream(server: Connection, request: feed_pb2.StreamRequest, copy: bool,
                auto: bool) -> OpenStream:
    """The stream; with transport auto, a zero-copy stream the server has no memory
    for (RESOURCE_EXHAUSTED: its /dev/shm or GPU is full) is asked for again
    inline, and the loader says so. An explicit transport gets the error, and so
    does any other refusal (too many streams, the server's memory budget)."""
    try:
        return OpenStream(server, request, copy)
    except grpc.RpcError as e:
        if not (auto and request.transport != feed_pb2.TRANSPORT_INLINE
                and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                and NO_SLOT_MEMORY in (e.details() or "")):
            raise
        _log.warning("%s: transport auto -> inline this pass: %s", server.address, e.details())
        request.transport = feed_pb2.TRANSPORT_INLINE
        return OpenStream(server, request, copy)
