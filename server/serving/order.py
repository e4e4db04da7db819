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

from collections.abc import Sequence

import numpy as np

__all__ = ["Batches", "samples_at", "shard_order", "split_batches"]


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


class Batches(Sequence[np.ndarray]):
    """Consecutive batches of ``batch_size`` indices of ``order``; the last may be short.

    Batch k is a view of ``order`` made when asked for: a pass of millions of
    samples is one array, not a list of a hundred thousand small ones. A slice
    (say, every P-th batch from p, a server's part of a scale-out) is such a
    sequence too.
    """

    def __init__(self, order: np.ndarray, batch_size: int, drop_last: bool,
                 numbers: range | None = None):
        self.order = order
        self.batch_size = batch_size
        self._drop_last = drop_last
        self._stop = len(order) - len(order) % batch_size if drop_last else len(order)
        # The pass's batch numbers this sequence holds.
        self._numbers = numbers if numbers is not None else range(-(-self._stop // batch_size))

    def __len__(self) -> int:
        return len(self._numbers)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return Batches(self.order, self.batch_size, self._drop_last, self._numbers[k])
        start = self._numbers[k] * self.batch_size  # IndexError past the end
        return self.order[start:min(start + self.batch_size, self._stop)]

    def samples_from(self, k: int) -> int:
        """How many samples batches k.. hold."""
        numbers = self._numbers[k:]
        short = -self._stop % self.batch_size  # what the pass's last batch lacks
        last = -(-self._stop // self.batch_size) - 1
        return len(numbers) * self.batch_size - (short if last in numbers else 0)


def split_batches(order: np.ndarray, batch_size: int, drop_last: bool) -> Batches:
    """Consecutive batches of ``batch_size`` indices; the last may be short."""
    return Batches(order, batch_size, drop_last)


def samples_at(positions: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample indices, whether each is a padding repeat) of positions in the padded list."""
    return positions % num_samples, positions >= num_samples
