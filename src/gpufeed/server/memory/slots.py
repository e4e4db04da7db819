"""The slot memory of a stream: one protocol, one backend per transport.

A stream's ring (ring.py) leases slots of one buffer; where that buffer lives
is the transport: the server's heap (inline, heap.py), a POSIX shared-memory
segment (shm, shm.py), or pinned host memory with a device twin (cuda_ipc,
cuda_ipc.py). Each backend is a ``SlotMemory``, so the servicer and the stream
hold one memory object and never ask which transport it is:

- ``host``: the bytes decode threads write, ``num_slots`` slots back to back;
- ``header()``: the StreamHeader fields that tell the client where they are;
- ``shared`` and ``attached()``: whether the client maps (or opens) the memory
  and says so, and what the memory does when it has (shm unlinks its name);
- ``filled(slot, rows)``: the batch pass where the memory runs it on the host,
  in the decode thread that wrote the slot's last row;
- ``device_views(slot)``: the slot's arrays in the device memory the client
  reads, where the memory has such a twin (cuda_ipc): a batch decoded on the GPU
  is written there and not to ``host`` (the batch says so: ``pixels_on_device``);
- ``publish(batch)``: a filled slot made visible to the client (cuda_ipc copies
  it to the device first), and the Batch message's fields;
- ``close()``: the stream has ended and the client has attached or never will.

Which backend a stream gets is ``SlotMemories``'s choice (memories.py).
"""

from __future__ import annotations

import mmap
from typing import Protocol

import numpy as np
import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import wire_text

from .ring import BatchLayout

__all__ = ["BatchPass", "FilledBatch", "SlotMemory", "SlotPlan", "batch_fields",
           "batch_pass_on_host"]


class BatchPass(Protocol):
    """The batch pass a memory runs over a filled slot (media's ``OutputTransform``)."""

    @property
    def has_batch_pass(self) -> bool:
        """Whether ``finish_slot`` does anything."""
        ...

    def finish_slot(self, arrays: dict[str, torch.Tensor], rows: int) -> None:
        """The pass over the slot's first ``rows`` rows, in place."""
        ...


class SlotPlan(Protocol):
    """What a memory reads of a stream's plan (serving's ``StreamPlan``): so many slots of
    this layout, for this transport, and the batch pass to run on each. A protocol of
    its own, so that memory/ imports nothing of serving/."""

    @property
    def num_slots(self) -> int: ...

    @property
    def layout(self) -> BatchLayout: ...

    @property
    def transport(self) -> int: ...

    @property
    def transform(self) -> BatchPass | None: ...


class FilledBatch(Protocol):
    """What a memory reads of a batch whose rows are written (serving's ``SlotBatch``)."""

    seq: int
    slot: int
    rows: int
    failures: list[tuple[int, int, str]]  # (index, FailureCategory, reason)
    pixels_on_device: bool  # its pixels were written in ``device_views``, not in ``host``

    def sent(self, name: str) -> np.ndarray:
        """The array ``name`` as it is sent (its filled rows, or a packed field's entries)."""
        ...


class SlotMemory(Protocol):
    """The memory behind one stream's slots, and how the client gets at them.

    Called from the stream's threads: ``filled`` by decode threads,
    ``attached`` by the client-reader thread, the rest by the gRPC handler.
    """

    @property
    def host(self) -> bytearray | mmap.mmap | np.ndarray:
        """The bytes decode threads write: ``num_slots`` slots of ``slot_bytes``."""
        ...

    shared: bool
    """Whether the client maps or opens this memory and says ``attached``: the
    server must not let it go before it has (or has left)."""

    def header(self) -> feed_pb2.StreamHeader:
        """A StreamHeader with the fields that name this memory for the client."""
        ...

    def attached(self) -> None:
        """The client has mapped or opened the memory."""
        ...

    def filled(self, slot: np.ndarray, rows: int) -> None:
        """Every row of ``slot`` (its bytes in ``host``) is written; the batch pass runs
        here if this memory runs it on the host."""
        ...

    def device_views(self, slot: int) -> dict[str, torch.Tensor] | None:
        """Slot ``slot``'s arrays, by name, in the device memory the client reads, for a
        decoder on that device to write; None where the memory has no device twin."""
        ...

    def publish(self, batch: FilledBatch) -> tuple[feed_pb2.Batch, list[memoryview] | None]:
        """Make a filled batch visible to the client: its Batch message's fields, and
        the arrays' bytes when they travel in the message (None: in this memory)."""
        ...

    def close(self) -> None:
        """Let the memory go: the stream has ended, and no decode thread writes it."""
        ...


def batch_fields(batch: FilledBatch, layout: BatchLayout) -> feed_pb2.Batch:
    """A batch's Batch fields: seq, slot, failures and, when it has rows, each
    tensor's name, dtype, shape and offset in the slot."""
    fields = feed_pb2.Batch(seq=batch.seq, slot=batch.slot)
    for index, category, reason in batch.failures:
        fields.failures.add(index=index, category=category, reason=wire_text(reason))
    if batch.rows:
        for place in layout.tensors:
            fields.tensors.add(name=place.name, dtype=place.wire_dtype or place.dtype.name,
                               shape=batch.sent(place.name).shape,
                               offset=place.offset)
    return fields


def batch_pass_on_host(plan: SlotPlan, slot: np.ndarray, rows: int) -> None:
    """Run the plan's batch pass (if any) over a host slot's first ``rows`` rows."""
    if plan.transform and plan.transform.has_batch_pass:  # else no views to make either
        views = plan.layout.views(torch.from_numpy(slot))
        plan.transform.finish_slot(views, rows)
