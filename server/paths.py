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
"""

from __future__ import annotations

import os

__all__ = ["DataRoots", "OutsideDataRoots"]


class OutsideDataRoots(PermissionError):
    """A name that resolves outside every data root."""


class DataRoots:
    def __init__(self, roots: list[str]):
        if not roots:
            raise ValueError("at least one data root is required")
        self.roots = [os.path.realpath(r) for r in roots]
        for root in self.roots:
            if not os.path.isdir(root):
                raise NotADirectoryError(f"data root {root!r} is not a directory")

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

    def open_checked(self, path: str) -> int:
        """Open a located path for reading; returns an fd of a file under a data root."""
        # Non-blocking: opening a FIFO (or a device) someone linked in must not hang a thread.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = os.path.realpath(path)  # no /proc: checked, if less strictly
        if self.root_of(real) is None:
            os.close(fd)
            raise OutsideDataRoots(f"{path!r} resolves outside the data roots")
        return fd

    def read(self, path: str) -> bytes:
        fd = self.open_checked(path)
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read()
        finally:
            os.close(fd)

    def shown(self, path: str) -> str:
        """A located path as a request would name it, for messages: relative to its root."""
        root = self.root_of(path)
        return os.path.relpath(path, root) if root else path

    def root_of(self, path: str) -> str | None:
        """The root a normalised absolute path lies under (lexically), or None."""
        for root in self.roots:
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return root
        return None
