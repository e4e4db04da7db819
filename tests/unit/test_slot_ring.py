"""The slot ring: each slot leased once until released, and never released before it is sent."""

from __future__ import annotations

import numpy as np
import pytest

from gpufeed.server.memory.ring import BatchLayout, SlotRing


def test_ring_leases_each_slot_once_until_released():
    layout = BatchLayout(4, [("image", np.uint8, (3, 2, 3)), ("label", np.int64, ())])
    assert layout.slot_bytes % 4096 == 0
    ring = SlotRing(bytearray(3 * layout.slot_bytes), 3, layout.slot_bytes)
    slots = [ring.lease(seq) for seq in range(3)]
    assert sorted(slots) == [0, 1, 2] and ring.lease(3) is None
    ring.release(1)
    assert ring.lease(3) == slots[1]
    with pytest.raises(KeyError):
        ring.release(1)
    views = layout.views(ring.slot(slots[0]))
    assert views["image"].shape == (4, 3, 2, 3) and views["label"].dtype == np.int64
    views["label"][:] = 7
    assert not ring.slot(slots[1]).any()  # slots do not overlap


def test_a_stream_refuses_the_release_of_a_batch_not_yet_sent(data_dir, image_names):
    """Leased but unpublished: decode threads may still write it (here: a pool of no threads)."""
    from gpufeed.server.config import Limits
    from gpufeed.server.memory.heap import HeapSlots
    from gpufeed.server.serving.planning.plan import plan_stream
    from gpufeed.server.serving.running.pool import DecodePool
    from gpufeed.server.serving.running.stream import Stream
    from gpufeed.server.storage.roots import Storage
    from gpufeed.v1 import feed_pb2

    storage = Storage([str(data_dir)])
    request = feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=image_names[:8]), batch_size=2,
                                     output=feed_pb2.OutputSpec(height=8, width=8), prefetch=1,
                                     transport=feed_pb2.TRANSPORT_INLINE)
    plan = plan_stream(request, storage, Limits(), (feed_pb2.TRANSPORT_INLINE,))
    pool = DecodePool(0, lambda: None)  # no thread, so no per-thread state
    stream = Stream(plan, storage, pool, HeapSlots(plan))
    stream.start()
    assert stream.ring.leased() == 2
    with pytest.raises(KeyError):
        stream.release([1])
    assert stream.ring.leased() == 2
