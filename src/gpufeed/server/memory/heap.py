"""The inline transport's slot memory: the server's heap.

Nothing is shared with the client: each batch's arrays travel in its Batch
message, taken from the slot's rows as views (``publish``), which the
response serializer (serving/edge/wire.py) writes onto the wire with one copy.
Each array starts at a multiple of ``INLINE_ALIGN`` bytes (gpufeed.v1.vocabulary) of the message's
data, so the client can view every dtype in place.
"""

from __future__ import annotations

import numpy as np

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import INLINE_ALIGN

from .slots import FilledBatch, SlotPlan, batch_fields, batch_pass_on_host

__all__ = ["HeapSlots"]


class HeapSlots:
    """A stream's slots in a ``bytearray``; batches are sent inline (a ``SlotMemory``)."""

    shared = False

    def __init__(self, plan: SlotPlan):
        self._plan = plan
        self.host = bytearray(plan.num_slots * plan.layout.slot_bytes)

    def header(self) -> feed_pb2.StreamHeader:
        return feed_pb2.StreamHeader()

    def attached(self) -> None:
        pass

    def filled(self, slot: np.ndarray, rows: int) -> None:
        batch_pass_on_host(self._plan, slot, rows)

    def device_views(self, slot: int) -> None:
        return None

    def publish(self, batch: FilledBatch) -> tuple[feed_pb2.Batch, list[memoryview] | None]:
        """The fields, with each tensor's offset in the message's data, and the rows'
        bytes (views of the slot, padded to ``INLINE_ALIGN``)."""
        fields = batch_fields(batch, self._plan.layout)
        if not batch.rows:  # every sample failed: no tensors, no data
            return fields, None
        chunks, offset = [], 0
        for meta in fields.tensors:
            array = batch.sent(meta.name)
            meta.offset = offset
            if array.nbytes:
                view = np.ascontiguousarray(array).data  # the array's memoryview
                chunks.append(view.cast("B"))
                padding = -array.nbytes % INLINE_ALIGN
                if padding:
                    chunks.append(memoryview(bytes(padding)))
                offset += array.nbytes + padding
        return fields, chunks

    def close(self) -> None:
        self.host = bytearray()
