"""The Stream call's protocol, the trainer's side: open, header, attach, batches, release.

A stream sends ``open`` with the request, reads the header, opens the memory
it names with the transport's ``BatchReader`` (batches.py) and says
``attached`` if that memory is the server's; then it reads one Batch message
per batch and sends one ``Release`` per batch, carrying how long the trainer
waited for it. The reader decides when a slot goes back: a slot it gives back
while the stream reads that batch (owned tensors) rides on that batch's
Release; one given back later (a dropped view) gets a Release of its own.

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
from collections.abc import Iterator

import grpc
import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import NO_SLOT_MEMORY

from .batches import BatchReader, Release
from .checks import BatchOrder, check_header, check_rows, expect
from .connection import Connection
from .inline import InlineBatches
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
            if self._reader.shared:  # mapped or opened: say so
                self._outbox.put(feed_pb2.ClientMessage(attached=feed_pb2.Attached()))
        except BaseException:
            self.close()
            raise

    def batches(self) -> Iterator[tuple[int, list[feed_pb2.SampleFailure],
                                        dict[str, torch.Tensor] | None]]:
        """(seq, failures, tensors) of each batch to the stream's end; slots go back as
        soon as the tensors are owned, or once the trainer drops them (views).
        ``tensors`` is None for a batch whose every sample failed."""
        reader = self._reader
        assert reader is not None
        while True:
            reader.make_room()
            waiting = time.perf_counter()
            message = next(self._call, None)
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
            self._outbox.put(feed_pb2.ClientMessage(release=feed_pb2.Release(
                seqs=[batch.seq] if given_back else [], wait_seconds=waited)))
            yield batch.seq, batch.failures, tensors

    def deal(self, batches: list[int], last: bool = False) -> None:
        """Hand a ``dealt`` stream the pass's batches ``batches`` to make next (from any
        thread); ``last``: no more will come, so the stream ends after them."""
        self._outbox.put(feed_pb2.ClientMessage(deal=feed_pb2.Deal(batches=batches, last=last)))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._call.cancel()
        self._outbox.put(None)

    def _release(self, seq: int) -> None:
        """The reader gives batch ``seq``'s slot back (from any thread)."""
        if self._reading == (seq, threading.get_ident()):  # during tensors(): ride along
            self._given_back = True
        else:
            self._outbox.put(feed_pb2.ClientMessage(release=feed_pb2.Release(seqs=[seq])))


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
