"""Opening the server's shared memory from the trainer's side.

The client never creates or unlinks segments: the server names one per stream,
the client maps it once, says so, and the server removes the name. The mapping
stays valid for as long as the client holds it.
"""

from __future__ import annotations

import mmap
import os

__all__ = ["map_segment", "shares_shm"]

_SHM_DIR = "/dev/shm"


def map_segment(name: str, size: int) -> mmap.mmap:
    """Map the server's segment ``name`` (read-write, shared)."""
    if "/" in name or not name:
        raise ValueError(f"bad segment name {name!r}")
    fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def shares_shm(probe_name: str, token: bytes) -> bool:
    """Whether this process sees the server's /dev/shm: the probe holds ``token``."""
    if not probe_name or not token:
        return False
    try:
        fd = os.open(os.path.join(_SHM_DIR, probe_name), os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.read(fd, len(token) + 1) == token
    finally:
        os.close(fd)
