"""One open stream: decode its batches into ring slots and publish them in order.

Batches start in order, each as soon as a slot is free (at open, then on every
release), taken from the stream's source (its own pass, or a shared job's, see
sources.py); their rows go to the shared decode pool and may finish in any order.
``published()`` hands batches out strictly by seq, so a batch's content never
depends on timing: the reorder buffer is the ring itself.

The slots live in the stream's ``SlotMemory`` (memory/slots.py), whatever the
transport: decode threads write its host bytes, and when a batch's last row is
written the memory runs the batch pass if it runs it on the host.

Threads: the gRPC handler iterates ``published()``; the client-reader thread
calls ``release()`` and ``attach()``; decode threads call ``decode_row()``. One
condition variable guards the stream's state.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from gpufeed.v1.vocabulary import UNHANDED, UNREAD

from ...media.batch_jpeg import Deferred
from ...media.samples import Decoders
from ...memory.ring import SlotRing
from ...memory.slots import SlotMemory
from ...metrics import ServerMetrics
from ...storage.roots import Storage
from ..errors import (
    ClientGone,
    FailureBudgetSpent,
    LeaseExpired,
    ServerFault,
    StreamEnded,
    UnpaddableBatch,
)
from ..failures import sample_failure
from ..planning.order import samples_at
from ..planning.plan import StreamPlan
from .pool import DecodePool
from .sources import BatchSource, DealtBatches, OwnBatches

if TYPE_CHECKING:
    import torch

__all__ = ["SlotBatch", "Stream", "StreamState"]

_log = logging.getLogger(__name__)


# Samples tried for a padding row before a split over ranks gives up on an all-failed
# batch (SlotBatch._refill): enough for a run of broken files, bounded for a broken data set.
_REFILL_TRIES = 32


class StreamState(enum.Enum):
    """Where a stream is in its life; it only moves forward::

        SERVING ──cancel()──▶ CANCELLED ──client_left()──▶ GONE
           └───────────────────client_left()─────────────────┘

    SERVING: batches start and are published. CANCELLED: it has ended (last
    batch, failure budget, lease, drain, error); nothing new starts, but the
    client may still attach the memory the header named. GONE: the call is
    over, and nobody will attach any more.
    """

    SERVING = "serving"
    CANCELLED = "cancelled"
    GONE = "gone"


def _described(error: BaseException) -> str:
    """``Type: message``, or the type alone when the message cannot be made."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:
        return type(error).__name__


class SlotBatch:
    """A batch being filled in one slot; ``rows`` is its final sample count. (The wire's
    ``feed_pb2.Batch`` is the message that describes a finished one to the client.)

    ``seq`` counts the stream's batches; ``number`` is the batch's position in the
    pass (the same for a private pass, not for a shared job); ``indices`` are its
    samples' (an index is always a sample's position in the request's list).
    """

    def __init__(self, stream: Stream, seq: int, slot: int, number: int):
        self.seq = seq
        self.slot = slot
        self.number = number
        # Sample indices, and which rows repeat a sample to pad the ranks even (planning/order.py).
        indices, self.padded = samples_at(stream.plan.batches[number], len(stream.plan.paths))
        self.indices = indices
        self.arrays = stream.plan.layout.views(stream.ring.slot(slot))
        # (row, category, detail) of each row that failed, while decoding
        self._failed_rows: list[tuple[int, int, str]] = []
        # Rows read whose decode waits for the batch's end (--decoder nvimgcodec).
        self._deferred: list[Deferred] = []
        # Whether that decode wrote the pixels to the memory's device twin, not the host ring.
        self.pixels_on_device = False
        # (sample index, category, reason naming the file), sorted, once finished
        self.failures: list[tuple[int, int, str]] = []
        self.rows = len(indices)
        # Variable-length fields, packed: entries sent of each (media/fields.py), by name.
        self.lengths: dict[str, int] = {}
        self._stream = stream
        self._pending = len(indices)
        self.done = False
        self._started = time.perf_counter()  # the batch stage's start

    def decode_row(self, row: int, decoders: Decoders) -> None:
        """Read sample ``indices[row]`` into row ``row`` (run by a decode thread).

        Whatever reading, decoding or a plugin's transform raises fails that sample
        alone: the row is always counted, or its batch would never finish and its
        trainer would wait for it forever.
        """
        stream = self._stream
        failure = None
        if not stream.cancelled:
            index = int(self.indices[row])
            try:
                self._read(index, row, decoders)
            # BaseException too: a plugin's sys.exit() or a stray KeyboardInterrupt would
            # otherwise end this decode thread with the row uncounted.
            except BaseException as e:  # the sample fails, the stream goes on (serving/failures.py)
                failure = sample_failure(e, index, self._shown(index))
        with stream.cond:
            if failure is not None:
                self._failed_rows.append((row, *failure))
            self._pending -= 1
            last = self._pending == 0
        if last:  # every row is written: this thread alone finishes the batch, unlocked
            try:
                self._finish(decoders)
            except BaseException as e:  # a bug, or out of memory: end the stream, say why
                _log.exception("finishing batch %d", self.seq)
                stream.cancel(ServerFault(f"server error finishing batch {self.seq}: "
                                          f"{_described(e)}"))
            finally:
                with stream.cond:
                    self.done = True
                    stream.cond.notify_all()

    def sent(self, name: str) -> np.ndarray:
        """The array ``name`` as sent: its first ``rows`` rows, or, for a packed
        variable-length field and its offsets, its first entries."""
        array = self.arrays[name]
        length = self.lengths.get(name)
        if length is None:
            return array[:self.rows]
        return array.reshape(-1, *array.shape[2:])[:length]

    def _shown(self, index: int) -> str:
        """Sample ``index``'s file as the request named it, for a failure's reason; its
        position if even that fails (a name that cannot be located is a failure to
        report, not a second one to raise)."""
        storage = self._stream.storage
        try:
            return storage.shown(self._stream.plan.paths[index])
        except Exception:
            return f"samples[{index}]"

    def skip_row(self, row: int) -> None:
        """Count a row of a cancelled stream as done without decoding it."""
        with self._stream.cond:
            self._pending -= 1
            if self._pending == 0:
                self.done = True
                self._stream.cond.notify_all()

    def _read(self, index: int, row: int, decoders: Decoders, defer: bool = True) -> None:
        """Sample ``index`` into row ``row`` (or, when the plan defers decodes, its read,
        the decode left for the batch's end: batch_jpeg.py), then the request's sample
        transforms on it (a plan with transforms defers nothing), then its name when the
        request asks for names (after the read, so that a sample that fails keeps its own
        reason); raises what reading, decoding, a transform or a name over its room
        (planning/batchnames.py) raises."""
        stream, plan = self._stream, self._stream.plan
        if defer and plan.defers:
            plan.reader.read_deferring(stream.storage, plan.paths[index], index, self.arrays,
                                       row, decoders, stream.metrics.stages, self._deferred)
        else:
            plan.reader.read_into(stream.storage, plan.paths[index], index, self.arrays, row,
                                  decoders, stream.metrics.stages)
        if plan.sample_transforms is not None:
            plan.sample_transforms.apply(self.arrays, row, index)
        if plan.names is not None:
            plan.names.write(self.arrays, row, plan.reader.name(stream.storage, plan.paths, index))

    def _refill(self, decoders: Decoders) -> np.ndarray:
        """The sample index that stands in for a batch whose every sample failed, read into
        row 0; empty (the stream cancelled with DATA_LOSS) if none of the tries decodes.

        Every rank must yield each of its batches (a rank one batch short hangs DDP at
        the epoch's end), so such a batch of a split over ranks goes out with one padding
        row: the first sample after the batch's last in the request's list (wrapping
        round) that decodes. Like DistributedSampler's padding it is a real sample with
        its own label, a repeat marked ``padded``, and a pure function of the request
        and of which files fail. Failures while looking are not listed: each such
        sample fails (and is counted) in its own batch of some rank.
        """
        num_samples = len(self._stream.plan.paths)
        own = set(self.indices.tolist())
        after = int(self.indices[-1]) + 1
        tried = 0
        for k in range(num_samples):
            index = (after + k) % num_samples
            if index in own:
                continue
            tried += 1
            try:
                self._read(index, 0, decoders, defer=False)
                return np.array([index], dtype=np.int64)
            except BaseException:  # reported in its own batch (decode_row says why BaseException)
                if tried == _REFILL_TRIES:
                    break
        self._stream.cancel(UnpaddableBatch(
            f"batch {self.seq}: every sample failed, and so did the {tried} samples after it "
            f"in the list; with world_size > 1 every rank must yield the batch, and there is "
            f"no sample to pad it with"))
        return self.indices[:0]

    def _device_pixels(self) -> torch.Tensor | None:
        """The slot's pixel rows in the memory's device twin (cuda_ipc), offered to the
        batch decode when every row waits for it: decoded there whole, the batch needs no
        copy through the host. Any other batch keeps its pixels on the host, where rows
        decoded on the CPU join them and the gaps of failed rows are closed."""
        if len(self._deferred) != len(self.indices) or self._failed_rows:
            return None
        views = self._stream.memory.device_views(self.slot)
        if views is None:
            return None
        return views[self._stream.plan.layout.pixels][:len(self.indices)]

    def _finish(self, decoders: Decoders) -> None:
        """Decode the rows left for the batch's end (into the device twin, where the
        memory has one and takes the batch whole: ``pixels_on_device``), close the gaps
        failed rows left (a split over ranks refills an empty batch), fill
        index/label/padded, pack the variable-length fields and names, and hand the slot
        to the memory (which runs the batch pass on the host, or leaves it for publish)."""
        plan = self._stream.plan
        if self._deferred and not self._stream.cancelled:  # one decode for the batch's JPEGs
            decoded = plan.reader.decode_deferred(self._deferred, self.arrays, decoders,
                                                  self._stream.metrics.stages,
                                                  self._device_pixels())
            self.pixels_on_device = decoded.on_device
            for row, error in decoded.failed:
                index = int(self.indices[row])
                self._failed_rows.append((row, *sample_failure(error, index, self._shown(index))))
        self._deferred = []
        ok = np.ones(len(self.indices), dtype=bool)
        for row, _, _ in self._failed_rows:
            ok[row] = False
        self._stream.metrics.failed([category for _, category, _ in self._failed_rows])
        # Each reason names its file: a trainer that named a directory has no list to
        # look the index up in.
        self.failures = sorted(
            (index, category, f"{self._shown(index)}: {why}")
            for index, category, why in ((int(self.indices[row]), category, why)
                                         for row, category, why in self._failed_rows))
        kept, padded = self.indices[ok], self.padded[ok]
        rows = len(kept)
        if 0 < rows < len(self.indices):
            for array in self.arrays.values():
                array[:rows] = array[:len(self.indices)][ok]
        if rows == 0 and "padded" in self.arrays and not self._stream.cancelled:
            kept = self._refill(decoders)
            rows, padded = len(kept), np.ones(len(kept), dtype=bool)
        self.rows = rows
        self.arrays["index"][:rows] = kept
        if plan.labels is not None:
            self.arrays["label"][:rows] = plan.labels[kept]
        if "padded" in self.arrays:
            self.arrays["padded"][:rows] = padded
        if plan.fields is not None:
            self.lengths = plan.fields.pack(self.arrays, rows)
        if plan.names is not None:
            self.lengths.update(plan.names.pack(self.arrays, rows))
        if not self._stream.cancelled:
            self._stream.memory.filled(self._stream.ring.slot(self.slot), rows)
        self._stream.metrics.stages["batch"].observe(time.perf_counter() - self._started)


class Stream:
    """One stream's batches, from its source's batch numbers to published slots.

    ``plan`` says what to decode and how; ``memory`` holds the ring's slots
    (any transport); ``source`` hands out the pass's batch numbers (the
    stream's own pass by default, or a shared job's); ``pool`` runs the rows.
    The stream starts a batch whenever a slot is free, publishes batches by
    seq, and ends as ``state`` says (``StreamState``). It does not own
    ``memory``: whoever made it closes it after ``close()`` (and, for a
    shared memory, after ``wait_attached``).
    """

    def __init__(self, plan: StreamPlan, storage: Storage, pool: DecodePool[Decoders],
                 memory: SlotMemory, metrics: ServerMetrics | None = None,
                 source: BatchSource | None = None):
        self.plan = plan
        self.memory = memory
        self.source = source if source is not None else OwnBatches(plan)
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.storage = storage
        self.ring = SlotRing(memory.host, plan.num_slots, plan.layout.slot_bytes)
        self.cond = threading.Condition()
        self.state = StreamState.SERVING
        # Apart from the state: a client may attach after the stream was cancelled.
        self._attached = False
        self.reads_lane = False  # the client said it reads the batches on the stream's lane
        self._ending: StreamEnded = ClientGone()
        self._last_heard = time.monotonic()  # a Release or a Deal
        self._read_any = False  # a Release came: the client reads the stream's batches
        self._pool = pool
        self._batches: dict[int, SlotBatch] = {}
        self._next_seq = plan.start_batch  # the seq the next batch started will get
        self._next_out = plan.start_batch  # the seq published next

    @property
    def cancelled(self) -> bool:
        """Whether the stream has ended: no batch starts, no row is decoded any more."""
        return self.state is not StreamState.SERVING

    def start(self) -> None:
        with self.cond:
            self._start_ready()

    def release(self, seqs) -> None:
        """The client no longer reads these batches: their slots take the next ones.

        Raises KeyError for a seq that holds no slot (a confused client).
        """
        with self.cond:
            self._read_any = True  # the client sends one (perhaps empty) per batch it reads
            for seq in seqs:
                if seq >= self._next_out:  # leased, but not sent: decode threads may be writing
                    raise KeyError(seq)
                self.ring.release(seq)
                self._batches.pop(seq).arrays = {}  # sent and returned: nothing reads it
            if seqs:
                self._last_heard = time.monotonic()
            self._start_ready()

    def deal(self, numbers, last: bool) -> None:
        """The client hands this (dealt) stream the pass's batches ``numbers``; ``last``:
        no more will come. Raises ValueError for a deal the stream refuses."""
        if not isinstance(self.source, DealtBatches):
            raise ValueError("deal: this stream was not opened with `dealt`")
        self.source.deal(numbers, last)
        with self.cond:
            self._last_heard = time.monotonic()
        self.wake()

    def wake(self) -> None:
        """The source may have batches again, or be finished (a shared job moved on)."""
        with self.cond:
            self._start_ready()
            self.cond.notify_all()

    def attach(self, lane: bool = False) -> None:
        """The client has mapped or opened the stream's memory (``memory.attached()``);
        ``lane``: and connected to the stream's lane, where it reads the batches."""
        self.memory.attached()
        with self.cond:
            self.reads_lane = lane
            self._attached = True
            self.cond.notify_all()

    def wait_attached_while_serving(self, deadline: float) -> None:
        """Until the client has said ``attached``, the stream has ended, or ``deadline``
        (time.monotonic) has passed: where to send the first batch is then known."""
        with self.cond:
            self.cond.wait_for(lambda: self._attached or self.cancelled,
                               max(deadline - time.monotonic(), 0))

    def wait_attached(self, deadline: float) -> None:
        """Until the client has mapped (or opened) the memory, is gone, or ``deadline``
        (time.monotonic) has passed.

        Whatever ends a stream (its last batch, a failure budget spent, a drain)
        can come before the client has mapped the segment the header named:
        unlinking it then would turn the real status into "cannot map".
        """
        with self.cond:
            self.cond.wait_for(lambda: self._attached or self.state is StreamState.GONE,
                               max(deadline - time.monotonic(), 0))

    def client_left(self) -> None:
        """The call is over (gRPC's callback: the client cancelled or its connection
        dropped, or, after the handler, any end): nobody will attach any more."""
        self.cancel()
        with self.cond:
            self.state = StreamState.GONE
            self.cond.notify_all()

    def cancel(self, ending: StreamEnded | None = None) -> None:
        """End the stream; ``published()`` raises ``ending`` (default: the client is gone)."""
        with self.cond:
            if self.state is StreamState.SERVING:
                self.state = StreamState.CANCELLED
                self._ending = ending if ending is not None else ClientGone()
            self.cond.notify_all()

    def published(self) -> Iterator[SlotBatch]:
        """Finished batches by seq.

        Raises what ended the stream when it is cancelled, FailureBudgetSpent when
        more samples failed than the request's budget, LeaseExpired when the
        trainer has held every slot for longer than the lease timeout.
        """
        failed: list[tuple[int, int, str]] = []
        while True:
            with self.cond:
                batch = self._wait_done(self._next_out)
                if batch is None:
                    return
                self._next_out += 1
            failed += batch.failures
            if len(failed) > self.plan.max_failures:
                # Not sent: a shared job's other consumers will send it (within their budgets).
                self.source.give_back([batch.number])
                examples = "; ".join(f"sample {i}: {why}" for i, _, why in failed[:5])
                raise FailureBudgetSpent(
                    f"{len(failed)} samples failed, over this stream's failure budget of "
                    f"{self.plan.max_failures} (max_failures / max_failure_fraction): {examples}")
            self.source.sent(batch.number)
            yield batch

    def _wait_done(self, seq: int) -> SlotBatch | None:
        """Batch ``seq`` once decoded; None once the source has no batch left for it."""
        while True:
            if self.cancelled:  # a new exception: the stored one would keep this frame (and
                # the stream, its plan) in a cycle through its traceback, until a collection
                raise self._ending.again()
            batch = self._batches.get(seq)
            if batch is not None and batch.done:
                return batch
            timeout = None
            if batch is None and self.source.finished():
                return None
            full = not self.ring.free_slots()
            if batch is None and (full or self.source.waits_for_client):  # the client must act
                idle = time.monotonic() - self._last_heard
                if idle >= self.plan.lease_timeout:
                    what = (UNHANDED if not full else
                            "the trainer released no batch" if self._read_any else UNREAD)
                    raise LeaseExpired(
                        f"lease timeout: {what} for {self.plan.lease_timeout:g} s "
                        f"(server's --lease-timeout); resume from batch {seq}")
                timeout = self.plan.lease_timeout - idle
            self.cond.wait(timeout)

    def close(self) -> None:
        """Cancel, give back batches never sent, wait until no decode thread writes the ring.

        Rows still queued are taken off the pool (they would only be skipped), so
        closing needs no decode thread: it works while the pool shuts down too.
        """
        self.cancel()
        for batch, row in self._pool.drop(self):
            batch.skip_row(row)
        with self.cond:
            unsent = [b.number for seq, b in self._batches.items() if seq >= self._next_out]
            self.cond.wait_for(lambda: all(b.done for b in self._batches.values()))
            # Batches and the stream refer to each other; drop the views of the ring
            # now rather than at the next garbage collection, so its memory (and a
            # shared-memory mapping's descriptor) goes as soon as the stream ends.
            for batch in self._batches.values():
                batch.arrays = {}
            self._batches.clear()
            self.ring.close()
        self.plan.reader.forget(self.storage)  # reads issued ahead for rows never decoded
        self.source.give_back(unsent)

    def _start_ready(self) -> None:
        while not self.cancelled and self.ring.free_slots():
            number = self.source.claim()
            if number is None:
                return
            slot = self.ring.lease(self._next_seq)
            assert slot is not None, "a slot is free: the loop checked free_slots()"
            batch = SlotBatch(self, self._next_seq, slot, number)
            self._batches[self._next_seq] = batch
            self._next_seq += 1
            self.plan.reader.read_ahead(self.storage, batch.indices, self.plan.paths)  # I/O stage
            self._pool.submit(self, batch, range(len(batch.indices)))
