"""``Loader``: an iterable of batches; each pass over it is one epoch.

A pass opens a Stream for the loader's current epoch, reads the header, maps
the stream's memory (shm) and yields one ``dict[str, torch.Tensor]`` per batch:
``image`` uint8 [N, 3, H, W], ``index`` int64 [N] (each sample's position in the
request's file list) and ``label`` int64 [N] when labels were given. Samples
that failed to read or decode are left out of the batch; they are logged once
each and listed in ``loader.failures`` for the current pass.

The loader knows its position (batches consumed in the current epoch). When a
stream breaks with UNAVAILABLE (server restarted, draining, or it ended a
stream the trainer left idle past its lease timeout), the loader reconnects
with bounded backoff and reopens at that position, so the pass neither loses
nor repeats a sample; it gives up after ``reconnect_timeout`` seconds without
progress. ``state_dict()`` records the same position for a restarted trainer.
"""

from __future__ import annotations

import logging
import queue
import time
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
_MAX_BACKOFF = 2.0


class Loader:
    def __init__(self, client: FeedClient, request: feed_pb2.StreamRequest, *, copy: bool,
                 reconnect_timeout: float):
        self._client = client
        self._request = request
        self._copy = copy
        self._reconnect_timeout = reconnect_timeout
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
        self.failures = []
        outage_since = None
        backoff = 0.05
        while True:
            try:
                for batch in self._pass():
                    outage_since, backoff = None, 0.05
                    yield batch
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or self._reconnect_timeout <= 0:
                    raise FeedError.from_rpc(e, self._client.address) from None
                now = time.monotonic()
                outage_since = outage_since or now
                if now - outage_since >= self._reconnect_timeout:
                    raise FeedError(grpc.StatusCode.UNAVAILABLE,
                                    f"gave up after {self._reconnect_timeout:g} s without a batch "
                                    f"from {self._client.address}: {e.details()}") from None
                _log.warning("stream interrupted (%s); resuming at batch %d", e.details(),
                             self._consumed)
                time.sleep(backoff)
                backoff = min(2 * backoff, _MAX_BACKOFF)
        self._consumed = 0  # the pass is complete: the next one starts the epoch over

    def _pass(self) -> Iterator[dict[str, torch.Tensor]]:
        """One Stream call from the current position to the end of the epoch."""
        request = feed_pb2.StreamRequest()
        request.CopyFrom(self._request)
        request.start_batch = self._consumed
        if request.transport == feed_pb2.TRANSPORT_AUTO:
            request.transport = self._client.auto_transport()
        outbox: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe from GC callbacks
        outbox.put(feed_pb2.ClientMessage(open=request))

        def release(seq: int, waited: float = 0.0) -> None:
            outbox.put(feed_pb2.ClientMessage(
                release=feed_pb2.Release(seqs=[seq] if seq >= 0 else [], wait_seconds=waited)))

        call = self._client.stub.Stream(iter(outbox.get, None), metadata=self._client.metadata)
        try:
            header = next(call).header
            self.transport = feed_pb2.Transport.Name(header.transport).removeprefix("TRANSPORT_").lower()
            if header.transport == feed_pb2.TRANSPORT_SHM:
                batches = ShmBatches(header, release, self._copy)
                outbox.put(feed_pb2.ClientMessage(attached=feed_pb2.Attached()))
            elif header.transport == feed_pb2.TRANSPORT_CUDA_IPC:
                from .cuda_ipc import CudaBatches

                batches = CudaBatches(header, release, self._copy)
            else:
                batches = InlineBatches()
            try:
                yield from self._batches(call, batches, release)
            finally:
                batches.close()
        finally:
            call.cancel()
            outbox.put(None)

    def _batches(self, call, batches, release) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of one open stream, each releasing its slot (now, or when dropped)."""
        while True:
            batches.make_room()
            waiting = time.perf_counter()
            message = next(call, None)
            waited = time.perf_counter() - waiting
            if message is None:
                return
            self._note_failures(message.batch)
            tensors = batches.tensors(message.batch)
            # Owned tensors give the slot back now; views give it back when dropped.
            release(message.batch.seq if batches.release_at_once else -1, waited)
            self._consumed = message.batch.seq + 1
            yield tensors

    def _note_failures(self, batch: feed_pb2.Batch) -> None:
        for failure in batch.failures:
            self.failures.append((failure.index, failure.reason))
            _log.warning("sample %d skipped: %s", failure.index, failure.reason)
