"""One Stream call: opened, its header read and its memory mapped, then its batches.

Opening is separate from reading so that a loader can open its first stream
when it is made: the server's refusal of the request, and the header's facts
(classes, batch count), are then known at ``loader(...)``, and the server
starts decoding while the trainer sets up.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import torch

from gpufeed.v1 import feed_pb2

from .batches import InlineBatches, ShmBatches
from .connection import Connection

__all__ = ["OpenStream"]


class OpenStream:
    """A Stream call to ``server`` for ``request``, open and attached; ``close()`` ends it.

    Raises what the call raises (grpc.RpcError, FeedError) if the server refuses
    the request or the stream's memory cannot be opened.
    """

    def __init__(self, server: Connection, request: feed_pb2.StreamRequest, copy: bool):
        self.request = request
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe from GC callbacks
        self._outbox.put(feed_pb2.ClientMessage(open=request))
        self._call = server.stub.Stream(iter(self._outbox.get, None), metadata=server.metadata)
        self._batches = None
        try:
            self.header: feed_pb2.StreamHeader = next(self._call).header
            server.answered = True
            if self.header.transport == feed_pb2.TRANSPORT_SHM:
                self._batches = ShmBatches(self.header, self._release, copy)
            elif self.header.transport == feed_pb2.TRANSPORT_CUDA_IPC:
                from .cuda_ipc import CudaBatches

                self._batches = CudaBatches(self.header, self._release, copy)
            else:
                self._batches = InlineBatches(copy)
            if self.header.transport != feed_pb2.TRANSPORT_INLINE:  # mapped or opened: say so
                self._outbox.put(feed_pb2.ClientMessage(attached=feed_pb2.Attached()))
        except BaseException:
            self.close()
            raise

    def batches(self) -> Iterator[tuple[int, list[feed_pb2.SampleFailure],
                                        dict[str, torch.Tensor] | None]]:
        """(seq, failures, tensors) of each batch to the stream's end; slots go back as
        soon as the tensors are owned, or once the trainer drops them (views).
        ``tensors`` is None for a batch whose every sample failed."""
        while True:
            self._batches.make_room()
            waiting = time.perf_counter()
            message = next(self._call, None)
            waited = time.perf_counter() - waiting
            if message is None:
                return
            if not message.batch.tensors:  # every sample failed: the server sent no rows
                self._release(message.batch.seq, waited)
                yield message.batch.seq, message.batch.failures, None
                continue
            tensors, owned = self._batches.tensors(message.batch)
            self._release(message.batch.seq if owned else -1, waited)
            yield message.batch.seq, message.batch.failures, tensors

    def close(self) -> None:
        if self._batches is not None:
            self._batches.close()
        self._call.cancel()
        self._outbox.put(None)

    def _release(self, seq: int, waited: float = 0.0) -> None:
        """Give batch ``seq``'s slot back (none for seq < 0), reporting time spent waiting."""
        self._outbox.put(feed_pb2.ClientMessage(
            release=feed_pb2.Release(seqs=[seq] if seq >= 0 else [], wait_seconds=waited)))
