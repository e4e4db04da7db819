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
(offsets and sizes; a local shard is read header by header, an S3 object in one
sequential GET) and the index is kept, keyed by the shard's version, for later
requests. A sample is then (shard, offset, size): rows still decode in
parallel on the decode pool, each reading just its own members, never
extracting anything to disk. ``index`` is a sample's position among all
samples of the listed shards, in list order.

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
or a round trip per member; the former is chosen. A local shard is indexed
header by header, seeking over the data. It happens once per shard version per
server process (the cache above), for every listed shard, other ranks' too: the
padding rule and ``index`` need every shard's sample count. The metrics count
it apart (``gpufeed_storage_index_bytes``), beside the samples' reads.

The order of a pass (shards dealt to ranks whole, a shuffle buffer within a
rank's stream, padding to the longest rank) is serving/order.py's ``tar_order``,
over ``ShardSet.first``. The plan holds 8 bytes of order, about 40 bytes of
index per sample (16 more per member extension beyond image and label, which a
request's fields may name) and a byte for which samples the stream reads
(chunks.py), plus each shard's path.

Resume is exact at any batch (the position the client sends), since the order
is computed whole at plan time. A shard whose data ends early (truncated)
keeps its complete samples; those whose members run past the end fail with
"truncated shard". A shard that cannot be read (missing object, not a tar)
counts as one failed sample, its samples being unknown. Failures count against
the stream's failure budget as any bad file does; the pass goes on.
"""

from __future__ import annotations

import itertools
import posixpath
import re
import sys
import tarfile
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from typing import Any

import numpy as np

from ..media.decode import DecodeError
from ..media.fields import SampleFields
from ..media.output import OutputTransform
from ..media.samples import Decoders, RowReader, timed_read
from .chunks import ChunkReads
from .paths import OutsideDataRoots, SamplePaths
from .roots import Storage, is_s3
from .shardfiles import ShardFiles

__all__ = ["TAKEN_SUFFIXES", "ShardIndex", "ShardRows", "ShardSet",
           "TooManyShards", "expand_braces", "names_shards"]

_IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm")
_LABEL_SUFFIXES = ("cls", "txt")
# Member extensions that are a sample's image or label, so cannot name a field's member.
TAKEN_SUFFIXES = _IMAGE_SUFFIXES + _LABEL_SUFFIXES
_LABEL_MAX_BYTES = 64
_INDEX_THREADS = 8
_INDEX_BATCH = 1024  # shards handed to the index threads at a time
_CACHED_SHARDS = 4096
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")

_NONE = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # an extension no sample has
# Why a sample fails before any read (kept per sample as a small code).
_OK, _TRUNCATED, _NO_IMAGE, _UNREADABLE = 0, 1, 2, 3


class TooManyShards(ValueError):
    """Brace patterns naming more shards than a request may."""


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
    failure: np.ndarray  # per sample: _OK, _TRUNCATED, _NO_IMAGE
    others: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # What a sample of a shard with a problem fails with (its failure's category).
    problem_error: type[Exception] = DecodeError

    @property
    def samples(self) -> int:
        return len(self.failure) if not self.problem else 1


def _index_members(members: list[tarfile.TarInfo], size: int, truncated: bool) -> ShardIndex:
    """Group members by key, in order; mark samples whose members end past ``size``."""
    image_offset, image_size, label_offset, label_size, failure = [], [], [], [], []
    others: dict[str, tuple[list[int], list[int]]] = {}
    for n, (_, group) in enumerate(itertools.groupby((m for m in members if m.isfile()),
                                                     key=_key)):
        image = label = None
        for member in group:
            suffix = _suffix(member.name)
            if image is None and suffix in _IMAGE_SUFFIXES:
                image = member
            elif label is None and suffix in _LABEL_SUFFIXES:
                label = member
            elif suffix not in _IMAGE_SUFFIXES and suffix not in _LABEL_SUFFIXES:
                offsets, sizes = others.setdefault(suffix, ([-1] * n, [0] * n))
                if len(offsets) == n:  # the sample's first member of that extension
                    offsets.append(member.offset_data)
                    sizes.append(member.size)
        for offsets, sizes in others.values():  # extensions this sample lacks
            if len(offsets) == n:
                offsets.append(-1)
                sizes.append(0)
        used = [m for m in (image, label) if m is not None]
        ends_past = any(m.offset_data + m.size > size for m in used)
        image_offset.append(image.offset_data if image else 0)
        image_size.append(image.size if image else 0)
        label_offset.append(label.offset_data if label else -1)
        label_size.append(label.size if label else 0)
        failure.append(_TRUNCATED if ends_past or (truncated and image is None)
                       else _NO_IMAGE if image is None else _OK)
    return ShardIndex("", np.asarray(image_offset, np.int64), np.asarray(image_size, np.int64),
                      np.asarray(label_offset, np.int64), np.asarray(label_size, np.int64),
                      np.asarray(failure, np.int8),
                      {suffix: (np.asarray(offsets, np.int64), np.asarray(sizes, np.int64))
                       for suffix, (offsets, sizes) in others.items()})


def _key(member: tarfile.TarInfo) -> str:
    folder, name = posixpath.split(member.name)
    return posixpath.join(folder, name.split(".", 1)[0])


def _suffix(name: str) -> str:
    return posixpath.basename(name).split(".", 1)[-1].lower() if "." in name else ""


def _unreadable(why: str, error: type[Exception] = DecodeError) -> ShardIndex:
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


_CACHE = _IndexCache()


def index_shard(storage, path: str) -> ShardIndex:
    """The shard's index: from the cache when the shard has not changed, else from its headers."""
    try:
        version = storage.version(path)
        cached = _CACHE.get((path, version))
        if cached is not None:
            return cached
        file, size = storage.open_sequential(path)
    except FileNotFoundError:
        return _NOT_FOUND
    except OSError as e:
        return _unreadable(f"shard unreadable: {e}", OSError)
    with file:
        members, truncated = [], False
        seekable = getattr(file, "seekable", lambda: False)()
        try:
            # Locally: header after header, seeking over the data. S3: one sequential read.
            with tarfile.open(fileobj=file, mode="r:" if seekable else "r|") as tar:
                while (member := tar.next()) is not None:
                    members.append(member)
        except tarfile.ReadError as e:
            if not members:
                return _unreadable(f"not a tar shard: {e}")
            truncated = True
        except (OSError, EOFError) as e:
            if not members:
                return _unreadable(f"shard unreadable: {e}", OSError)
            truncated = True
    index = _index_members(members, size, truncated)
    _CACHE.put((path, version), index)
    return index


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
    def index(cls, storage, paths: list[str]) -> ShardSet:
        """Index every shard (in parallel: S3 reads wait on the network)."""
        indexes: list[ShardIndex] = []
        with ThreadPoolExecutor(min(_INDEX_THREADS, len(paths))) as pool:
            for start in range(0, len(paths), _INDEX_BATCH):  # not a future per shard at once
                indexes += pool.map(lambda p: index_shard(storage, p),
                                    paths[start:start + _INDEX_BATCH])
        return cls(paths, indexes)

    @property
    def num_samples(self) -> int:
        return int(self.first[-1])

    @property
    def nbytes(self) -> int:
        arrays = [self.first, self.sample_shard] + [
            a for i in self.indexes for a in (i.image_offset, i.image_size, i.label_offset,
                                               i.label_size, i.failure)] + [
            a for i in self.indexes for pair in i.others.values() for a in pair]
        return sum(a.nbytes for a in arrays) + sum(len(p) for p in self.paths)

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


class _SamplePaths:
    """``plan.paths[index]``: the shard a sample lives in (for logs and failure reports)."""

    def __init__(self, shards: ShardSet):
        self._shards = shards

    def __getitem__(self, sample: int) -> str:
        return self._shards.paths[int(self._shards.sample_shard[sample])]

    def __len__(self) -> int:
        return self._shards.num_samples

    @property
    def nbytes(self) -> int:
        """The index a plan keeps (counted against the server's memory budget), and a byte
        per sample: which ones the stream reads (chunks.py)."""
        return self._shards.nbytes + self._shards.num_samples


class ShardRows(RowReader):
    """Reads a shard sample's image member (and label, and fields) into its row of a batch.

    A field (media/fields.py) is the member whose extension is its suffix without
    the dot (``.seg.png`` -> ``000123.seg.png``); a sample without it fails.
    """

    def __init__(self, transform: OutputTransform, shards: ShardSet,
                 fields: SampleFields | None = None):
        self.transform = transform
        self.shards = shards
        self.fields = fields
        self._suffixes = {} if fields is None else {
            name: sidecar.suffix[1:].lower() for name, sidecar in fields.sidecars.items()}
        self.paths = _SamplePaths(shards)
        self._s3 = np.asarray([is_s3(path) for path in shards.paths], bool)  # per shard
        # S3 samples' reads issued ahead, in chunks of whole samples (chunks.py)
        self._chunks = ChunkReads(shards.num_samples, self._span, shards.shard_end)
        self._files = ShardFiles()  # local shards, open while the stream reads them

    def will_read(self, samples: np.ndarray) -> None:
        """The samples the stream reads (positions of its batches, padded ones included):
        a chunk runs over those only."""
        self._chunks.will_read(samples % max(self.shards.num_samples, 1))

    def read_ahead(self, storage: Storage, samples: np.ndarray, paths: SamplePaths
                   ) -> None:
        """Issue the reads of a batch's samples now, when the storage reads ahead (S3)."""
        if storage.read_ahead is None:
            return
        s3 = self._s3[self.shards.sample_shard[samples]]
        if s3.any():
            self._chunks.issue(storage, samples[s3].tolist())

    def forget(self, storage: Storage) -> None:
        """The stream ended: reads issued for rows nobody will decode give their bytes back,
        and its local shards are closed."""
        self._chunks.forget(storage)
        self._files.close()

    def _span(self, sample: int) -> tuple[str, int, int] | None:
        """(shard, offset, size) of the bytes holding a sample's members; None if it fails."""
        try:
            _, path, _, start, end = self._members(sample)
        except (DecodeError, OSError):  # what a shard's problem or a sample's fails with
            return None
        return path, start, end - start

    def _members(self, sample: int) -> tuple[int, str, list[tuple[int, int]], int, int]:
        """(shard number, path, [(offset, size)] of the image, label and fields' members, in
        that order, and the [start, end) they span); raises what the sample fails with when
        it fails without a read."""
        shard = int(self.shards.sample_shard[sample])
        shard_index = self.shards.indexes[shard]
        if shard_index.problem:
            raise shard_index.problem_error(shard_index.problem)
        n = sample - int(self.shards.first[shard])
        failure = shard_index.failure[n]
        if failure == _TRUNCATED:
            raise DecodeError(f"truncated shard (sample {n} runs past its end)")
        if failure == _NO_IMAGE:
            raise DecodeError(f"sample {n} has no image member")
        image = int(shard_index.image_offset[n])
        members = [(image, int(shard_index.image_size[n]))]
        if self.shards.has_labels:
            label = int(shard_index.label_offset[n])
            if label < 0:
                raise DecodeError(f"sample {n} has no .cls/.txt label member")
            members.append((label, int(shard_index.label_size[n])))
        for name, suffix in self._suffixes.items():
            offsets, sizes = shard_index.others.get(suffix, _NONE)
            if n >= len(offsets) or offsets[n] < 0:
                raise DecodeError(f"{name}: sample {n} has no .{suffix} member")
            members.append((int(offsets[n]), int(sizes[n])))
        if len(members) == 1:
            return shard, self.shards.paths[shard], members, image, image + members[0][1]
        return shard, self.shards.paths[shard], members, \
            min(offset for offset, _ in members), max(offset + size for offset, size in members)

    def read_into(self, storage: Storage, path: str, index: int, arrays: dict[str, np.ndarray],
                  row: int, decoders: Decoders, stages: Mapping[str, Any]) -> None:
        crop, flip = self.transform.choose(index)
        shard, path, members, start, end = self._members(index)
        if self._s3[shard]:
            data, read = timed_read(stages, partial(
                self._chunks.take, storage, index,
                partial(storage.read_range, path, start, end - start)))
        else:  # one pread on the stream's open descriptor of the shard
            data, read = timed_read(stages, partial(self._files.read, storage, shard, path,
                                                    start, end - start))
        if len(data) < end - start:
            n = index - int(self.shards.first[shard])
            raise DecodeError(f"truncated shard (sample {n} runs past its end)")
        if self.shards.has_labels:
            at, size = members[1][0] - start, members[1][1]
            arrays["label"][row] = _label(index - int(self.shards.first[shard]),
                                          bytes(data[at:at + size]))
        at, size = members[0][0] - start, members[0][1]
        image = arrays.get("decoded", arrays["image"])[row]
        try:  # the decoder flips, as for loose images
            window = decoders.image.decode_into(bytes(data[at:at + size]), image, crop, flip)
            if self.fields is not None:
                sidecars = members[len(members) - len(self._suffixes):]
                files = {name: bytes(data[offset - start:offset - start + size])
                         for name, (offset, size) in zip(self._suffixes, sidecars)}
                sample = self.fields.convert(files, image, window, flip, decoders.max_pixels)
                self.fields.write(sample, arrays, row)
        finally:
            stages["decode"].observe(perf_counter() - read)


def _label(n: int, text: bytes) -> int:
    if len(text) > _LABEL_MAX_BYTES:
        raise DecodeError(f"sample {n}'s label member is {len(text)} bytes, not an int")
    try:
        return int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise DecodeError(f"sample {n}'s label {text[:20]!r} is not an integer") from None


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
        for shard in expanded:
            try:
                paths.append(storage.locate(shard))
            except OutsideDataRoots as e:
                raise OutsideDataRoots(f"samples[{i}]: {e}") from None
    return paths
