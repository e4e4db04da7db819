"""Reads apart from decodes: I/O threads that fetch samples' bytes ahead of the decode threads.

An object store answers a read in milliseconds; a decode thread that did the
read itself would sit idle that long per sample. So when a stream starts a
batch, each of its samples' reads is issued here at once, to run on I/O
threads of their own, and the decode thread that later takes the row finds the
bytes already there (or waits only for the rest of a read under way).

A byte budget bounds the memory: reads start in the order issued while the
bytes started and not yet taken stay within ``budget`` (one read always may
start, however large). A decode thread never waits for a read that has not
started: it takes it off the queue and reads itself, so no decode thread can
wait on reads stuck behind another stream's unconsumed bytes.

Only S3 sources use it: a local, page-cached read is a short system call that
would cost more to hand to another thread than to make (bench/README.md).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

__all__ = ["PendingRead", "ReadAhead"]


class PendingRead:
    """One issued read: its size (what it holds of the budget), then its bytes or error."""

    __slots__ = ("size", "read", "state", "data", "error")

    def __init__(self, size: int, read: Callable[[], bytes]):
        self.size, self.read = size, read
        self.state = "queued"  # -> running -> done; or taken (by a decode thread) / dropped
        self.data: bytes | None = None
        self.error: BaseException | None = None


class ReadAhead:
    def __init__(self, threads: int, budget: int):
        self.budget = budget
        self._cond = threading.Condition()
        self._queue: deque[PendingRead] = deque()
        self._held = 0  # bytes of reads started and neither taken nor dropped
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"gpufeed-io-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def issue(self, size: int, read: Callable[[], bytes]) -> PendingRead:
        pending = PendingRead(size, read)
        with self._cond:
            self._queue.append(pending)
            self._cond.notify()
        return pending

    def take(self, pending: PendingRead) -> bytes:
        """The read's bytes: read here if it has not started, else once it is done."""
        with self._cond:
            if pending.state == "queued":
                pending.state = "taken"
                self._queue.remove(pending)
            else:
                self._cond.wait_for(lambda: pending.state == "done")
                pending.state = "taken"
                self._held -= pending.size
                self._cond.notify_all()
        if pending.data is None and pending.error is None:
            return pending.read()
        if pending.error is not None:
            raise pending.error
        assert pending.data is not None  # done, without an error: it holds the bytes
        return pending.data

    def drop(self, pending: PendingRead) -> None:
        """Nobody will take this read (its stream ended): give its bytes back."""
        with self._cond:
            if pending.state == "queued":
                self._queue.remove(pending)
            elif pending.state == "done":
                self._held -= pending.size
                self._cond.notify_all()
            if pending.state != "taken":
                pending.state = "dropped" if pending.state != "running" else "orphan"
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

    def _fits(self) -> bool:
        return bool(self._queue) and (self._held == 0 or
                                      self._held + self._queue[0].size <= self.budget)

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._fits())
                if self._closed:
                    return
                pending = self._queue.popleft()
                pending.state = "running"
                self._held += pending.size
            try:
                data, error = pending.read(), None
            except BaseException as e:  # handed to the decode thread that takes it
                data, error = None, e
            with self._cond:
                if pending.state == "orphan":  # dropped while running
                    pending.state = "dropped"
                    self._held -= pending.size
                else:
                    pending.data, pending.error, pending.state = data, error, "done"
                self._cond.notify_all()
