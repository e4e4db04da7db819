"""Turning Batch messages into tensor dicts: the protocol each transport's reader keeps.

A stream has one ``BatchReader``, made for the transport its header names:
``InlineBatches`` (inline.py), ``ShmBatches`` (shm.py), ``CudaBatches``
(cuda_ipc.py). A reader hands each batch's slot back to the server itself,
through the ``Release`` it was given: at once when nothing of the server's is
held, else when the trainer has dropped the batch. The stream (stream.py)
never asks which it was.

Every transport builds a batch's tensors the same way: as views of one storage
per batch that holds the slot's bytes (``slot_tensors``). For inline the
storage is the received message's bytes themselves (read-only views; owned
copies with ``copy=True``), so the slot is released as soon as the message is
read.

shm and cuda_ipc: the storage aliases the stream's shared slot, no copy, and
the slot goes back when the trainer drops the batch (no tensor refers to it
any more). A tensor the trainer still references never changes: when the
trainer already holds all but one slot of the ring, a newly arrived batch is
copied into memory the trainer owns (on the batch's device) and its slot goes
back at once (``HeldSlots.has_room``). So a loop that drops its batches (even
one that holds the previous batch while it fetches the next, as every ``for``
loop does) gets views, and one that keeps batches (``list(loader)``, an eval
loop collecting labels) gets copies once it holds ``prefetch`` of them; the
batches it already holds keep their slots until dropped. Chosen over remapping
the oldest held slot's pages to a private copy (``MAP_FIXED``) because it works
the same for CUDA memory, where torch offers no way to swap the memory under a
live tensor. ``copy=True`` gives owned tensors always.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import BFLOAT16, carrier_dtype

from .checks import check_slot, check_tensors, data_loss

__all__ = ["BatchReader", "HeldSlots", "Release", "SharedSlots", "owned", "slot_tensors"]

Release = Callable[[int], None]  # gives batch seq's slot back to the server


class BatchReader(Protocol):
    """One stream's Batch messages into tensors, for the transport its header names.

    Made from the header, a ``Release`` and ``copy`` (owned tensors always);
    called from the thread that iterates the stream, except that slots may be
    released from any thread (a finaliser, a CUDA event watcher).
    """

    shared: bool
    """Whether the reader mapped or opened memory of the server's: the stream
    then says ``attached``, and the server may let go of the memory's name."""

    def make_room(self) -> None:
        """Release the slots of the batches the trainer has dropped since."""
        ...

    def tensors(self, batch: feed_pb2.Batch) -> dict[str, torch.Tensor]:
        """The batch's tensors, by name; its slot is released now if they hold
        nothing of the server's, else once the trainer has dropped them."""
        ...

    def close(self) -> None:
        """The stream has ended: stop whatever the reader runs."""
        ...


def slot_tensors(slot: torch.UntypedStorage, metas) -> dict[str, torch.Tensor]:
    """The batch's tensors, by name: views of ``slot`` (a slot's bytes, on any device).

    ``metas`` (TensorMetas, or the Places ``checks.check_tensors`` gives for them)
    must have passed ``check_tensors`` against the slot's size."""
    out = {}
    for meta in metas:
        dtype = _torch_dtype(meta.dtype)
        # torch's stub makes set_'s stride required; left out, it is contiguous.
        out[meta.name] = torch.empty(0, dtype=dtype, device=slot.device).set_(  # pyright: ignore[reportCallIssue]
            slot, meta.offset // dtype.itemsize, tuple(meta.shape))
    return out


def _storage_in_use(storage: torch.UntypedStorage) -> bool:
    """Whether a tensor still refers to ``storage`` (views of it count; copies do not).

    Tensors of a CUDA buffer keep no Python object of their own alive that a
    finaliser could watch; the storage's use count says whether they live.
    ``_storage_Use_Count`` is private torch API (here since torch 2.0): the
    CPU test of SharedSlots is what guards it against a torch upgrade.
    """
    return torch._C._storage_Use_Count(storage._cdata) > 1


@functools.cache
def _torch_dtype(name: str) -> torch.dtype:
    if name == BFLOAT16:  # numpy has no bfloat16 (the server carries it as uint16); torch does
        return torch.bfloat16
    return torch.from_numpy(np.empty(0, carrier_dtype(name))).dtype


class HeldSlots:
    """The zero-copy batches the trainer still holds, oldest first.

    Each is held with its slot, a test of whether the trainer still refers to it
    and a function that gives its slot back (once). ``make_room`` gives back the
    batches nobody refers to any more. ``has_room`` says whether a new batch may
    stay a view: not when the held ones take all slots but one, since then the
    server could never send another batch while the trainer keeps them.
    ``check_free`` refuses a batch in a slot the trainer still refers to: the
    server has written over a batch the trainer holds.
    """

    def __init__(self, num_slots: int):
        self._num_slots = num_slots
        self._held: collections.deque[tuple[int, Callable[[], bool], Callable[[], None]]] = \
            collections.deque()

    def hold(self, slot: int, in_use: Callable[[], bool], give_back: Callable[[], None]) -> None:
        self._held.append((slot, in_use, give_back))

    def make_room(self) -> None:
        still_held = collections.deque()
        for held in self._held:
            _, in_use, give_back = held
            if in_use():
                still_held.append(held)
            else:
                give_back()
        self._held = still_held

    def has_room(self) -> bool:
        self.make_room()
        return len(self._held) < self._num_slots - 1

    def check_free(self, batch: feed_pb2.Batch) -> None:
        # A batch the trainer has just dropped may still be listed: in_use says.
        for slot, in_use, _ in self._held:
            if slot == batch.slot and in_use():
                raise data_loss(f"the server sent batch {batch.seq} in slot {slot}, which "
                                f"holds a batch the trainer has not released")


class SharedSlots:
    """Batches as views of one storage of ``num_slots`` slots that the server shares
    (cuda_ipc's opened device buffer; any device, so it is tested on the CPU).

    Each batch gets a storage of its own that aliases its slot, so that its use
    count tells when the trainer has dropped the batch; ``give_back`` is then
    called at the next ``make_room``. With ``copy``, or when the trainer holds
    all slots but one, the tensors are clones and the slot goes back at once
    (``give_back`` runs after the clone is queued on the device).
    """

    def __init__(self, storage: torch.UntypedStorage, num_slots: int, slot_bytes: int,
                 copy: bool):
        self._storage = storage
        self._num_slots = num_slots
        self._slot_bytes = slot_bytes
        self._copy = copy
        self._held = HeldSlots(num_slots)
        self.make_room = self._held.make_room

    def tensors(self, batch: feed_pb2.Batch,
                give_back: Callable[[], None]) -> dict[str, torch.Tensor]:
        check_slot(batch, self._num_slots)
        self._held.check_free(batch)
        places = check_tensors(batch.tensors, self._slot_bytes, f"its {self._slot_bytes}-byte slot")
        start = batch.slot * self._slot_bytes
        slot = self._storage[start:start + self._slot_bytes]  # a storage of its own, aliased
        tensors = slot_tensors(slot, places)
        if self._copy or not self._held.has_room():
            tensors = owned(tensors)
            give_back()
        else:
            self._held.hold(batch.slot, lambda: _storage_in_use(slot), give_back)
        return tensors


def owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of a batch's tensors that the trainer owns, on the same device."""
    return {name: t.clone() for name, t in tensors.items()}
