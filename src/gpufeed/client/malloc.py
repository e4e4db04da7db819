"""Keep the heap's freed multi-MB blocks for the next inline batch.

gRPC's Python client hands over each inline batch as a new ``bytes`` object
(4.8 MB for 32 x 3 x 224 x 224 uint8), built from per-slice ``bytes`` it
joins. With glibc's default thresholds, the block came from fresh pages for
every batch (``mmap``, or heap top that trimming had just handed back): about
470 minor page faults per batch and ~2 ms of the trainer's system CPU, several
times the copies themselves (bench/HISTORY.md, "Remote trainers"). ``keep_large_buffers``
sets both thresholds once per process, so the blocks a finished batch frees
serve the next.

What that changes for the whole trainer process, not only for batches:

- every allocation from 128 KiB (glibc's default) up to 32 MiB comes from a
  malloc heap, not from its own ``mmap``; blocks above 32 MiB (a batch of 64 x 3
  x 448 x 448) still take fresh pages;
- glibc stops adjusting the mmap threshold itself;
- each malloc arena (one per thread that allocates, up to glibc's limit) keeps
  up to 64 MiB of freed memory at its top instead of returning it, and freed
  holes below the top stay in the heap as they always did.

A trainer that wants glibc's defaults, or its own values, starts with
``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` set, or with either
threshold in ``GLIBC_TUNABLES``: then nothing is changed (glibc reads them at
process start, so a variable set later is honoured only in that gpufeed backs
off). Without a ``mallopt`` (musl) nothing changes. An allocator preloaded in
glibc's place (jemalloc, tcmalloc) does not read these settings; the call is
then harmless and has no effect.
"""

from __future__ import annotations

import ctypes
import os
import threading

__all__ = ["keep_large_buffers"]

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): blocks up to this
# come from a heap.
_MMAP_THRESHOLD_BYTES = 32 << 20
# Freed memory at an arena's top kept for reuse: a few batches' worth.
_TRIM_THRESHOLD_BYTES = 64 << 20
_TRAINER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_TRAINER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")

_lock = threading.Lock()
_done = False


def keep_large_buffers() -> bool:
    """Set glibc's mmap and trim thresholds, once per process; whether this call set them."""
    global _done
    with _lock:
        if _done:
            return False
        _done = True
        tunables = os.environ.get("GLIBC_TUNABLES", "")
        if (any(name in os.environ for name in _TRAINER_SETTINGS)
                or any(name in tunables for name in _TRAINER_TUNABLES)):
            return False
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
        if mallopt is None:
            return False
        mmap_set = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        trim_set = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
        return bool(mmap_set and trim_set)
