"""Turning Batch messages into tensor dicts, for each transport.

inline: the arrays arrive in the message; the client copies them once into a
writable buffer and the tensors own that memory, so the slot is released as
soon as the message is read.

shm: the tensors are views of the stream's shared-memory slot, no copy. The
slot is released when the trainer drops the batch (every tensor of it is
garbage-collected), or when it fetches a batch while holding as many batches as
the stream has slots: the oldest is then released while still referenced, with a
warning, rather than deadlocking. ``copy=True`` gives owned tensors and releases
at once.
"""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Callable

import grpc
import numpy as np
import torch

from gpufeed.v1 import feed_pb2

from .errors import FeedError
from .shm import map_segment

__all__ = ["HeldSlots", "InlineBatches", "ShmBatches"]

_log = logging.getLogger(__name__)
Release = Callable[[int], None]  # gives batch seq's slot back to the server


def _tensors(buffer: np.ndarray, metas) -> dict[str, torch.Tensor]:
    out = {}
    for meta in metas:
        # numpy has no bfloat16: carry its bytes as uint16 and reinterpret in torch.
        dtype = np.dtype(np.uint16 if meta.dtype == "bfloat16" else meta.dtype)
        count = int(np.prod(meta.shape))
        array = buffer[meta.offset:meta.offset + count * dtype.itemsize].view(dtype)
        tensor = torch.from_numpy(array.reshape(tuple(meta.shape)))
        out[meta.name] = tensor.view(torch.bfloat16) if meta.dtype == "bfloat16" else tensor
    return out


class InlineBatches:
    release_at_once = True  # the loader releases each slot as soon as it has the tensors

    def make_room(self) -> None:
        pass

    def close(self) -> None:
        pass

    def tensors(self, batch: feed_pb2.Batch) -> dict[str, torch.Tensor]:
        return _tensors(np.frombuffer(bytearray(batch.data), np.uint8), batch.tensors)


class HeldSlots:
    """The zero-copy batches the trainer still holds, oldest first.

    Each is released when its base array is garbage-collected. ``make_room``
    runs before the loader waits for a batch: if held batches take every slot,
    the server could never send another, so the oldest is released while still
    referenced (with a warning, once) rather than deadlocking.
    """

    def __init__(self, num_slots: int, release: Release, what: str):
        self._num_slots = num_slots
        self._release = release
        self._what = what
        self._held: collections.deque[weakref.finalize] = collections.deque()
        self._warned = False

    def hold(self, base, seq: int) -> None:
        self._held.append(weakref.finalize(base, self._release, seq))

    def make_room(self) -> None:
        while self._held and not self._held[0].alive:
            self._held.popleft()
        if len(self._held) >= self._num_slots:
            if not self._warned:
                self._warned = True
                _log.warning(
                    "the trainer holds all %d %s batches of this stream; the oldest is being "
                    "reused while still referenced. Drop batches sooner, raise prefetch, or "
                    "pass copy=True to keep them.", self._num_slots, self._what)
            self._held.popleft()()


class ShmBatches:
    def __init__(self, header: feed_pb2.StreamHeader, release: Release, copy: bool):
        try:
            self._memory = map_segment(header.shm_name, header.num_slots * header.slot_bytes)
        except OSError as e:
            raise FeedError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"shm: cannot map the server's segment ({e.strerror}): the trainer "
                            f"must share the server's /dev/shm and user; use transport='auto' "
                            f"or 'inline'") from None
        self._slot_bytes = header.slot_bytes
        self._held = HeldSlots(header.num_slots, release, "shared-memory")
        self.make_room = self._held.make_room
        self.release_at_once = copy

    def close(self) -> None:
        pass

    def tensors(self, batch: feed_pb2.Batch) -> dict[str, torch.Tensor]:
        base = np.frombuffer(self._memory, np.uint8, count=self._slot_bytes,
                             offset=batch.slot * self._slot_bytes)
        tensors = _tensors(base, batch.tensors)
        if self.release_at_once:
            tensors = {name: t.clone() for name, t in tensors.items()}
        else:
            self._held.hold(base, batch.seq)
        return tensors
