"""Tar shards in WebDataset's layout: which samples they hold, in what order, and how
one is read.

A request whose names end in ``.tar`` (a list, a list file, or brace patterns
such as ``train-{0000..0146}.tar``) names shards. A sample is the group of
consecutive members sharing a key: the member's path up to the first dot of its
file name (``a/000123.jpg`` and ``a/000123.cls`` are sample ``a/000123``). Its
image member (``.jpg``, ``.png``, ... ) decodes as a loose image does; a ``.cls``
or ``.txt`` member holding an integer is its label (a stream has labels when
its first sample has one; a later sample without one fails).

Each shard's members are indexed once, at plan time, from the tar headers
(offsets and sizes, read by tarindex.py's own parser, which trusts no number a
header gives; a local shard is read where its headers are, an S3 object in one
sequential GET) and the index is kept, keyed by the shard's version, for later
requests. A sample is then (shard, offset, size): rows still decode in
parallel on the decode pool, each reading just its own members, never
extracting anything to disk. ``index`` is a sample's position among all
samples of the listed shards, in list order.

Indexing is bounded as it goes, not after: ``ShardSet.index`` counts samples as
the headers are read and stops once they pass the request's ``--max-samples``
(TooManySamples), and stops when the request is cancelled (IndexCancelled),
checked between shards and every few thousand headers. A shard whose headers
break the format (a negative or oversized size, a bad checksum, a record larger
than the shard) fails alone: "not a tar shard" if nothing came before, else
the samples before are kept as of a truncated shard, but for the last one, whose
members may go on past where the index stopped: it fails, "truncated shard"
saying why the index stopped there.

A sample is read from the version its index describes, or fails. The index
records the version it read (versions.py: a local file's device, inode, size and
mtime; an object's ETag); a local shard's descriptor is checked against it when
the stream opens it, and an S3 range asks ``If-Match`` that ETag. A shard
replaced since it was indexed fails its remaining samples in the stream
("shard changed since it was indexed", category unreadable, counted as any
failure), and its index is dropped from the cache, so that the next request
indexes the new version.

What a sample reads is the bytes from its first used member (image, label,
declared fields) to the end of its last: a sample's members are adjacent in the
tar, so the span is their data and the 512-byte headers between. A pass never
reads a whole shard for its samples: a rank reads only its own shards' samples,
a resume mid-shard reads from the sample it resumes at.

Locally the unit of reading is one sample (one ``pread`` on the decode thread
that decodes it: a page-cached read is a short system call), on a descriptor
the stream opened once for the shard (shardfiles.py), not per sample. On S3 it is a
*chunk* (chunks.py): a request costs far more CPU than its bytes (signing, HTTP,
the object server's answer: ~3 ms per image with one GET per sample,
bench/RESULTS.md, "Tar shards and S3"), so when a claimed batch needs a sample no chunk holds, one
ranged GET fetches a run of whole samples starting at it: the sample, then the
shard's next samples the stream will read and has not read or fetched, up to
``CHUNK_BYTES`` (4 MiB, chosen by measurement: bench/RESULTS.md, "The S3 chunk size") and the
stream's share of the read-ahead budget for samples ahead of its claimed
batches (``--read-ahead-bytes`` / 4). Each sample is then handed its bytes
sliced from the chunk (a memoryview; the member handed to the decoder is one
copy of it, as slicing a sample's own read was), and the chunk is dropped when
its last sample is taken, or when the stream ends. An unshuffled pass thus
makes one GET per 4 MiB of samples; a resume starts its first chunk at the
sample it resumes at; a rank fetches only its own shards. The memory bound per
stream: its share, plus the chunks that hold samples of its claimed batches
(each at most ``CHUNK_BYTES``, or one sample), all within the read-ahead budget
except reads a decode thread makes itself when the I/O stage had no room. A
shuffled pass fetches samples entering the shuffle buffer's window ahead of their
turn as far as the share holds them (the window is the next paragraphs'), then
reads one by one. A chunk's GET that fails fails none of its samples by itself:
each reads its own range again. A sample larger than ``CHUNK_BYTES`` is a chunk
of its own; one over ``--max-file-bytes`` fails, as a loose file would.

The one read of a whole shard is its index. Tar headers sit between the
members, so finding them costs either the whole object in one streamed GET (S3)
or a round trip per member; the former is chosen. A local shard is read in
windows where its headers are (wide ones over small members, narrow ones
between large members). It happens once per shard version per server process
(the cache above; an index that a read error cut short is not kept), for every
listed shard, other ranks' too: the padding rule and ``index`` need every
shard's sample count. The metrics count it apart
(``gpufeed_storage_index_bytes``), beside the samples' reads.

The order of a pass (shards dealt to ranks whole, a shuffle buffer within a
rank's stream, padding to the longest rank) is serving/planning/order.py's ``tar_order``,
over ``ShardSet.first``. The plan holds 8 bytes of order, about 40 bytes of
index per sample (16 more per member extension beyond image and label, which a
request's fields may name; a shard's first 32 such extensions are indexed), its
key (its bytes and 4 more: a sample's name, ``loader(names=True)``, is its shard's
and its key) and a byte for which samples the stream reads (chunks.py), plus each
shard's path.

Resume is exact at any batch (the position the client sends), since the order
is computed whole at plan time. A shard whose data ends early (truncated)
keeps its complete samples; those whose members run past the end fail with
"truncated shard". A shard that cannot be read (missing object, not a tar)
counts as one failed sample, its samples being unknown. Failures count against
the stream's failure budget as any bad file does; the pass goes on.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .shardindex import NOT_FOUND, SampleGroups, ShardIndex, unreadable_index
from .tarindex import BadTar, IndexSource, tar_members

__all__ = ["IndexCancelled", "ShardSet", "TooManySamples", "forget_index", "index_shard"]

_INDEX_THREADS = 8
_INDEX_BATCH = 1024  # shards handed to the index threads at a time
_CACHED_SHARDS = 4096


class TooManySamples(Exception):
    """The listed shards hold more samples than a request may (found while indexing)."""

    def __init__(self, limit: int):
        super().__init__(f"the shards hold more than {limit} samples")
        self.limit = limit


class IndexCancelled(Exception):
    """Indexing stopped because its caller no longer wants it (``cancelled()`` said so)."""


class _IndexCache:
    """Shard indexes by (path, version), least recently used dropped past a bound."""

    def __init__(self, bound: int = _CACHED_SHARDS):
        self._lock = threading.Lock()
        self._bound = bound
        self._indexes: OrderedDict[tuple[str, str], ShardIndex] = OrderedDict()

    def get(self, key: tuple[str, str]) -> ShardIndex | None:
        with self._lock:
            index = self._indexes.get(key)
            if index is not None:
                self._indexes.move_to_end(key)
            return index

    def put(self, key: tuple[str, str], index: ShardIndex) -> None:
        with self._lock:
            self._indexes[key] = index
            while len(self._indexes) > self._bound:
                self._indexes.popitem(last=False)

    def forget(self, key: tuple[str, str]) -> None:
        """A shard found changed: its index is not to be used again, whatever its version
        tag says next (an edit within the mtime's granularity leaves it alike)."""
        with self._lock:
            self._indexes.pop(key, None)


_CACHE = _IndexCache()


def forget_index(path: str, version: str) -> None:
    """Drop a shard's cached index: the shard was found changed since it was made."""
    _CACHE.forget((path, version))


def _never() -> bool:
    return False


class _IndexWork:
    """What indexing a request's shards may still do: the samples left under its limit, and
    whether to go on (its caller's ``cancelled()``, or another shard's thread stopped)."""

    def __init__(self, max_samples: int = sys.maxsize, cancelled: Callable[[], bool] = _never):
        self._lock = threading.Lock()
        self._limit = max_samples
        self._left = max_samples
        self._cancelled = cancelled
        self._stopped = False

    def check(self) -> None:
        """Raise what stops indexing: TooManySamples, IndexCancelled."""
        if self._left < 0:
            raise TooManySamples(self._limit)
        if self._stopped or self._cancelled():
            raise IndexCancelled("indexing the shards was cancelled")

    def charge(self, samples: int) -> None:
        """Count ``samples`` more found (fewer, if negative), then check."""
        with self._lock:
            self._left -= samples
        self.check()

    def stop(self) -> None:
        self._stopped = True


def index_shard(storage, path: str, work: _IndexWork | None = None) -> ShardIndex:
    """The shard's index: from the cache when the shard has not changed, else from its
    headers; its samples counted in ``work`` (which may stop it)."""
    work = work or _IndexWork()
    work.check()
    try:
        version = storage.version(path)
        index = _CACHE.get((path, version))
        if index is None:
            with storage.open_index(path) as source:
                index, charged, lasting = _read_index(source, work)
            if lasting:
                _CACHE.put((path, index.version), index)
            work.charge(index.samples - charged)
            return index
    except FileNotFoundError:
        index = NOT_FOUND
    except OSError as e:
        index = unreadable_index(f"shard unreadable: {e}", _read_error(e))
    work.charge(index.samples)
    return index


def _read_index(source: IndexSource, work: _IndexWork) -> tuple[ShardIndex, int, bool]:
    """The index of an opened shard, how many of its samples ``work`` was charged while
    its headers were read, and whether it lasts as long as the shard's version (not when a
    read failed, which another try may not: it is not kept)."""
    samples = SampleGroups()
    charged = 0
    ended = ""
    try:
        for members in tar_members(source):
            samples.add(members)
            work.charge(samples.samples - charged)
            charged = samples.samples
    except BadTar as e:
        if not samples.members:
            return unreadable_index(f"not a tar shard: {e}"), charged, False
        ended = str(e)
    except OSError as e:
        if not samples.members:
            return unreadable_index(f"shard unreadable: {e}", _read_error(e)), charged, False
        return samples.index(source.size, f"read error: {e}", source.version), charged, False
    return samples.index(source.size, ended, source.version), charged, True


def _read_error(error: OSError) -> type[Exception]:
    """What a shard's samples fail with when reading it failed: a timeout's category is
    its own (``timeout``), any other error's ``unreadable``."""
    return TimeoutError if isinstance(error, TimeoutError) else OSError


class ShardSet:
    """The listed shards' samples, flattened in list order (shard s holds samples
    ``first[s]`` to ``first[s + 1]``)."""

    def __init__(self, paths: list[str], indexes: list[ShardIndex]):
        self.paths = paths
        self.indexes = indexes
        counts = np.asarray([index.samples for index in indexes], np.int64)
        self.first = np.concatenate([[0], np.cumsum(counts)])  # shard s: samples first[s]..
        self.sample_shard = np.repeat(np.arange(len(paths), dtype=np.int32), counts)
        self.has_labels = _first_has_label(indexes)

    @classmethod
    def index(cls, storage, paths: list[str], max_samples: int = sys.maxsize,
              cancelled: Callable[[], bool] = _never) -> ShardSet:
        """Index every shard (in parallel: S3 reads wait on the network).

        Samples are counted as they are found: TooManySamples once the shards hold
        more than ``max_samples``, IndexCancelled once ``cancelled()`` is true (both
        checked between shards and every few thousand headers of one); each thread
        stops at its next check.
        """
        work = _IndexWork(max_samples, cancelled)
        indexes: list[ShardIndex] = []
        with ThreadPoolExecutor(max(1, min(_INDEX_THREADS, len(paths)))) as pool:
            for start in range(0, len(paths), _INDEX_BATCH):  # not a future per shard at once
                futures = [pool.submit(index_shard, storage, path, work)
                           for path in paths[start:start + _INDEX_BATCH]]
                try:
                    indexes += [future.result() for future in futures]
                except BaseException:
                    work.stop()
                    for future in futures:
                        future.cancel()
                    raise
        return cls(paths, indexes)

    @property
    def num_samples(self) -> int:
        return int(self.first[-1])

    @property
    def nbytes(self) -> int:
        arrays = [self.first, self.sample_shard] + [
            a for i in self.indexes for a in (i.image_offset, i.image_size, i.label_offset,
                                               i.label_size, i.failure, i.key_ends)] + [
            a for i in self.indexes for pair in i.others.values() for a in pair]
        return sum(a.nbytes for a in arrays) + sum(len(p) for p in self.paths) + \
            sum(len(i.keys) for i in self.indexes)

    def unreadable(self) -> list[tuple[str, str]]:
        return [(p, i.problem) for p, i in zip(self.paths, self.indexes) if i.problem]

    def shard_end(self, sample: int) -> int:
        """The index after the last sample of the sample's shard."""
        return int(self.first[int(self.sample_shard[sample]) + 1])


def _first_has_label(indexes: list[ShardIndex]) -> bool:
    for index in indexes:
        if not index.problem and len(index.label_offset):
            return bool(index.label_offset[0] >= 0)
    return False


