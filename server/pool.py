"""The decode pool: threads shared by every open stream.

Each thread owns one ``ImageDecoder`` (so one codec context per thread) and
runs tasks from a single FIFO queue. A task is ``(job, row)``: decode one
sample into one row of a batch. Python work per task is a queue hand-off and a
counter; the decode and scale themselves run inside FFmpeg without the GIL.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Protocol

from .decode import ImageDecoder

__all__ = ["DecodePool", "RowTask"]

_log = logging.getLogger(__name__)


class RowTask(Protocol):
    def decode_row(self, row: int, decoder: ImageDecoder) -> None: ...


class DecodePool:
    def __init__(self, threads: int):
        self.threads = threads
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, name=f"gpufeed-decode-{i}",
                                          daemon=True) for i in range(threads)]
        for worker in self._workers:
            worker.start()

    def submit(self, job: RowTask, rows: range) -> None:
        for row in rows:
            self._tasks.put((job, row))

    def queued(self) -> int:
        """Rows waiting for a decode thread (the decode queue occupancy metric)."""
        return self._tasks.qsize()

    def close(self) -> None:
        for _ in self._workers:
            self._tasks.put(None)
        for worker in self._workers:
            worker.join()

    def _work(self) -> None:
        decoder = ImageDecoder()
        while (task := self._tasks.get()) is not None:
            job, row = task
            try:
                job.decode_row(row, decoder)
            except Exception:  # a bug, not bad data: keep the thread alive, say so
                _log.exception("decode task failed")
