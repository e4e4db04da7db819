"""Opening the server's shared memory from the trainer's side.

The client never creates or unlinks segments: the server names one per stream,
the client maps it once, says so, and the server removes the name. The mapping
stays valid for as long as the client holds it.

``ShmBatches`` is the shm transport's ``BatchReader`` (batches.py).
"""

from __future__ import annotations

import mmap
import os
import weakref

import grpc
import numpy as np
import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import SHM_DIR

from .batches import HeldSlots, Release, owned, slot_tensors
from .errors import FeedError

__all__ = ["ShmBatches", "map_segment", "shares_shm"]


def map_segment(name: str, size: int) -> mmap.mmap:
    """Map the server's segment ``name`` (read-write, shared)."""
    if "/" in name or not name:
        raise ValueError(f"bad segment name {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def shares_shm(probe_name: str, token: bytes) -> bool:
    """Whether this process sees the server's /dev/shm: the probe holds ``token``."""
    if not probe_name or not token:
        return False
    try:
        fd = os.open(os.path.join(SHM_DIR, probe_name), os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.read(fd, len(token) + 1) == token
    finally:
        os.close(fd)


class ShmBatches:
    """Batches as views of the server's segment, mapped once (a ``BatchReader``).

    Each batch's slot goes back when the trainer drops its tensors, or at once
    when they are copies (``copy``, or the trainer holds all slots but one).
    """

    shared = True

    def __init__(self, header: feed_pb2.StreamHeader, release: Release, copy: bool):
        try:
            self._memory = map_segment(header.shm_name, header.num_slots * header.slot_bytes)
        except OSError as e:
            raise FeedError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"shm: cannot map the server's segment ({e.strerror}): the trainer "
                            f"must share the server's /dev/shm and user; use transport='auto' "
                            f"or 'inline'") from None
        self._slot_bytes = header.slot_bytes
        self._release = release
        self._copy = copy
        self._held = HeldSlots(header.num_slots)
        self.make_room = self._held.make_room

    def close(self) -> None:
        pass

    def tensors(self, batch: feed_pb2.Batch) -> dict[str, torch.Tensor]:
        """Views of the batch's slot; copies, its slot released at once, when the
        trainer holds all slots but one (or with ``copy``)."""
        # The storage keeps ``base`` alive while any tensor of the batch lives, so a
        # finaliser on ``base`` releases the slot as soon as the trainer drops the
        # batch, not only at the next fetch.
        base = np.frombuffer(self._memory, np.uint8, count=self._slot_bytes,
                             offset=batch.slot * self._slot_bytes)
        tensors = slot_tensors(torch.from_numpy(base).untyped_storage(), batch.tensors)
        if self._copy or not self._held.has_room():
            tensors = owned(tensors)
            self._release(batch.seq)
            return tensors
        released = weakref.finalize(base, self._release, batch.seq)
        self._held.hold(lambda: released.alive, released)
        return tensors
