"""Data roots: the only directories the server reads from.

A request names files relative to a root (tried in the order the roots were
given) or absolute under one. Two checks keep reads inside the roots:

* at request time every name is checked lexically (``..`` and absolute paths
  elsewhere are refused for the whole request, PERMISSION_DENIED), which costs
  no system call however long the list is;
* at read time the opened file's real path (symlinks resolved, read back from
  /proc/self/fd after opening, so a symlink swapped in meanwhile cannot slip
  through) must still lie under a root, so a symlink pointing outside fails
  that sample instead of leaking it.

What is read must also be a regular file of at most ``max_file_bytes``
(``--max-file-bytes``), checked with fstat on the opened descriptor before a
byte is read: a device or FIFO linked under a root, or a huge (say, sparse)
file, fails that sample instead of filling the server's memory.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from typing import Protocol

__all__ = ["DEFAULT_MAX_FILE_BYTES", "DataRoots", "FileTooLarge", "LocatedPaths",
           "NotReadable", "OutsideDataRoots", "SamplePaths"]

# Sample files larger than this are refused before reading (gpufeed-server --max-file-bytes).
DEFAULT_MAX_FILE_BYTES = 1 << 30
_KINDS = ((stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"))


class OutsideDataRoots(PermissionError):
    """A name that resolves outside every data root."""


class NotReadable(OSError):
    """A file the server will not read: not a regular file, or over the size limit."""


class FileTooLarge(NotReadable):
    """A regular file over the size limit."""


class DataRoots:
    def __init__(self, roots: list[str], max_file_bytes: int = DEFAULT_MAX_FILE_BYTES):
        self.max_file_bytes = max_file_bytes
        if not roots:
            raise ValueError("at least one data root is required")
        self.roots = [os.path.realpath(r) for r in roots]
        for root in self.roots:
            if not os.path.isdir(root):
                raise NotADirectoryError(f"data root {root!r} is not a directory")
        # What a path under each root starts with (root_of runs once per sample read).
        self._under = tuple(root.rstrip("/") + "/" for root in self.roots)

    def locate(self, name: str) -> str:
        """The lexically normalised absolute path for ``name``, before symlinks.

        Raises OutsideDataRoots when the name escapes every root.
        """
        if os.path.isabs(name):
            path = os.path.normpath(name)
            if self.root_of(path) is None:
                raise OutsideDataRoots(f"{name!r} is not under a data root")
            return path
        rel = os.path.normpath(name)
        if rel == ".." or rel.startswith("../"):
            raise OutsideDataRoots(f"{name!r} leaves the data roots")
        if len(self.roots) == 1:
            return os.path.join(self.roots[0], rel)
        for root in self.roots:
            path = os.path.join(root, rel)
            if os.path.exists(path):
                return path
        return os.path.join(self.roots[0], rel)

    def open_checked(self, path: str, max_bytes: int | None = None,
                     flag: str = "--max-file-bytes") -> int:
        """Open a located path for reading; returns an fd of a regular file under a data root.

        Raises IsADirectoryError for a directory, NotReadable for anything else
        but a regular file of at most ``max_bytes`` (default ``max_file_bytes``;
        ``flag`` is the server flag that sets it, for the message).
        """
        return self._open(path, max_bytes, flag)[0]

    def read(self, path: str, max_bytes: int | None = None,
             flag: str = "--max-file-bytes") -> bytes:
        """The whole file (checked as by ``open_checked``), read in one allocation of its size.

        Plain ``os.read`` calls on the descriptor, with the size the check's fstat
        saw: no file object and no second fstat (a sample's read is on every row's
        path: 75 -> 48 us of CPU per file, one thread, against ~29 for open + read).
        """
        fd, size = self._open(path, max_bytes, flag)
        try:
            data = os.read(fd, size + 1)
            while len(data) <= size:  # at the end, or a short read: read on until either
                more = os.read(fd, size + 1 - len(data))
                if not more:
                    break
                data += more
        finally:
            os.close(fd)
        if len(data) > size:
            raise NotReadable(f"file grew past its size of {size} bytes while it was read")
        return data

    def _open(self, path: str, max_bytes: int | None, flag: str) -> tuple[int, int]:
        """(fd, size) of a located path checked as ``open_checked`` says."""
        # Non-blocking: opening a FIFO (or a device) someone linked in must not hang a thread.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = os.path.realpath(path)  # no /proc: checked, if less strictly
        if self.root_of(real) is None:
            os.close(fd)
            raise OutsideDataRoots(f"{path!r} resolves outside the data roots")
        try:
            status = os.fstat(fd)
            _check_file(status, self.max_file_bytes if max_bytes is None else max_bytes, flag)
        except BaseException:
            os.close(fd)
            raise
        return fd, status.st_size

    def shown(self, path: str) -> str:
        """A located path as a request would name it, for messages: relative to its root."""
        root = self.root_of(path)
        return os.path.relpath(path, root) if root else path

    def root_of(self, path: str) -> str | None:
        """The root a normalised absolute path lies under (lexically), or None."""
        for root, under in zip(self.roots, self._under):
            if path.startswith(under) or path == root:
                return root
        return None


def _check_file(status: os.stat_result, max_bytes: int, flag: str) -> None:
    if stat.S_ISDIR(status.st_mode):
        raise IsADirectoryError(errno.EISDIR, "a directory, not a regular file")
    for is_kind, kind in _KINDS:
        if is_kind(status.st_mode):
            raise NotReadable(f"{kind}, not a regular file")
    if status.st_size > max_bytes:
        raise FileTooLarge(f"file of {status.st_size} bytes, over the limit of {max_bytes} "
                          f"(gpufeed-server {flag})")


class SamplePaths(Protocol):
    """A stream's path of each sample, by index: ``LocatedPaths`` for files, each
    sample's shard for tar shards (shards.py); what a stream and its reader use of it."""

    def __getitem__(self, index: int, /) -> str: ...

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int:
        """What it keeps in memory (counted against the server's budget)."""
        ...


class _Locates(Protocol):
    """What confines a name to the data roots: ``DataRoots``, or roots.py's ``Storage``
    (local roots and S3 prefixes)."""

    def locate(self, name: str) -> str: ...


class _PackedNames(Protocol):
    """Names that count their bytes: planning's ``SampleNames``."""

    def __getitem__(self, index: int, /) -> str: ...

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class LocatedPaths(Sequence[str]):
    """``roots.locate(prefix + names[i])``, worked out when a sample is read.

    The names were checked against the roots when the stream was planned;
    locating again per read keeps the plan as compact as its names.
    """

    def __init__(self, names: _PackedNames, prefix: str, roots: _Locates):
        self.names = names
        self._prefix = prefix
        self._roots = roots

    @property
    def nbytes(self) -> int:
        return self.names.nbytes

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> str:
        return self._roots.locate(self._prefix + self.names[index])
