"""``Loader``: an iterable of batches; each pass over it is one Stream call.

A pass opens a stream for the loader's current epoch, reads the header,
maps the stream's memory (shm) and yields one ``dict[str, torch.Tensor]`` per
batch: ``image`` uint8 [N, 3, H, W], ``index`` int64 [N] (each sample's position
in the request's file list) and ``label`` int64 [N] when labels were given.
Samples that failed to read or decode are left out of the batch; they are
logged once each and listed in ``loader.failures`` for the current pass.

``state_dict()`` records (epoch, seed, batches consumed); a loader that loads it
resumes its next pass right after the last batch consumed.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
import torch

from gpufeed.v1 import feed_pb2

from .batches import InlineBatches, ShmBatches
from .errors import FeedError

if TYPE_CHECKING:
    from .feed import FeedClient

__all__ = ["Loader"]

_log = logging.getLogger(__name__)


class Loader:
    def __init__(self, client: FeedClient, request: feed_pb2.StreamRequest, copy: bool):
        self._client = client
        self._request = request
        self._copy = copy
        self._consumed = 0  # batches of the current epoch already yielded
        self.transport: str | None = None  # set when a pass opens: "inline" or "shm"
        self.failures: list[tuple[int, str]] = []

    @property
    def epoch(self) -> int:
        return self._request.epoch

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` (and its shuffle order) from the next pass on."""
        if epoch != self._request.epoch:
            self._request.epoch = epoch
            self._consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._request.epoch, "seed": self._request.seed,
                "batches_consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self._request.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, "
                             f"this loader uses seed {self._request.seed}")
        self._request.epoch = state["epoch"]
        self._consumed = state["batches_consumed"]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        request = feed_pb2.StreamRequest()
        request.CopyFrom(self._request)
        request.start_batch = self._consumed
        if request.transport == feed_pb2.TRANSPORT_AUTO:
            request.transport = self._client.auto_transport()
        self.failures = []
        try:
            yield from self._pass(request)
        except grpc.RpcError as e:
            raise FeedError.from_rpc(e, self._client.address) from None
        self._consumed = 0  # the pass is complete: the next one starts the epoch over

    def _pass(self, request: feed_pb2.StreamRequest) -> Iterator[dict[str, torch.Tensor]]:
        outbox: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe from GC callbacks
        outbox.put(feed_pb2.ClientMessage(open=request))

        def release(seq: int) -> None:
            outbox.put(feed_pb2.ClientMessage(release=feed_pb2.Release(seqs=[seq])))

        call = self._client.stub.Stream(iter(outbox.get, None))
        try:
            header = next(call).header
            self.transport = feed_pb2.Transport.Name(header.transport).removeprefix("TRANSPORT_").lower()
            if header.transport == feed_pb2.TRANSPORT_SHM:
                batches = ShmBatches(header, release, self._copy)
                outbox.put(feed_pb2.ClientMessage(attached=feed_pb2.Attached()))
                make_room = batches.make_room
            else:
                batches = InlineBatches(header, release)
                make_room = _nothing
            while True:
                make_room()
                message = next(call, None)
                if message is None:
                    return
                self._note_failures(message.batch)
                tensors = batches.tensors(message.batch)
                self._consumed = message.batch.seq + 1
                yield tensors
        finally:
            call.cancel()
            outbox.put(None)

    def _note_failures(self, batch: feed_pb2.Batch) -> None:
        for failure in batch.failures:
            self.failures.append((failure.index, failure.reason))
            _log.warning("sample %d skipped: %s", failure.index, failure.reason)


def _nothing() -> None:
    pass
