"""Opening the server's shared memory from the trainer's side.

The client never creates or unlinks segments: the server names one per stream,
the client maps it once, says so, and the server removes the name. The mapping
stays valid for as long as the client holds it.

The name is the server's word, so the client maps only a regular file that is
the name itself (no symbolic link out of /dev/shm to a file of the trainer's,
which a trainer writing into its batch would then change) and at least as large
as the ring the header declares; each batch's slot and tensors are checked
against that ring before they are viewed (checks.py).

``ShmBatches`` is the shm transport's ``BatchReader`` (batches.py).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import weakref

import grpc
import numpy as np
import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import SHM_DIR

from .batches import HeldSlots, Release, owned, slot_tensors
from .checks import check_slot, check_tensors, data_loss
from .errors import FeedError

__all__ = ["ShmBatches", "map_segment", "shares_shm"]


def map_segment(name: str, size: int) -> mmap.mmap:
    """Map the server's segment ``name`` (read-write, shared): its first ``size`` bytes.

    Raises OSError if it cannot be opened, and FeedError (DATA_LOSS) if it is a
    symbolic link, not a regular file, or smaller than ``size``.
    """
    if "/" in name or not name:
        raise ValueError(f"bad segment name {name!r}")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise data_loss(f"the server's shm_name {name!r} is a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise data_loss(f"the server's shm_name {name!r} is not a regular file")
        if info.st_size < size:
            raise data_loss(f"the server's header declares a ring of {size} bytes, but its "
                            f"segment {name!r} holds {info.st_size}")
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
        self._num_slots = header.num_slots
        self._release = release
        self._copy = copy
        self._held = HeldSlots(header.num_slots)
        self.make_room = self._held.make_room

    def close(self) -> None:
        pass

    def tensors(self, batch: feed_pb2.Batch) -> dict[str, torch.Tensor]:
        """Views of the batch's slot; copies, its slot released at once, when the
        trainer holds all slots but one (or with ``copy``)."""
        check_slot(batch, self._num_slots)
        self._held.check_free(batch)
        places = check_tensors(batch.tensors, self._slot_bytes, f"its {self._slot_bytes}-byte slot")
        # The storage keeps ``base`` alive while any tensor of the batch lives, so a
        # finaliser on ``base`` releases the slot as soon as the trainer drops the
        # batch, not only at the next fetch.
        base = np.frombuffer(self._memory, np.uint8, count=self._slot_bytes,
                             offset=batch.slot * self._slot_bytes)
        tensors = slot_tensors(torch.from_numpy(base).untyped_storage(), places)
        if self._copy or not self._held.has_room():
            tensors = owned(tensors)
            self._release(batch.seq)
            return tensors
        released = weakref.finalize(base, self._release, batch.seq)
        self._held.hold(batch.slot, lambda: released.alive, released)
        return tensors
