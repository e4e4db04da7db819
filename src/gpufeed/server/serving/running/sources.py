"""Where a stream's batches come from: its own pass, the client's hand, or a job.

A stream asks its source (a ``BatchSource``) for the next batch of the pass
(``claim``) whenever it has a free slot. ``OwnBatches`` is a stream's private
pass, from its resume position on, in order. ``DealtBatches`` are the batches
the client hands the stream (a loader over several servers hands each the
next batch as its stream has room, so each server works at its own pace).
``SharedJob`` is one pass shared by every stream that names the same job and
epoch (tf.data service's dynamic sharding): each batch goes to whichever
consumer has a free slot first, so a slow consumer receives fewer batches
instead of stalling the others, and the union over consumers is every batch
once.

What a shared job keeps and loses: the content of batch k is still a pure
function of the request (seed, epoch), but which consumer receives it, and in
what order a consumer sees its batches, depends on timing; a consumer cannot
resume at a position (it rejoins the job instead). A consumer that leaves gives
back the batches it had claimed but not yet sent, and another consumer sends
them; batches already sent to a consumer that dies are not sent again (at most
once across consumers, as with tf.data service).

A job lives in the server's memory, and keeps only its place in the pass (a few
counters and the batches given back): the samples each batch holds come from
each consumer's own plan, which goes when its stream ends. So a job whose last
consumer has left holds next to nothing (a plan costs bytes per sample, so
keeping idle jobs' plans would cost gigabytes for large passes), and it is
kept so that a consumer that reconnects or is restarted continues the pass:
for ten minutes, and at most 256 jobs without a consumer, the one idle longest
forgotten first. A job that is forgotten, or
lost in a server restart, starts its pass again with its next consumer.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Protocol

from gpufeed.v1 import feed_pb2

from ..errors import InvalidRequest
from ..planning.plan import StreamPlan

__all__ = ["BatchSource", "DealtBatches", "JobRegistry", "OwnBatches", "SharedJob"]

# Jobs without a consumer kept at most; and for at most this long: the next
# consumer to name a forgotten job starts a new pass.
_IDLE_KEPT = 256
_IDLE_SECONDS = 600.0


class BatchSource(Protocol):
    """Where a stream takes the numbers of its pass's batches from.

    ``claim`` hands out the next batch number to fill, or None when there is none
    for this stream now; ``sent`` says a claimed batch reached its trainer;
    ``give_back`` returns claimed batches never sent (a stream that ends early), to
    be claimed again by another consumer; ``finished`` says every batch of the pass
    was sent, so a stream that claims None can end. Called from the stream's
    threads, so a source shared by several streams is thread-safe.
    """

    def claim(self) -> int | None: ...

    def sent(self, number: int) -> None: ...

    def give_back(self, numbers: list[int]) -> None: ...

    def finished(self) -> bool: ...

    waits_for_client: bool
    """Whether a stream with a free slot and nothing to claim waits on its client
    (which then has the lease timeout to act) rather than on other consumers."""


class OwnBatches(BatchSource):
    """A stream's private pass: batches start_batch.. in order."""

    waits_for_client = False

    def __init__(self, plan: StreamPlan):
        self._next = plan.start_batch
        self._end = len(plan.batches)

    def claim(self) -> int | None:
        if self._next >= self._end:
            return None
        self._next += 1
        return self._next - 1

    def sent(self, number: int) -> None:
        pass

    def give_back(self, numbers: list[int]) -> None:
        pass

    def finished(self) -> bool:
        return self._next >= self._end


class DealtBatches(BatchSource):
    """The batches the client hands the stream (Deal messages), in the order handed.

    At most ``room`` may wait unstarted (a client hands a batch when one it
    handed has arrived, so its stream's slots bound them): a client that hands
    more, or a batch outside the pass, or any after saying it was done, is
    refused with ValueError naming what it did. Thread-safe: the client-reader
    thread deals, the stream's threads claim.
    """

    waits_for_client = True

    def __init__(self, num_batches: int, room: int):
        self._num_batches = num_batches
        self._room = room
        self._lock = threading.Lock()
        self._handed: deque[int] = deque()
        self._last = False

    def deal(self, numbers, last: bool) -> None:
        with self._lock:
            if self._last:
                raise ValueError("deal: a Deal came after one that said `last`")
            bad = next((n for n in numbers if not 0 <= n < self._num_batches), None)
            if bad is not None:
                raise ValueError(f"deal.batches: {bad} is not a batch of the pass "
                                 f"(0..{self._num_batches - 1})")
            if len(self._handed) + len(numbers) > self._room:
                raise ValueError(f"deal.batches: {len(self._handed) + len(numbers)} batches "
                                 f"handed and not started, over the stream's {self._room} "
                                 f"slots; hand one when one has arrived")
            self._handed.extend(numbers)
            self._last = last

    def claim(self) -> int | None:
        with self._lock:
            return self._handed.popleft() if self._handed else None

    def sent(self, number: int) -> None:
        pass

    def give_back(self, numbers: list[int]) -> None:
        pass  # the client hands a lost stream's batches to another itself

    def finished(self) -> bool:
        with self._lock:
            return self._last and not self._handed


class SharedJob(BatchSource):
    """One pass over a job's batches, shared by its consumers. Thread-safe."""

    waits_for_client = False

    def __init__(self, name: str, num_batches: int, fingerprint: str):
        self.name = name
        self.num_batches = num_batches
        self.fingerprint = fingerprint
        self._lock = threading.Lock()
        self._next = 0
        self._returned: deque[int] = deque()  # given back by leaving consumers: first in line
        self._sent = 0
        self._consumers: set[Callable[[], None]] = set()  # each wakes one consumer stream
        self.idle_since: float | None = None  # when its last consumer left

    def claim(self) -> int | None:
        with self._lock:
            if self._returned:
                return self._returned.popleft()
            if self._next < self.num_batches:
                self._next += 1
                return self._next - 1
            return None

    def sent(self, number: int) -> None:
        with self._lock:
            self._sent += 1
            done = self._sent == self.num_batches
        if done:
            self._wake_all()

    def give_back(self, numbers: list[int]) -> None:
        if not numbers:
            return
        with self._lock:
            self._returned.extendleft(sorted(numbers, reverse=True))
        self._wake_all()

    def finished(self) -> bool:
        with self._lock:
            return self._sent == self.num_batches

    def add_consumer(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._consumers.add(wake)
            self.idle_since = None

    def remove_consumer(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._consumers.discard(wake)
            if not self._consumers:
                self.idle_since = time.monotonic()

    def consumers(self) -> int:
        with self._lock:
            return len(self._consumers)

    def _wake_all(self) -> None:
        with self._lock:
            consumers = list(self._consumers)
        for wake in consumers:
            wake()


class JobRegistry:
    """The shared jobs of a server, by (name, epoch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: OrderedDict[tuple[str, int], SharedJob] = OrderedDict()

    def join(self, request: feed_pb2.StreamRequest, plan: StreamPlan) -> SharedJob:
        """The job this request names, made by its first consumer."""
        key = (request.job, request.epoch)
        fingerprint = _fingerprint(request)
        with self._lock:
            self._forget_idle()
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = SharedJob(request.job, len(plan.batches), fingerprint)
                self._forget_oldest_idle()
            elif job.fingerprint != fingerprint:
                raise InvalidRequest(
                    f"job {request.job!r} epoch {request.epoch} was opened with a different "
                    f"request; every consumer of a job must ask for the same samples, batch "
                    f"size, output, shuffle and seed")
        return job

    def _forget_idle(self) -> None:
        now = time.monotonic()
        for key in [k for k, job in self._jobs.items()
                    if job.idle_since is not None and now - job.idle_since > _IDLE_SECONDS]:
            del self._jobs[key]

    def _forget_oldest_idle(self) -> None:
        """Keep jobs without consumers (a finished one gives a late consumer an empty
        stream, not a replay; an unfinished one continues), up to a bound."""
        idle = sorted((job.idle_since, key) for key, job in self._jobs.items()
                      if job.idle_since is not None)
        for _, key in idle[:max(0, len(idle) - _IDLE_KEPT)]:
            del self._jobs[key]


def _fingerprint(request: feed_pb2.StreamRequest) -> str:
    """What every consumer of a job must agree on: the request less its per-consumer fields
    (``names`` too: a consumer's own batches carry them or not, from its own plan)."""
    shared = feed_pb2.StreamRequest()
    shared.CopyFrom(request)
    for name in ("transport", "prefetch", "start_batch", "max_failures",
                 "max_failure_fraction", "names"):
        shared.ClearField(name)
    return hashlib.sha256(shared.SerializeToString(deterministic=True)).hexdigest()
