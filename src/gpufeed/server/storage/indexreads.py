"""A shard's bytes while it is indexed: read where its headers are, or forward once.

Indexing is the one read of a whole shard (shards.py says why): a local shard
is read where asked, an S3 object's body in one streamed GET, read forward.
What lies between two headers is skipped by reading it; nothing past the size
the shard had when opened is read.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .s3 import s3_errors

__all__ = ["IndexReads"]

# Bytes read at a time over members' data while an object's index reads through it.
_SKIP_CHUNK = 1 << 20


class IndexReads:
    """A shard while it is indexed (tarindex.py reads its headers through it): a local
    file read where asked (``pread``), an S3 object's body read forward, what lies
    between skipped by reading it. Nothing past ``size`` (the size it had when opened)
    is read, whatever a header declares; every read counts in the storage metrics."""

    def __init__(self, observe: Callable[[str, int], None], path: str, size: int, version: str,
                 fd: int | None = None, body=None):
        self._observe, self._path = observe, path  # observe(path, bytes read): the metrics
        self.size, self.version = size, version
        self._fd, self._body = fd, body
        self.sequential = body is not None
        self._position = 0  # the body's, read so far

    def read(self, offset: int, size: int) -> bytes:
        size = min(size, self.size - offset)
        if size <= 0:
            return b""
        if self._fd is not None:
            data = os.pread(self._fd, size, offset)
        else:
            body = self._body
            assert body is not None, "an IndexReads reads a file descriptor or a body"
            if offset < self._position:
                raise ValueError(f"{self._path}: an S3 object's index reads forward only")
            with s3_errors(self._path):
                while self._position < offset:  # over the data of members
                    skipped = body.read(min(offset - self._position, _SKIP_CHUNK))
                    if not skipped:
                        return b""
                    self._position += len(skipped)
                    self._observe(self._path, len(skipped))
                data = body.read(size)
                while data and len(data) < size:  # a short read before the end: read on
                    more = body.read(size - len(data))
                    if not more:
                        break
                    data += more
            self._position += len(data)
        self._observe(self._path, len(data))
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._body is not None:
            self._body.close()

    def __enter__(self) -> IndexReads:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
