"""How a pass orders its samples: padded to whole ranks, shuffled by (seed, epoch), batched."""

from __future__ import annotations

import numpy as np

from gpufeed.server.serving.planning.order import samples_at, shard_order, split_batches


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
