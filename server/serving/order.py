"""The ordered sample list of one stream: pad, shard, shuffle, batch, resume.

Order is a pure function of the request (list, rank, world_size, shuffle, seed,
epoch), never of timing or thread count, so batch k of a stream always holds the
same samples and a stream can be resumed at any batch.

Every rank gets as many samples, hence as many batches (a rank with one batch
more would wait forever in DDP's last all-reduce): as torch's DistributedSampler
does, the list is padded to a multiple of world_size by repeating samples from
its start. An order holds *positions* in that padded list; position p is sample
``p % num_samples``, a repeat when ``p >= num_samples`` (``samples_at``).

Tar shards (storage/shards.py) are dealt to ranks whole, so their order is
``tar_order``, by the same rules where they apply:

1. the shard list is permuted by a generator seeded with (seed, epoch) when
   shuffling (the same permutation on every rank);
2. rank r takes shards r, r + world_size, ... of that list; a rank with fewer
   samples than the longest repeats its own first samples (as positions past
   the end, flagged ``padded``) so that every rank has as many batches;
3. the rank's samples, shard after shard, in each shard's order, pass through
   a shuffle buffer of ``SHUFFLE_BUFFER`` samples seeded with
   (seed, epoch, rank): once full, each next sample takes the place of a
   uniformly chosen one, which is delivered; at the end the rest are
   delivered in a random order.

The memory bound: the sample delivered at position p is among the first
p + ``SHUFFLE_BUFFER`` samples of the rank's sequential stream, so the bytes a
stream touches at any moment lie in a window of ``SHUFFLE_BUFFER`` + (prefetch
+ 1) x batch_size samples of consecutive shards, which reads within a shard
keep near-sequential (the page cache's read-ahead, or S3 chunks).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["SHUFFLE_BUFFER", "Batches", "buffer_shuffle", "samples_at", "shard_order",
           "split_batches", "tar_order"]

# Samples in a tar-shard stream's shuffle buffer (WebDataset's default is 1000 too).
SHUFFLE_BUFFER = 1000


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


def tar_order(first: np.ndarray, *, rank: int, world_size: int, shuffle: bool, seed: int,
              epoch: int) -> np.ndarray:
    """Positions of this rank's samples from tar shards, in delivery order (the rule in the
    module docstring). Shard s holds samples ``first[s]`` to ``first[s + 1]`` (its
    ``ShardSet.first``); positions past the last sample are padding repeats."""
    num_samples = int(first[-1])
    shards = np.arange(len(first) - 1)
    if shuffle:
        shards = np.random.default_rng([seed, epoch]).permutation(shards)
    mine = shards[rank::world_size]
    order = np.concatenate([np.arange(int(first[s]), int(first[s + 1])) for s in mine]
                           ).astype(np.int64) if len(mine) else np.zeros(0, np.int64)
    if shuffle:
        order = buffer_shuffle(order, np.random.default_rng([seed, epoch, rank]), SHUFFLE_BUFFER)
    # Every rank as long as the longest: repeats of this rank's own first samples, as
    # positions past the end (p -> sample p % num_samples, padded), as for loose files.
    counts = np.diff(first)
    longest = max(int(counts[shards[r::world_size]].sum()) for r in range(world_size))
    if 0 < len(order) < longest:
        order = np.concatenate([order, np.resize(order, longest - len(order)) + num_samples])
    return order


def buffer_shuffle(stream: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    """WebDataset's shuffle buffer of ``size`` samples, made deterministic by ``rng``: the
    sample delivered at position p is among the first p + size of ``stream``."""
    if len(stream) <= size:
        return rng.permutation(stream)
    out = np.empty_like(stream)
    buffer = stream[:size].copy()
    picks = rng.integers(0, size, len(stream) - size)
    for n, (incoming, pick) in enumerate(zip(stream[size:].tolist(), picks.tolist())):
        out[n] = buffer[pick]
        buffer[pick] = incoming
    out[len(stream) - size:] = rng.permutation(buffer)
    return out


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
