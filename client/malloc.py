"""Keep the heap's freed multi-MB blocks for the next inline batch.

gRPC's Python client hands over each inline batch as a new ``bytes`` object
(4.8 MB for 32 x 3 x 224 x 224 uint8), built from per-slice ``bytes`` it
joins. glibc's malloc takes blocks that large from fresh ``mmap`` pages, or
gives the heap's freed top back to the kernel once it passes its trim
threshold, so every batch faulted in about 500 new pages: ~3 ms of system CPU
per batch on the bench machine, several times the copies themselves (a 4.8 MB
memcpy into warm memory costs ~0.25 ms there). ``keep_large_buffers`` raises
both thresholds once per process, so the blocks a finished batch frees serve
the next: the trainer's heap keeps up to ``_KEEP`` bytes it would otherwise
return. A trainer that set ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` itself keeps its own settings; on a C library
without ``mallopt`` (not glibc) nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import threading

__all__ = ["keep_large_buffers"]

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): blocks up to this
# come from the heap.
_MMAP_THRESHOLD = 32 << 20
# Freed memory at the heap's top kept for reuse: a few batches' worth.
_KEEP = 64 << 20
_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_lock = threading.Lock()
_done = False


def keep_large_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds (once); whether they were raised."""
    global _done
    with _lock:
        if _done:
            return False
        _done = True
        if any(name in os.environ for name in _ENVIRONMENT):
            return False
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
        if mallopt is None:
            return False
        return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
                    and mallopt(_M_TRIM_THRESHOLD, _KEEP))
