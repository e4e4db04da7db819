"""The decode pool: threads shared by every open stream, served in turn.

Each thread owns its state, made by the pool's ``thread_state`` factory when
the thread starts: the server's is ``Decoders`` (media/samples.py), so one codec
context per thread, and the pool knows nothing of decoding. Work is queued per
stream, and threads take one row at a time from the streams in
round-robin order: a stream with many batches queued (a large prefetch) gets
the same share of decode as a stream with one, so it cannot starve it. Within
a stream, rows are taken in the order they were submitted, so its earliest
batch completes first. Python work per row is a lock and a few deque
operations; the decode and scale themselves run inside the decoders (libjpeg-turbo's
C extension, FFmpeg) and C kernels, without the GIL.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["DecodePool", "RowTask"]

_log = logging.getLogger(__name__)

State = TypeVar("State")
_StateIn = TypeVar("_StateIn", contravariant=True)


class RowTask(Protocol[_StateIn]):
    """Work on the rows of one batch: ``decode_row`` on a pool thread, with that
    thread's state; ``skip_row`` for a row taken off the queue undone (``drop``)."""

    def decode_row(self, row: int, state: _StateIn, /) -> None: ...

    def skip_row(self, row: int) -> None: ...


class DecodePool(Generic[State]):
    """``threads`` daemon threads that run the rows streams submit, fairly across streams.

    Contract: ``submit(owner, task, rows)`` queues ``task.decode_row(row, state)``
    for each row on ``owner``'s queue (``owner`` is a stream; any hashable
    object); the threads take one row at a time from the owners in turn, so a
    stream with a deep queue cannot starve another. ``state`` is the running
    thread's own, made once per thread by ``thread_state()``, never shared, so it
    needs no lock (the server's is a ``Decoders``, whose one shared part, the batched
    decoders, hands each to one thread at a time). A task that raises is logged
    and the thread goes on: tasks report bad data themselves. ``drop(owner)``
    takes an owner's rows off the queue and returns them (the caller skips
    them), so cancelling a stream needs no free thread. ``close()`` stops the
    threads once they have finished the row in hand; rows still queued are left.
    ``DecodePool(0, ...)`` has no threads: rows wait until dropped (tests).
    """

    def __init__(self, threads: int, thread_state: Callable[[], State]):
        self.threads = threads
        self._thread_state = thread_state
        self._cond = threading.Condition()
        self._queues: dict[object, deque[tuple[RowTask[State], int]]] = {}
        self._turns: deque[object] = deque()  # streams with queued rows, next first
        self._closed = False
        self._workers = [threading.Thread(target=self._work, name=f"gpufeed-decode-{i}",
                                          daemon=True) for i in range(threads)]
        for worker in self._workers:
            worker.start()

    def submit(self, owner: object, task: RowTask[State], rows: range) -> None:
        """Queue ``task.decode_row(row)`` for each row, on ``owner``'s (a stream's) queue."""
        with self._cond:
            queue = self._queues.get(owner)
            if queue is None:
                queue = self._queues[owner] = deque()
                self._turns.append(owner)
            queue.extend((task, row) for row in rows)
            self._cond.notify(len(rows))

    def drop(self, owner: object) -> list[tuple[RowTask[State], int]]:
        """Take ``owner``'s queued rows off the queue (a cancelled stream); returns them."""
        with self._cond:
            queue = self._queues.pop(owner, None)
            if queue is None:
                return []
            self._turns.remove(owner)
            return list(queue)

    def queued(self) -> int:
        """Rows waiting for a decode thread (the decode queue occupancy metric)."""
        with self._cond:
            return sum(len(queue) for queue in self._queues.values())

    def queued_by_owner(self) -> dict[object, int]:
        """Rows waiting, per stream that has any."""
        with self._cond:
            return {owner: len(queue) for owner, queue in self._queues.items()}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.join()

    def _next(self) -> tuple[RowTask[State], int] | None:
        with self._cond:
            while not self._turns:
                if self._closed:
                    return None
                self._cond.wait()
            owner = self._turns.popleft()
            queue = self._queues[owner]
            task = queue.popleft()
            if queue:
                self._turns.append(owner)
            else:
                del self._queues[owner]
            return task

    def _work(self) -> None:
        state = self._thread_state()
        while (task := self._next()) is not None:
            job, row = task
            try:
                job.decode_row(row, state)
            except BaseException:  # a bug, not bad data: keep the thread alive, say so
                _log.exception("decode task failed")
            # Held while this thread waits, the last task would keep its stream (and the
            # stream's plan: megabytes for a long list) alive after the stream ended.
            del task, job
