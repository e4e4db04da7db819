"""The ordered sample list of one stream: shard, shuffle, batch, resume.

Order is a pure function of the request (list, rank, world_size, shuffle, seed,
epoch), never of timing or thread count, so batch k of a stream always holds the
same samples and a stream can be resumed at any batch.
"""

from __future__ import annotations

import numpy as np

__all__ = ["shard_order", "split_batches"]


def shard_order(num_samples: int, *, rank: int, world_size: int,
                shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """Sample indices of this rank, in delivery order.

    Sample i belongs to rank ``i % world_size``; the shard is then permuted by a
    generator seeded with (seed, epoch), identical on every machine.
    """
    order = np.arange(rank, num_samples, world_size, dtype=np.int64)
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(order)
    return order


def split_batches(order: np.ndarray, batch_size: int, drop_last: bool) -> list[np.ndarray]:
    """Consecutive batches of ``batch_size`` indices; the last may be short."""
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]
