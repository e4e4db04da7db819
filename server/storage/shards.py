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
records the version it read (roots.py: a local file's device, inode, size and
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
bench/README.md), so when a claimed batch needs a sample no chunk holds, one
ranged GET fetches a run of whole samples starting at it: the sample, then the
shard's next samples the stream will read and has not read or fetched, up to
``CHUNK_BYTES`` (4 MiB, chosen by measurement: bench/README.md) and the
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

import enum
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .paths import OutsideDataRoots
from .tarindex import BadTar, IndexSource, Member, tar_members

__all__ = ["TAKEN_SUFFIXES", "IndexCancelled", "SampleProblem", "ShardError", "ShardIndex",
           "ShardSet", "TooManySamples", "TooManyShards", "expand_braces", "forget_index",
           "names_shards"]

_IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm")
_LABEL_SUFFIXES = ("cls", "txt")
_IMAGES, _LABELS = frozenset(_IMAGE_SUFFIXES), frozenset(_LABEL_SUFFIXES)
# Member extensions beyond image and label one shard's index keeps (each 16 bytes per
# sample of every sample): samples carry a handful; a shard of thousands of distinct
# extensions would make its index quadratic. Past the bound an extension is not
# indexed, and a field naming it fails its samples as a missing member does.
_MAX_EXTENSIONS = 32
# Member extensions that are a sample's image or label, so cannot name a field's member.
TAKEN_SUFFIXES = _IMAGE_SUFFIXES + _LABEL_SUFFIXES
_INDEX_THREADS = 8
_INDEX_BATCH = 1024  # shards handed to the index threads at a time
_CACHED_SHARDS = 4096
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")



class SampleProblem(enum.IntEnum):
    """Why a shard's sample fails before any read, kept per sample (``ShardIndex.failure``)."""

    OK = 0
    TRUNCATED = 1  # its members run past the shard's end
    NO_IMAGE = 2
    CUT = 3  # the last sample of an index that stopped early (its members may go on)


_OK, _TRUNCATED, _NO_IMAGE, _CUT = (int(problem) for problem in SampleProblem)


class ShardError(Exception):
    """A shard that is not one (not a tar, headers that break the format): each of its
    samples fails with this, as undecodable data."""


class TooManyShards(ValueError):
    """Brace patterns naming more shards than a request may."""


class TooManySamples(Exception):
    """The listed shards hold more samples than a request may (found while indexing)."""

    def __init__(self, limit: int):
        super().__init__(f"the shards hold more than {limit} samples")
        self.limit = limit


class IndexCancelled(Exception):
    """Indexing stopped because its caller no longer wants it (``cancelled()`` said so)."""


def expand_braces(name: str, limit: int = sys.maxsize) -> list[str]:
    """``a-{00..02}.tar`` -> a-00.tar, a-01.tar, a-02.tar; ``{x,y}`` lists; nested in turn.

    A numeric range keeps the zero padding of its first bound. ValueError for an
    unmatched brace or an empty range; TooManyShards, before the names are made,
    when they would be more than ``limit`` (``{0..999999999}`` is a short request).
    One group at a time from a work list, not recursion, so any number of groups
    expands (each name left to expand stands for at least one name).
    """
    done: list[str] = []
    pending = [name]
    while pending:
        current = pending.pop()
        match = _BRACE.search(current)
        if match is None:
            if "{" in current or "}" in current:
                raise ValueError(f"{name!r}: unmatched brace")
            done.append(current)
            continue
        body = match.group(1)
        numeric = _RANGE.match(body)
        if numeric:
            first, last = int(numeric.group(1)), int(numeric.group(2))
            if last < first:
                raise ValueError(f"{name!r}: the range {{{body}}} is empty")
            count = last - first + 1
        else:
            count = body.count(",") + 1
        if len(done) + len(pending) + count > limit:
            raise TooManyShards(f"{name!r} names more than {limit} shards")
        if numeric:
            width = len(numeric.group(1))
            choices = [str(i).zfill(width) for i in range(first, last + 1)]
        else:
            choices = body.split(",")
        head, tail = current[:match.start()], current[match.end():]
        pending += [head + choice + tail for choice in reversed(choices)]
    return done


def names_shards(names: list[str]) -> bool:
    """Whether a request's names are tar shards; ValueError when shards and loose files mix."""
    shards = [n.endswith(".tar") or "{" in n for n in names]
    if any(shards) and not all(shards):
        loose = names[shards.index(False)]
        raise ValueError(f"samples: {names[shards.index(True)]!r} is a tar shard but {loose!r} "
                         f"is not; a stream reads shards or loose files, not both")
    return bool(shards) and all(shards)


@dataclass(frozen=True)
class ShardIndex:
    """One shard's samples: image and label members as (offset, size), and why any fails.

    ``others``: every other member extension seen (``seg.png``, ``json``) ->
    (offset, -1 when the sample has none; size) per sample, so that a request's
    fields (media/fields.py) find their members without indexing the shard again.
    """

    problem: str  # the shard could not be read at all (its samples are unknown), else ""
    image_offset: np.ndarray
    image_size: np.ndarray
    label_offset: np.ndarray  # -1: no label member
    label_size: np.ndarray
    failure: np.ndarray  # per sample: a SampleProblem
    others: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # What a sample of a shard with a problem fails with (its failure's category).
    problem_error: type[Exception] = ShardError
    # The shard's version the index was made from (roots.py's Storage.version); "" with
    # a problem.
    version: str = ""
    # Why the index stopped before the shard's end ("" when it read to the end).
    ended: str = ""
    # Each sample's key, its members' bytes up to the first dot of the file name, back
    # to back: sample n's ends at key_ends[n] (a sample's name, ``ShardRows.name``).
    keys: bytes = b""
    key_ends: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))

    @property
    def samples(self) -> int:
        return len(self.failure) if not self.problem else 1

    def key(self, n: int) -> str:
        """Sample ``n``'s key, as the tar names it ("" when the shard has no keys: a
        problem); bytes that are not UTF-8 kept as surrogates, as the index reads them."""
        if not 0 <= n < len(self.key_ends):
            return ""
        start = int(self.key_ends[n - 1]) if n else 0
        return self.keys[start:int(self.key_ends[n])].decode("utf-8", "surrogateescape")

    @property
    def longest_key(self) -> int:
        """The most bytes a sample's key has (0 without samples)."""
        if not len(self.key_ends):
            return 0
        return int(np.diff(self.key_ends.astype(np.int64), prepend=0).max())


class _Samples:
    """A shard's members grouped into samples as the index reads them: consecutive members
    sharing a key, each sample's first image and label member, and the first member of
    each other extension (``others``, kept sparse until ``index``)."""

    def __init__(self):
        self.members = 0
        self._image_offset: list[int] = []  # -1: the sample has no image member
        self._image_size: list[int] = []
        self._label_offset: list[int] = []  # -1: no label member
        self._label_size: list[int] = []
        self._others: dict[str, tuple[list[int], list[int], list[int]]] = {}  # samples, ...
        self._key: str | None = None  # the open sample's
        self._seen: set[str] = set()  # its other extensions
        self._keys = bytearray()  # every sample's key, back to back
        self._key_ends: list[int] = []

    @property
    def samples(self) -> int:
        """Samples found so far (the last one may have more members to come)."""
        return len(self._image_offset)

    def add(self, members: list[Member]) -> None:
        images, labels, others, seen = _IMAGES, _LABELS, self._others, self._seen
        for name, offset, size in members:
            folder = name.rfind("/") + 1
            dot = name.find(".", folder)
            key, suffix = (name, "") if dot < 0 else (name[:dot], name[dot + 1:].lower())
            if key != self._key:  # a sample's members are consecutive: the next one
                self._open(key)
            n = len(self._image_offset) - 1  # the sample being read
            if suffix in images:
                if self._image_offset[n] < 0:
                    self._image_offset[n], self._image_size[n] = offset, size
            elif suffix in labels:
                if self._label_offset[n] < 0:
                    self._label_offset[n], self._label_size[n] = offset, size
            elif suffix not in seen:
                seen.add(suffix)
                entry = others.get(suffix)
                if entry is None:
                    if len(others) >= _MAX_EXTENSIONS:
                        continue
                    entry = others[suffix] = ([], [], [])
                entry[0].append(n)
                entry[1].append(offset)
                entry[2].append(size)
        self.members += len(members)

    def _open(self, key: str) -> None:
        self._key = key
        self._seen.clear()
        self._keys += key.encode("utf-8", "surrogateescape")
        self._key_ends.append(len(self._keys))
        self._image_offset.append(-1)
        self._image_size.append(0)
        self._label_offset.append(-1)
        self._label_size.append(0)

    def index(self, size: int, ended: str, version: str) -> ShardIndex:
        """The shard's index, its samples' members ending past ``size`` marked truncated;
        when the headers ended early (``ended`` says why), those without an image too,
        and the last sample cut."""
        truncated = bool(ended)
        image_offset = np.asarray(self._image_offset, np.int64)
        image_size = np.asarray(self._image_size, np.int64)
        label_offset = np.asarray(self._label_offset, np.int64)
        label_size = np.asarray(self._label_size, np.int64)
        has_image = image_offset >= 0
        ends_past = (has_image & (image_offset + image_size > size)) | \
            ((label_offset >= 0) & (label_offset + label_size > size))
        failure = np.where(ends_past | (truncated & ~has_image), _TRUNCATED,
                           np.where(has_image, _OK, _NO_IMAGE)).astype(np.int8)
        if truncated and len(failure) and failure[-1] != _TRUNCATED:
            failure[-1] = _CUT
        image_offset[~has_image] = 0
        count = len(failure)
        others = {}
        for suffix, (samples, offsets, sizes) in self._others.items():
            at, sized = np.full(count, -1, np.int64), np.zeros(count, np.int64)
            at[samples], sized[samples] = offsets, sizes
            others[suffix] = (at, sized)
        ends = np.asarray(self._key_ends, np.uint32 if len(self._keys) < 1 << 32 else np.int64)
        return ShardIndex("", image_offset, image_size, label_offset, label_size, failure,
                          others, version=version, ended=ended, keys=bytes(self._keys),
                          key_ends=ends)


def _unreadable(why: str, error: type[Exception] = ShardError) -> ShardIndex:
    empty = np.zeros(0, np.int64)
    return ShardIndex(why, empty, empty, empty, empty, np.zeros(0, np.int8),
                      problem_error=error)


# Every missing shard's index: one object, not ~2 KB each (a request may name millions).
_NOT_FOUND = _unreadable("shard not found", FileNotFoundError)


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
        index = _NOT_FOUND
    except OSError as e:
        index = _unreadable(f"shard unreadable: {e}", _read_error(e))
    work.charge(index.samples)
    return index


def _read_index(source: IndexSource, work: _IndexWork) -> tuple[ShardIndex, int, bool]:
    """The index of an opened shard, how many of its samples ``work`` was charged while
    its headers were read, and whether it lasts as long as the shard's version (not when a
    read failed, which another try may not: it is not kept)."""
    samples = _Samples()
    charged = 0
    ended = ""
    try:
        for members in tar_members(source):
            samples.add(members)
            work.charge(samples.samples - charged)
            charged = samples.samples
    except BadTar as e:
        if not samples.members:
            return _unreadable(f"not a tar shard: {e}"), charged, False
        ended = str(e)
    except OSError as e:
        if not samples.members:
            return _unreadable(f"shard unreadable: {e}", _read_error(e)), charged, False
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


def locate_shards(names: list[str], prefix: str, storage, limit: int = sys.maxsize
                  ) -> list[str]:
    """Every shard's confined path, braces expanded; at most ``limit`` of them (else
    TooManyShards). OutsideDataRoots / ValueError name the item."""
    paths: list[str] = []
    for i, name in enumerate(names):
        try:
            expanded = expand_braces(prefix + name, limit - len(paths))
        except ValueError as e:  # TooManyShards too, kept as such
            raise type(e)(f"samples[{i}]: {e}") from None
        if len(paths) + len(expanded) > limit:  # a name without braces, past the limit
            raise TooManyShards(f"samples[{i}]: the request names more than {limit} shards")
        for shard in expanded:
            try:
                paths.append(storage.locate(shard))
            except OutsideDataRoots as e:
                raise OutsideDataRoots(f"samples[{i}]: {e}") from None
    return paths
