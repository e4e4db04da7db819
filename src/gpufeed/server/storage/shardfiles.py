"""A stream's local tar shards, each opened once and kept open while its samples are read.

A loose file is opened, checked and closed for each sample; a shard holds
thousands of samples, so opening it per sample (``open``, the ``/proc``
readlink that confines it, ``fstat``, ``close`` around one ``pread``) spent more
CPU than the read itself and made a local shard's sample dearer than a loose
file (docs/decisions/0003-shards-read-by-byte-range.md). Here a stream opens each shard it reads
once, checked as any sample file is (under a data root, a regular file), and
reads its samples with one ``pread`` each.

At most ``OPEN_SHARDS`` stay open per stream: a stream reads its shards one
after another (the shuffle buffer spans a few at a time), so the least
recently used one not being read is closed past that; a descriptor being read
is closed by its last reader, never under it. ``close`` (the stream ended)
closes the rest.

A descriptor is checked when it is opened to be the file the shard's index was
made from (``Storage.open_shard`` with the index's version: device, inode,
size, mtime), and again after every read (one ``fstat``): a shard replaced
before it was opened, or written in place since (same inode, another size or
mtime), fails its reads with ``ShardChanged``. A shard renamed over while a
stream reads it is still read, through the descriptor, as the version its index
describes.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from .roots import Storage

__all__ = ["OPEN_SHARDS", "ShardFiles"]

OPEN_SHARDS = 8


class _Open:
    __slots__ = ("fd", "readers", "closing")

    def __init__(self, fd: int):
        self.fd, self.readers, self.closing = fd, 0, False


class ShardFiles:
    """One stream's open local shards, by shard number."""

    def __init__(self, bound: int = OPEN_SHARDS):
        self._bound = bound
        self._lock = threading.Lock()
        self._open: OrderedDict[int, _Open] = OrderedDict()

    def read(self, storage: Storage, shard: int, path: str, offset: int, size: int,
             version: str = "") -> bytes:
        """``size`` bytes at ``offset`` of the shard (fewer at its end), its descriptor opened
        on first use and checked to be ``version`` (the index's); errors as
        ``Storage.read_range``'s."""
        with self._lock:
            entry = self._open.get(shard)
            if entry is None:
                entry = self._open[shard] = _Open(storage.open_shard(path, version))
            else:
                self._open.move_to_end(shard)
            entry.readers += 1
            if len(self._open) > self._bound:
                self._close_unused()
        try:
            data = storage.read_at(entry.fd, path, offset, size)
            storage.check_unchanged(entry.fd, version)  # one fstat: a write in place shows
            return data
        finally:
            with self._lock:
                entry.readers -= 1
                if entry.closing and entry.readers == 0:
                    os.close(entry.fd)

    def close(self) -> None:
        """The stream ended: close every descriptor (one still being read, by its reader)."""
        with self._lock:
            entries, self._open = list(self._open.values()), OrderedDict()
            for entry in entries:
                self._retire(entry)

    def _close_unused(self) -> None:
        """Past the bound, close the least recently used shards no thread is reading."""
        for shard in [s for s, e in self._open.items() if e.readers == 0]:
            if len(self._open) <= self._bound:
                return
            self._retire(self._open.pop(shard))

    @staticmethod
    def _retire(entry: _Open) -> None:
        if entry.readers == 0:
            os.close(entry.fd)
        else:
            entry.closing = True
