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

import numpy as np
import torch

from gpufeed.v1 import feed_pb2

from .shm import map_segment

__all__ = ["InlineBatches", "ShmBatches"]

_log = logging.getLogger(__name__)
Release = Callable[[int], None]  # gives batch seq's slot back to the server


def _tensors(buffer: np.ndarray, metas) -> dict[str, torch.Tensor]:
    out = {}
    for meta in metas:
        dtype = np.dtype(meta.dtype)
        count = int(np.prod(meta.shape))
        array = buffer[meta.offset:meta.offset + count * dtype.itemsize].view(dtype)
        out[meta.name] = torch.from_numpy(array.reshape(tuple(meta.shape)))
    return out


class InlineBatches:
    owned = True  # the caller releases each batch's slot as soon as it has the tensors

    def make_room(self) -> None:
        pass

    def tensors(self, batch: feed_pb2.Batch) -> dict[str, torch.Tensor]:
        return _tensors(np.frombuffer(bytearray(batch.data), np.uint8), batch.tensors)


class ShmBatches:
    def __init__(self, header: feed_pb2.StreamHeader, release: Release, copy: bool):
        self._memory = map_segment(header.shm_name, header.num_slots * header.slot_bytes)
        self._slot_bytes = header.slot_bytes
        self._num_slots = header.num_slots
        self._release = release
        self.owned = copy
        self._held: collections.deque[weakref.finalize] = collections.deque()
        self._warned = False

    def make_room(self) -> None:
        """Before waiting for a batch: never let held batches take every slot."""
        while self._held and not self._held[0].alive:
            self._held.popleft()
        if len(self._held) >= self._num_slots:
            if not self._warned:
                self._warned = True
                _log.warning(
                    "the trainer holds all %d shared-memory batches of this stream; the oldest "
                    "is being reused while still referenced. Drop batches sooner, raise "
                    "prefetch, or pass copy=True to keep them.", self._num_slots)
            self._held.popleft()()

    def tensors(self, batch: feed_pb2.Batch) -> dict[str, torch.Tensor]:
        base = np.frombuffer(self._memory, np.uint8, count=self._slot_bytes,
                             offset=batch.slot * self._slot_bytes)
        tensors = _tensors(base, batch.tensors)
        if self.owned:
            tensors = {name: t.clone() for name, t in tensors.items()}
        else:
            self._held.append(weakref.finalize(base, self._release, batch.seq))
        return tensors
