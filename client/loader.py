"""``Loader``: an iterable of batches; each pass over it is one epoch.

A pass opens a Stream for the loader's current epoch, reads the header, maps
the stream's memory (shm, cuda_ipc) and yields one ``dict[str, torch.Tensor]``
per batch: ``image`` uint8 [N, 3, H, W], ``index`` int64 [N] (each sample's
position in the request's file list) and ``label`` int64 [N] when labels were
given. Samples that failed to read or decode are left out of the batch; they
are logged once each and listed in ``loader.failures`` for the current pass.

The loader knows its position (batches consumed in the current epoch). When a
stream breaks with UNAVAILABLE (server restarted or draining, or it ended a
stream the trainer left idle past its lease timeout), the loader reconnects
with bounded backoff and reopens at that position, so the pass neither loses
nor repeats a sample; it gives up after ``reconnect_timeout`` seconds without
progress. ``state_dict()`` records the same position for a restarted trainer.

With several servers, the loader's shard is split statically by sample index:
part p of P is the sub-shard rank + world_size * p of world_size * P, served by
server p, and the parts' batches are interleaved in turn (p = 0, 1, ..., P-1,
0, ...; the part that has yielded least goes next), so the order stays
deterministic and resumable. When a server goes
away, its part moves to the next server at its own position: nothing is lost or
repeated. Interleaving in turn means the slowest server sets the pace.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator

import grpc
import torch

from gpufeed.v1 import feed_pb2

from .batches import InlineBatches, ShmBatches
from .errors import FeedError
from .connection import Connection, transport_name

__all__ = ["Loader"]

_log = logging.getLogger(__name__)
_MAX_BACKOFF = 2.0


class _Part:
    """One server's static share of the loader's shard, and how far it has got."""

    def __init__(self, index: int):
        self.index = index
        self.server = index  # the server serving it now; moves on when that one goes away
        self.consumed = 0  # batches of this part already yielded this epoch


class Loader:
    def __init__(self, servers: list[Connection], request: feed_pb2.StreamRequest, *, copy: bool,
                 reconnect_timeout: float):
        self._servers = servers
        self._request = request
        self._copy = copy
        self._reconnect_timeout = reconnect_timeout
        self._parts = [_Part(i) for i in range(len(servers))]
        # The last pass ran to its end: positions stay there (a checkpoint taken now
        # resumes with nothing left of this epoch) until a new pass starts over.
        self._completed = False
        self.transport: str | None = None  # of the stream opened last: "inline", "shm", ...
        self.classes: list[str] = []  # with labels="folder": label i is classes[i]
        self.failures: list[tuple[int, str]] = []

    @property
    def epoch(self) -> int:
        return self._request.epoch

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` (and its shuffle order) from the next pass on."""
        if epoch != self._request.epoch:
            self._request.epoch = epoch
            self._start_over()

    def state_dict(self) -> dict:
        """{"epoch", "seed", "batches_consumed"}: an int, or one per server with several."""
        consumed = [part.consumed for part in self._parts]
        return {"epoch": self._request.epoch, "seed": self._request.seed,
                "batches_consumed": consumed[0] if len(consumed) == 1 else consumed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self._request.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, "
                             f"this loader uses seed {self._request.seed}")
        consumed = state["batches_consumed"]
        consumed = [consumed] if isinstance(consumed, int) else list(consumed)
        if len(consumed) != len(self._parts):
            raise ValueError(f"state has positions for {len(consumed)} servers, this loader "
                             f"has {len(self._parts)}")
        self._request.epoch = state["epoch"]
        for part, n in zip(self._parts, consumed):
            part.consumed = n
        self._completed = False

    def _start_over(self) -> None:
        for part in self._parts:
            part.consumed = 0
        self._completed = False

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._completed:  # iterating again without set_epoch: the same epoch again
            self._start_over()
        self.failures = []
        streams = {part.index: self._part_batches(part) for part in self._parts}
        try:
            while streams:
                # In turn: the part that has yielded least goes next (ties: lowest index),
                # which also continues a resumed pass exactly where it stopped.
                part = min((self._parts[i] for i in streams), key=lambda p: (p.consumed, p.index))
                batch = next(streams[part.index], None)
                if batch is None:
                    del streams[part.index]
                else:
                    yield batch
        finally:
            for batches in streams.values():
                batches.close()
        self._completed = True

    def _part_batches(self, part: _Part) -> Iterator[dict[str, torch.Tensor]]:
        """The part's batches to the end of the epoch, across reconnects and failovers."""
        outage_since = None
        backoff, tried = 0.05, 0
        while True:
            server = self._servers[part.server]
            try:
                if outage_since is not None:  # a server that accepts TCP but never answers
                    server.wait_ready(outage_since + self._reconnect_timeout - time.monotonic())
                for batch in self._pass(part, server):
                    outage_since, backoff, tried = None, 0.05, 0
                    yield batch
                return
            except (grpc.RpcError, FeedError) as e:
                code, details = _status(e)
                if code != grpc.StatusCode.UNAVAILABLE or self._reconnect_timeout <= 0:
                    raise e if isinstance(e, FeedError) else FeedError.from_rpc(
                        e, server.address) from None
                now = time.monotonic()
                outage_since = outage_since or now
                if now - outage_since >= self._reconnect_timeout:
                    raise FeedError(grpc.StatusCode.UNAVAILABLE,
                                    f"gave up after {self._reconnect_timeout:g} s without a batch "
                                    f"from {server.address}: {details}") from None
                part.server = (part.server + 1) % len(self._servers)
                _log.warning("stream from %s interrupted (%s); resuming at batch %d on %s",
                             server.address, details, part.consumed,
                             self._servers[part.server].address)
                tried += 1
                if tried >= len(self._servers):  # every server tried: wait before the next round
                    time.sleep(backoff)
                    backoff, tried = min(2 * backoff, _MAX_BACKOFF), 0

    def _pass(self, part: _Part, server: Connection) -> Iterator[dict[str, torch.Tensor]]:
        """One Stream call for ``part`` from its position to the end of the epoch."""
        request = feed_pb2.StreamRequest()
        request.CopyFrom(self._request)
        if len(self._parts) > 1:
            world_size = request.world_size or 1
            request.rank += world_size * part.index
            request.world_size = world_size * len(self._parts)
        request.start_batch = part.consumed
        if request.transport == feed_pb2.TRANSPORT_AUTO:
            request.transport = server.auto_transport()
        outbox: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe from GC callbacks
        outbox.put(feed_pb2.ClientMessage(open=request))

        def release(seq: int, waited: float = 0.0) -> None:
            outbox.put(feed_pb2.ClientMessage(
                release=feed_pb2.Release(seqs=[seq] if seq >= 0 else [], wait_seconds=waited)))

        call = server.stub.Stream(iter(outbox.get, None), metadata=server.metadata)
        try:
            header = next(call).header
            self.classes = list(header.classes)
            self.transport = transport_name(header.transport)
            if header.transport == feed_pb2.TRANSPORT_SHM:
                batches = ShmBatches(header, release, self._copy)
            elif header.transport == feed_pb2.TRANSPORT_CUDA_IPC:
                from .cuda_ipc import CudaBatches

                batches = CudaBatches(header, release, self._copy)
            else:
                batches = InlineBatches()
            if header.transport != feed_pb2.TRANSPORT_INLINE:  # mapped or opened: say so
                outbox.put(feed_pb2.ClientMessage(attached=feed_pb2.Attached()))
            expected_end = part.consumed + header.num_batches  # 0 batches: a shared job
            try:
                yield from self._batches(part, call, batches, release)
            finally:
                batches.close()
            if header.num_batches and part.consumed < expected_end:
                raise FeedError(grpc.StatusCode.UNAVAILABLE,
                                f"the stream ended at batch {part.consumed} of {expected_end}")
        finally:
            call.cancel()
            outbox.put(None)

    def _batches(self, part: _Part, call, batches, release) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of one open stream, each releasing its slot (now, or when dropped)."""
        while True:
            batches.make_room()
            waiting = time.perf_counter()
            message = next(call, None)
            waited = time.perf_counter() - waiting
            if message is None:
                return
            self._note_failures(message.batch)
            if not message.batch.tensors:  # every sample failed: nothing to train on
                release(message.batch.seq, waited)
                part.consumed = message.batch.seq + 1
                continue
            tensors = batches.tensors(message.batch)
            # Owned tensors give the slot back now; views give it back when dropped.
            release(message.batch.seq if batches.release_at_once else -1, waited)
            part.consumed = message.batch.seq + 1
            yield tensors

    def _note_failures(self, batch: feed_pb2.Batch) -> None:
        for failure in batch.failures:
            self.failures.append((failure.index, failure.reason))
            _log.warning("sample %d skipped: %s", failure.index, failure.reason)


def _status(error: grpc.RpcError | FeedError) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, FeedError):
        return error.code, str(error)
    return error.code(), error.details() or ""
