"""Pure pieces of the server, without a process: ordering, data roots, the slot ring."""

from __future__ import annotations

import numpy as np
import pytest

from gpufeed.server.memory.ring import BatchLayout, SlotRing
from gpufeed.server.serving.planning.order import samples_at, shard_order, split_batches
from gpufeed.server.storage.paths import DataRoots, OutsideDataRoots


def test_pad_shard_then_shuffle():
    """10 samples over 3 ranks: padded to 12 positions, 10 and 11 repeating samples 0 and 1."""
    order = shard_order(10, rank=1, world_size=3, shuffle=False, seed=0, epoch=0)
    assert order.tolist() == [1, 4, 7, 10]
    samples, padded = samples_at(order, 10)
    assert samples.tolist() == [1, 4, 7, 0] and padded.tolist() == [False] * 3 + [True]
    assert shard_order(10, rank=0, world_size=5, shuffle=False, seed=0, epoch=0).tolist() == [0, 5]
    shuffled = shard_order(100, rank=1, world_size=3, shuffle=True, seed=0, epoch=0)
    assert sorted(shuffled.tolist()) == list(range(1, 102, 3))
    assert shuffled.tolist() == shard_order(100, rank=1, world_size=3, shuffle=True, seed=0,
                                            epoch=0).tolist()


def test_split_batches():
    order = np.arange(10)
    assert [b.tolist() for b in split_batches(order, 4, drop_last=False)] == \
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(split_batches(order, 4, drop_last=True)) == 2


def test_data_roots_confine_names(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (b / "only-in-b.jpg").write_bytes(b"x")
    roots = DataRoots([str(a), str(b)])
    assert roots.locate("x/y.jpg") == str(a / "x/y.jpg")
    assert roots.locate("only-in-b.jpg") == str(b / "only-in-b.jpg")
    assert roots.locate(str(b / "z.jpg")) == str(b / "z.jpg")
    for bad in ("../a/x.jpg", "x/../../etc/passwd", "/etc/passwd", str(tmp_path / "ab")):
        with pytest.raises(OutsideDataRoots):
            roots.locate(bad)
    (a / "escape").symlink_to("/etc")
    with pytest.raises(OutsideDataRoots):
        roots.read(roots.locate("escape/hostname"))


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
