"""Reads apart from decodes: I/O threads that fetch samples' bytes ahead of the decode threads.

An object store answers a read in milliseconds; a decode thread that did the
read itself would sit idle that long per sample. So when a stream starts a
batch, each of its samples' reads is issued here at once, to run on I/O
threads of their own, and the decode thread that later takes the row finds the
bytes already there (or waits only for the rest of a read under way). Both
sources that read from S3 use it: a chunk of a shard's samples (a byte range of
the shard, whose size the shard's index knows; chunks.py), read once and taken
by each of its samples' decode threads, and a loose object (whose size is known
only once its GET answers).

A byte budget bounds the memory: reads start in the order issued while the
bytes held (reads under way or done, not yet taken by each of their takers)
stay within ``budget`` (one read always may start, however large, so the bound is
max(budget, the largest object)). A read of unknown size starts charged at the
mean size of the loose objects read so far (its estimate); once its GET
answers with a Content-Length it holds its real size, and if that no longer
fits (other reads hold bytes) the I/O thread closes the response before
reading the body and puts the read back at the head of the queue, to start
again when its real size fits. So a body is only ever read within the budget,
at the price of a repeated GET when an estimate was short and the budget full.

A decode thread never waits for a read that has not started: it takes it off
the queue and reads itself (for a chunk's other takers too, who wait for it;
such a read is not charged, as the decode thread's own read never was), so no
decode thread can wait on reads stuck behind another stream's unconsumed bytes.

Only S3 sources use it: a local, page-cached read is a short system call that
would cost more to hand to another thread than to make
(docs/decisions/0002-local-reads-on-decode-threads.md).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

__all__ = ["Body", "PendingRead", "ReadAhead", "StreamReads"]

# What a read of unknown size is charged before its size is known, until one is.
_FIRST_ESTIMATE = 1 << 20


class Body(Protocol):
    """An answered GET's body: read it whole, or close it unread."""

    def read(self) -> bytes: ...

    def close(self) -> None: ...


class PendingRead:
    """One issued read: its size (what it holds of the budget; None until known), then its
    bytes or error. ``read`` does it whole; ``open``, for a read of unknown size, answers
    (size, body) first."""

    __slots__ = ("size", "read", "open", "takers", "state", "charged", "data", "error")

    def __init__(self, size: int | None, read: Callable[[], bytes],
                 open: Callable[[], tuple[int, Body]] | None = None, takers: int = 1):
        self.size, self.read, self.open = size, read, open
        self.takers = takers  # takes before its bytes are given back (or drop)
        self.state = "queued"  # -> running -> done -> taken; or dropped (nobody takes it)
        self.charged = 0  # what it holds of the budget once started
        self.data: bytes | None = None
        self.error: BaseException | None = None


class ReadAhead:
    def __init__(self, threads: int, budget: int):
        self.budget = budget
        self.started = 0  # reads the I/O threads have started (a restarted one counts again)
        self._cond = threading.Condition()
        self._queue: deque[PendingRead] = deque()
        self._held = 0  # bytes of reads started and neither taken nor dropped
        self._estimate = _FIRST_ESTIMATE  # the charge of a read of unknown size
        self._learned = 0  # sizes learned so far (for the estimate's running mean)
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"gpufeed-io-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def issue(self, size: int | None, read: Callable[[], bytes],
              open: Callable[[], tuple[int, Body]] | None = None,
              takers: int = 1) -> PendingRead:
        """Queue a read of ``size`` bytes, or of unknown size (None) with ``open``. A read
        of known size may have several ``takers`` (a chunk of a shard, chunks.py): it holds
        its bytes until each has taken it or let it go."""
        if size is None and open is None:
            raise ValueError("a read of unknown size needs open")
        if takers < 1 or (takers > 1 and size is None):
            raise ValueError("a read has one taker, or several when its size is known")
        pending = PendingRead(size, read, open, takers)
        with self._cond:
            self._queue.append(pending)
            self._cond.notify()
        return pending

    def take(self, pending: PendingRead) -> bytes:
        """The read's bytes: read here if it has not started, else once it is done. With
        several takers, the first to come reads a read not started, the others wait."""
        with self._cond:
            # A read under way may also go back to the queue (its real size did not fit).
            self._cond.wait_for(lambda: pending.state != "running")
            mine = pending.state == "queued"
            if mine:  # not started: read on this thread, charged nothing (outside the budget)
                self._queue.remove(pending)
                pending.state = "running"
        if mine:
            data: bytes | None = None
            error: BaseException | None = None
            try:
                data = pending.read()
            except BaseException as e:  # the other takers' too
                error = e
            with self._cond:
                pending.data, pending.error, pending.state = data, error, "done"
                self._cond.notify_all()
        with self._cond:
            data, error = pending.data, pending.error
            self._let_go(pending)
        if data is None and error is None:  # dropped meanwhile: nothing held for it
            return pending.read()
        if error is not None:
            raise error
        assert data is not None
        return data

    def drop(self, pending: PendingRead) -> None:
        """Nobody will take this read (its stream ended): give its bytes back."""
        with self._cond:
            pending.takers = min(pending.takers, 1)
            self._let_go(pending)

    def _let_go(self, pending: PendingRead) -> None:
        pending.takers -= 1
        if pending.takers > 0:
            return
        if pending.state == "queued":
            self._queue.remove(pending)
            pending.state = "dropped"
        elif pending.state == "done":
            self._held -= pending.charged
            pending.charged = 0
            pending.state = "taken"
            self._cond.notify_all()
        elif pending.state == "running":
            pending.state = "orphan"  # the I/O thread gives its bytes back when it ends
        pending.data = None

    def depth(self) -> tuple[int, int]:
        """(reads queued or under way, bytes held): the read-ahead depth."""
        with self._cond:
            return len(self._queue), self._held

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def _charge(self, pending: PendingRead) -> int:
        return self._estimate if pending.size is None else pending.size

    def _fits(self) -> bool:
        return bool(self._queue) and (self._held == 0 or
                                      self._held + self._charge(self._queue[0]) <= self.budget)

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._fits())
                if self._closed:
                    return
                pending = self._queue.popleft()
                pending.state = "running"
                pending.charged = self._charge(pending)
                self._held += pending.charged
                self.started += 1
            data: bytes | None = None
            error: BaseException | None = None
            try:
                data = self._read(pending)
            except BaseException as e:  # handed to the decode thread that takes it
                error = e
            with self._cond:
                if data is None and error is None and pending.state != "orphan":
                    continue  # back in the queue (or taken from it since)
                if pending.state == "orphan":  # dropped while running
                    pending.state = "dropped"
                    self._held -= pending.charged
                else:
                    pending.data, pending.error, pending.state = data, error, "done"
                self._cond.notify_all()

    def _read(self, pending: PendingRead) -> bytes | None:
        """Run on an I/O thread. None when the body was not read (back in the queue, or
        dropped meanwhile)."""
        if pending.open is None:
            return pending.read()
        try:
            size, body = pending.open()
        except BaseException:
            with self._cond:  # a failed read holds nothing
                self._held -= pending.charged
                pending.charged = 0
            raise
        with self._cond:
            pending.size = size
            self._learned += 1
            self._estimate = max(1, self._estimate + (size - self._estimate) // self._learned)
            self._held += size - pending.charged
            pending.charged = size
            back = pending.state == "running" and self._held > size and \
                self._held > self.budget
            if back:  # over the budget: wait for its turn again, charged its real size
                self._held -= size
                pending.charged = 0
                pending.state = "queued"
                self._queue.appendleft(pending)
                self._cond.notify_all()
        if back or pending.state == "orphan":
            body.close()
            return None
        return body.read()


class StreamReads:
    """One stream's reads issued ahead, by sample: each taken by the decode thread that reads
    the sample, or given back when the stream ends. A sample issued twice (a padded repeat in
    flight) is read ahead once; a second taker reads itself."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ahead: dict[int, PendingRead] = {}

    def issue(self, stage: ReadAhead, sample: int, size: int | None,
              read: Callable[[], bytes], open: Callable[[], tuple[int, Body]] | None = None
              ) -> None:
        with self._lock:
            if sample not in self._ahead:
                self._ahead[sample] = stage.issue(size, read, open)

    def take(self, stage: ReadAhead | None, sample: int, read: Callable[[], bytes]) -> bytes:
        """The sample's bytes: from its read issued ahead, else ``read()`` here."""
        with self._lock:
            pending = self._ahead.pop(sample, None)
        if pending is None:
            return read()
        assert stage is not None, "a read was issued ahead through the stage"
        return stage.take(pending)

    def forget(self, stage: ReadAhead | None) -> None:
        """The stream ended: reads issued for rows nobody will decode give their bytes back."""
        with self._lock:
            ahead, self._ahead = self._ahead, {}
        for pending in ahead.values():
            assert stage is not None, "a read was issued ahead through the stage"
            stage.drop(pending)
