"""The slot ring behind every transport, and the layout of a batch in a slot.

A stream owns ``num_slots`` fixed-size slots in one buffer: server heap for the
inline transport, one POSIX shared-memory segment for shm. A slot moves
free -> leased (filling, then published) -> free: it is leased to batch ``seq``
when the batch starts decoding and comes back only when the client releases
that seq. So the server never writes a slot the trainer can still read, and
never holds more than ``num_slots`` batches per stream: the slots are the
stream's credits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch

from gpufeed.v1.vocabulary import SLOT_ALIGN

__all__ = ["BatchLayout", "SlotRing", "TensorPlace"]



def _align(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(frozen=True)
class TensorPlace:
    """One array of a batch: its name, dtype, per-sample shape and slot offset.

    ``wire_dtype`` names the dtype for the client when numpy has none for it
    (bfloat16 is kept as uint16 here).
    """

    name: str
    dtype: np.dtype
    sample_shape: tuple[int, ...]
    offset: int
    wire_dtype: str = ""


class BatchLayout:
    """Where each array of a full batch lives inside a slot (page-aligned).

    ``arrays`` are (name, dtype, per-sample shape[, wire dtype]); those named in
    ``private`` are the server's working space (say, uint8 pixels before a
    float conversion) and are not sent. Those named in ``offsets`` have
    batch_size + 1 rows: the offsets of a variable-length field (media/fields.py).
    """

    def __init__(self, batch_size: int, arrays: list[tuple], private: tuple[str, ...] = (),
                 offsets: tuple[str, ...] = ()):
        self.batch_size = batch_size
        self.places: list[TensorPlace] = []
        self._rows = {name: batch_size + 1 for name in offsets}
        offset = 0
        for name, dtype, shape, *wire in arrays:
            dtype = np.dtype(dtype)
            self.places.append(TensorPlace(name, dtype, tuple(shape), offset, *wire))
            rows = self._rows.get(name, batch_size)
            offset += _align(rows * dtype.itemsize * int(np.prod(shape)))
        self.tensors = [t for t in self.places if t.name not in private]
        self.slot_bytes = offset

    @property
    def pixels(self) -> str:
        """The array decoders write the pixels to: ``decoded`` where the batch pass makes
        ``image`` of it (a float dtype, NHWC), else ``image`` itself."""
        return "decoded" if any(t.name == "decoded" for t in self.places) else "image"

    @overload
    def views(self, slot: np.ndarray) -> dict[str, np.ndarray]: ...

    @overload
    def views(self, slot: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def views(self, slot: np.ndarray | torch.Tensor) -> dict[str, Any]:
        """Full-batch arrays over one slot's bytes (a uint8 array or tensor), by name:
        arrays of an array, tensors of a tensor."""
        out: dict[str, Any] = {}
        for t in self.places:
            rows = self._rows.get(t.name, self.batch_size)
            count = rows * int(np.prod(t.sample_shape))
            end = t.offset + count * t.dtype.itemsize
            if isinstance(slot, np.ndarray):
                flat = slot[t.offset:end].view(t.dtype)
            else:
                flat = slot[t.offset:end].view(_torch_dtype(t.dtype))
            out[t.name] = flat.reshape((rows, *t.sample_shape))
        return out


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


class SlotRing:
    """Leases of fixed-size slots over ``buffer``, keyed by batch seq. Not thread-safe."""

    def __init__(self, buffer, num_slots: int, slot_bytes: int):
        # None once closed (close)
        self._memory: np.ndarray | None = np.frombuffer(buffer, np.uint8,
                                                        count=num_slots * slot_bytes)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._free = deque(range(num_slots))
        self._leased: dict[int, int] = {}

    def lease(self, seq: int) -> int | None:
        """A free slot, now leased to batch ``seq``; None when every slot is leased."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._leased[seq] = slot
        return slot

    def release(self, seq: int) -> None:
        """Return batch ``seq``'s slot. Raises KeyError for a seq that holds none."""
        self._free.append(self._leased.pop(seq))

    def leased(self) -> int:
        return len(self._leased)

    def free_slots(self) -> int:
        return len(self._free)

    def close(self) -> None:
        """Drop the view of the buffer, so that its owner can unmap or free it."""
        self._memory = None

    def slot(self, index: int) -> np.ndarray:
        memory = self._memory
        if memory is None:
            raise RuntimeError("the slot ring is used after it was closed")
        start = index * self.slot_bytes
        return memory[start:start + self.slot_bytes]
