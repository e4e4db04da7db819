"""The ordered sample list of one stream: pad, shard, shuffle, batch, resume.

Order is a pure function of the request (list, rank, world_size, shuffle, seed,
epoch, and the epoch's earlier phases when it is resumed at another world
size), never of timing or thread count, so batch k of a stream always holds the
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

An elastic job (ranks lost or added) continues an epoch at another world size
(``resumed_order``). The epoch then runs in *phases*: the first is the epoch's
own order at the world size it started with; each rank of a phase consumed as
many batches (synchronous data parallelism), and the samples none of them had
delivered (padding repeats aside: a repeat delivers nothing new), taken
position by position across that phase's ranks (rank 0's next, rank 1's next,
...), are the next phase's list, dealt to its ranks by sample (sample j to rank
j % world_size) and padded from its start as above. Every sample is so
delivered once per epoch over all the phases; a list dealt and taken back in
turn is itself again, so a phase in which nothing was consumed changes nothing;
and the rest keeps the epoch's shuffle, as the next phase deals it without
shuffling again. The next epoch is the new world size's own. A resumed epoch
of tar shards is dealt by sample, not by whole shard: each of its ranks reads
within the windows of every rank of the phase before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

__all__ = ["SHUFFLE_BUFFER", "Batches", "EpochOrder", "PhaseOverrun", "buffer_shuffle",
           "resumed_order", "samples_at", "shard_order", "split_batches", "tar_order"]

# Samples in a tar-shard stream's shuffle buffer (WebDataset's default is 1000 too).
SHUFFLE_BUFFER = 1000


def shard_order(num_samples: int, *, rank: int, world_size: int,
                shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """Positions of this rank's samples in the padded list, in delivery order.

    Position p belongs to rank ``p % world_size``; the shard is then permuted by
    a generator seeded with (seed, epoch), identical on every machine. Every
    rank's shard is as long, so one permutation of its places serves them all
    (numpy permutes an array as it permutes ``arange`` of its length), which is
    how ``EpochOrder.every_rank`` builds all of them at once.
    """
    return rank + world_size * _places(-(-num_samples // world_size), shuffle, seed, epoch)


def _places(length: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The order a rank's shard of loose files is delivered in, as places in the shard."""
    if shuffle:
        return np.random.default_rng([seed, epoch]).permutation(length)
    return np.arange(length, dtype=np.int64)


def tar_order(first: np.ndarray, *, rank: int, world_size: int, shuffle: bool, seed: int,
              epoch: int) -> np.ndarray:
    """Positions of this rank's samples from tar shards, in delivery order (the rule in the
    module docstring). Shard s holds samples ``first[s]`` to ``first[s + 1]`` (its
    ``ShardSet.first``); positions past the last sample are padding repeats."""
    shards, longest = _deal_shards(first, world_size, shuffle, seed, epoch)
    return _tar_rank(first, shards, longest, rank, world_size, shuffle, seed, epoch)


def _deal_shards(first: np.ndarray, world_size: int, shuffle: bool, seed: int, epoch: int
                 ) -> tuple[np.ndarray, int]:
    """The epoch's shard list (rank r takes its places r, r + world_size, ...) and the
    most samples any rank gets, which every rank is padded to."""
    shards = np.arange(len(first) - 1)
    if shuffle:
        shards = np.random.default_rng([seed, epoch]).permutation(shards)
    counts = np.diff(first)[shards]
    per_rank = np.bincount(np.arange(len(shards)) % world_size, weights=counts,
                           minlength=world_size)
    return shards, int(per_rank.max())


def _tar_rank(first: np.ndarray, shards: np.ndarray, longest: int, rank: int, world_size: int,
              shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    num_samples = int(first[-1])
    mine = shards[rank::world_size]
    order = np.concatenate([np.arange(int(first[s]), int(first[s + 1])) for s in mine]
                           ).astype(np.int64) if len(mine) else np.zeros(0, np.int64)
    if shuffle:
        order = buffer_shuffle(order, np.random.default_rng([seed, epoch, rank]), SHUFFLE_BUFFER)
    # Every rank as long as the longest: repeats of this rank's own first samples, as
    # positions past the end (p -> sample p % num_samples, padded), as for loose files.
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

    @overload
    def __getitem__(self, k: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, k: slice) -> Batches: ...

    def __getitem__(self, k: int | slice) -> np.ndarray | Batches:
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


@dataclass(frozen=True, eq=False)
class EpochOrder:
    """One epoch's order rule, for any split over ranks: loose files (``first`` is None)
    or tar shards (``first``: ``ShardSet.first``)."""

    num_samples: int
    first: np.ndarray | None
    shuffle: bool
    seed: int
    epoch: int

    def rank(self, rank: int, world_size: int) -> np.ndarray:
        """Rank ``rank``'s positions, in delivery order (``shard_order``, ``tar_order``)."""
        if self.first is None:
            return shard_order(self.num_samples, rank=rank, world_size=world_size,
                               shuffle=self.shuffle, seed=self.seed, epoch=self.epoch)
        return tar_order(self.first, rank=rank, world_size=world_size, shuffle=self.shuffle,
                         seed=self.seed, epoch=self.epoch)

    def every_rank(self, world_size: int) -> np.ndarray:
        """[world_size, n]: row r is ``rank(r, world_size)``; -1 fills a tar rank that has
        no sample (every other is padded to the longest)."""
        if self.first is None:
            places = _places(-(-self.num_samples // world_size), self.shuffle, self.seed,
                             self.epoch)
            return np.arange(world_size, dtype=np.int64)[:, None] + world_size * places[None, :]
        shards, longest = _deal_shards(self.first, world_size, self.shuffle, self.seed,
                                       self.epoch)
        orders = np.full((world_size, longest), -1, dtype=np.int64)
        for rank in range(world_size):
            row = _tar_rank(self.first, shards, longest, rank, world_size, self.shuffle,
                            self.seed, self.epoch)
            orders[rank, :len(row)] = row
        return orders


class PhaseOverrun(ValueError):
    """A resumed phase's ranks are said to have consumed more batches than they had."""

    def __init__(self, index: int, batches: int, available: int):
        super().__init__(f"phase {index}: {batches} batches, but each rank had {available}")
        self.index, self.batches, self.available = index, batches, available


def resumed_order(epoch: EpochOrder, phases: Sequence[tuple[int, int]], *, rank: int,
                  world_size: int, batch_size: int, drop_last: bool) -> np.ndarray:
    """Rank ``rank``'s positions in an epoch whose earlier ``phases`` ((world_size,
    batches every rank consumed), first to last) are over: the samples none of them
    delivered, dealt over ``world_size`` ranks (the module docstring). No phases: the
    epoch's own order. ``PhaseOverrun`` names a phase said to have consumed more
    batches than its ranks had."""
    if not phases:
        return epoch.rank(rank, world_size)
    rest = np.zeros(0, np.int64)
    for index, (size, batches) in enumerate(phases):
        orders = epoch.every_rank(size) if index == 0 else _deal(rest, size, epoch.num_samples)
        rest = _rest(orders, batches, batch_size, drop_last, epoch.num_samples, index)
    return np.ascontiguousarray(_deal(rest, world_size, epoch.num_samples)[rank])


def _rest(orders: np.ndarray, batches: int, batch_size: int, drop_last: bool,
          num_samples: int, index: int) -> np.ndarray:
    """The samples a phase's ranks (rows of ``orders``) had not delivered after
    ``batches`` batches each, position by position across the ranks, repeats left out."""
    length = orders.shape[1]
    stop = length - length % batch_size if drop_last else length
    available = -(-stop // batch_size)
    if batches > available:
        raise PhaseOverrun(index, batches, available)
    left = orders[:, min(batches * batch_size, stop):].T.reshape(-1)
    return left[(left >= 0) & (left < num_samples)]


def _deal(samples: np.ndarray, world_size: int, num_samples: int) -> np.ndarray:
    """[world_size, n]: ``samples`` dealt by sample (sample j to rank j % world_size),
    padded from the list's start, as positions past the end, so every rank has as many."""
    pad = -len(samples) % world_size
    padded = np.concatenate([samples, np.resize(samples, pad) + num_samples])
    return padded.reshape(-1, world_size).T
