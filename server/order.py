"""The ordered sample list of one stream: pad, shard, shuffle, batch, resume.

Order is a pure function of the request (list, rank, world_size, shuffle, seed,
epoch), never of timing or thread count, so batch k of a stream always holds the
same samples and a stream can be resumed at any batch.

Every rank gets as many samples, hence as many batches (a rank with one batch
more would wait forever in DDP's last all-reduce): as torch's DistributedSampler
does, the list is padded to a multiple of world_size by repeating samples from
its start. An order holds *positions* in that padded list; position p is sample
``p % num_samples``, a repeat when ``p >= num_samples`` (``samples_at``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["samples_at", "shard_order", "split_batches"]


def shard_order(num_samples: int, *, rank: int, world_size: int,
                shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """Positions of this rank's samples in the padded list, in delivery order.

    Position p belongs to rank ``p % world_size``; the shard is then permuted by
    a generator seeded with (seed, epoch), identical on every machine.
    """
    padded_total = -(-num_samples // world_size) * world_size
    order = np.arange(rank, padded_total, world_size, dtype=np.int64)
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(order)
    return order


def split_batches(order: np.ndarray, batch_size: int, drop_last: bool) -> list[np.ndarray]:
    """Consecutive batches of ``batch_size`` indices; the last may be short."""
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]


def samples_at(positions: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample indices, whether each is a padding repeat) of positions in the padded list."""
    return positions % num_samples, positions >= num_samples
