"""The server's memory budget: what all open streams' rings and plans may hold together.

Per-stream limits (``--max-batch-bytes``, ``--max-prefetch``) bound one
stream; a handful of streams at those limits could still ask for more memory
than the host has (one request planned a 17.9 GB ring: batch 7000 x prefetch
16 at 224x224). So every stream reserves its ring (slots x slot bytes, whatever
the transport: heap, /dev/shm and pinned host memory are all RAM) and its plan
(``StreamPlan.nbytes``) when it opens, before the ring is allocated, and gives
them back when it closes; a stream that does not fit is refused with
RESOURCE_EXHAUSTED naming ``--max-memory-bytes``.

The default is half of the memory the server may use: the host's, or its
cgroup's limit when that is lower (a container). Decoding working space (a
frame per decode thread) and gRPC buffers are outside it.

Lists shared by streams (serving/planning/lists.py) reserve their bytes once, and may be
kept a while after their last stream: a reservation that does not fit first
asks ``reclaim`` (the kept lists nobody holds are dropped) and tries again.

Memory a stream gave back must also leave the process: ``return_free_memory``
asks glibc's allocator to hand its free pages to the system (``malloc_trim``),
which it otherwise keeps in each thread's arena. Six sequential 2M-sample
streams once left a server 1.8 GB larger with nothing alive; planning packs a
list's names compactly (serving/planning/names.py) and trims when a large plan goes.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

__all__ = ["MemoryBudget", "MemoryExhausted", "default_memory_bytes", "return_free_memory"]

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max",  # cgroup v2
                  "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v1


class MemoryExhausted(Exception):
    """A reservation that does not fit; the message says what it needed and what is left."""


def default_memory_bytes() -> int:
    """Half of the host's memory, or of its cgroup's limit if lower."""
    usable = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            usable = min(usable, int(limit))
    return usable // 2


class MemoryBudget:
    """A thread-safe count of reserved bytes against a limit. ``reclaim()``, when set,
    frees what it can (returning the bytes it gave back) before a reservation is
    refused; it may give back, so it is called outside the lock."""

    def __init__(self, limit: int, reclaim: Callable[[], int] | None = None):
        self.limit = limit
        self.reclaim = reclaim
        self._lock = threading.Lock()
        self._reserved = 0

    @property
    def reserved(self) -> int:
        with self._lock:
            return self._reserved

    def reserve(self, nbytes: int, what: str) -> int:
        """Reserve ``nbytes`` (for ``what``, named in the refusal); returns them, for ``give_back``.

        Raises MemoryExhausted when they do not fit, after ``reclaim``.
        """
        with self._lock:
            fits = self._reserved + nbytes <= self.limit
        if not fits and self.reclaim is not None:
            self.reclaim()
        with self._lock:
            if self._reserved + nbytes > self.limit:
                raise MemoryExhausted(
                    f"memory: {what} needs {nbytes} bytes, and the server has "
                    f"{self.limit - self._reserved} of its --max-memory-bytes {self.limit} "
                    f"left; ask for a smaller batch or prefetch, or retry when streams end")
            self._reserved += nbytes
        return nbytes

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes


def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc; other C libraries have none
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim


_MALLOC_TRIM = _malloc_trim()


def return_free_memory() -> None:
    """Give the C allocator's free memory back to the system, where the C library can."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
