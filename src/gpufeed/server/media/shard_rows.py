"""A tar shard's samples read into their rows of a batch (``ShardRows``).

The shards' index (storage/shards.py) says where each sample's members lie;
this reader reads a sample's span (its image, label and declared fields'
members, adjacent in the tar) from the version of the shard its index
describes, locally with one ``pread`` on the stream's open descriptor
(storage/shardfiles.py), from S3 through the stream's chunks of whole samples
(storage/chunks.py), and decodes the image into its row as a loose image is
decoded. A shard found changed since it was indexed fails each of its samples
read after that, without another read, and its cached index is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from time import perf_counter
from typing import Any

import numpy as np

from ..storage.chunks import ChunkReads, Span
from ..storage.paths import SamplePaths
from ..storage.roots import Storage
from ..storage.s3 import is_s3
from ..storage.shardfiles import ShardFiles
from ..storage.shardindex import SampleProblem, ShardError
from ..storage.shards import ShardSet, forget_index
from ..storage.versions import ShardChanged
from .decode import DecodeError
from .fields import SampleFields
from .output import OutputTransform
from .samples import Decoders, RowReader, timed_read

__all__ = ["ShardRows"]

_LABEL_MAX_BYTES = 64


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
        per sample: which ones the stream reads (storage/chunks.py)."""
        return self._shards.nbytes + self._shards.num_samples


_NO_MEMBER = np.zeros(0, np.int64)  # an extension no sample of the shard has


class ShardRows(RowReader):
    """Reads a shard sample's image member (and label, and fields) into its row of a batch.

    A field (media/fields.py) is the member whose extension is its suffix without
    the dot (``.seg.png`` -> ``000123.seg.png``); a sample without it fails.

    Every read names the shard's version its index describes; a shard found changed
    fails each of its samples read after that without another read.
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
        # S3 samples' reads issued ahead, in chunks of whole samples (storage/chunks.py)
        self._chunks = ChunkReads(shards.num_samples, self._span, shards.shard_end)
        self._files = ShardFiles()  # local shards, open while the stream reads them
        self._versions = [index.version for index in shards.indexes]
        self._changed: dict[int, str] = {}  # shard -> how it changed since it was indexed

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

    def name(self, storage: Storage, paths: SamplePaths, index: int) -> str:
        """``shard/key``: the shard as failures name it (relative to its data root, an S3
        URL in full), then the sample's key (WebDataset's ``__key__``); the shard alone
        for a sample without one (a shard that could not be read)."""
        shard = int(self.shards.sample_shard[index])
        key = self.shards.indexes[shard].key(index - int(self.shards.first[shard]))
        shown = storage.shown(self.shards.paths[shard])
        return f"{shown}/{key}" if key else shown

    def longest_name(self, storage: Storage) -> int:
        """The most bytes ``name`` gives any sample: each shard's name, a '/' and its
        longest key (one call per shard, none per sample)."""
        return max((len(storage.shown(path).encode("utf-8", "surrogateescape")) + 1
                    + index.longest_key for path, index in zip(self.shards.paths,
                                                               self.shards.indexes)), default=0)

    def _span(self, sample: int) -> Span | None:
        """(shard, offset, size, version) of the bytes holding a sample's members; None if
        it fails without a read."""
        try:
            shard, path, _, start, end = self._members(sample)
        except (DecodeError, ShardError, OSError):  # what a shard's or a sample's fails with
            return None
        if shard in self._changed:
            return None
        return path, start, end - start, self._versions[shard]

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
        if failure == SampleProblem.TRUNCATED:
            raise DecodeError(f"truncated shard (sample {n} runs past its end)")
        if failure == SampleProblem.CUT:
            raise DecodeError(f"truncated shard (its index stops at sample {n}: "
                              f"{shard_index.ended})")
        if failure == SampleProblem.NO_IMAGE:
            raise DecodeError(f"sample {n} has no image member")
        image = int(shard_index.image_offset[n])
        members = [(image, int(shard_index.image_size[n]))]
        if self.shards.has_labels:
            label = int(shard_index.label_offset[n])
            if label < 0:
                raise DecodeError(f"sample {n} has no .cls/.txt label member")
            members.append((label, int(shard_index.label_size[n])))
        for name, suffix in self._suffixes.items():
            assert self.fields is not None, "_suffixes names fields only when there are some"
            offsets, sizes = shard_index.others.get(suffix, (_NO_MEMBER, _NO_MEMBER))
            if n >= len(offsets) or offsets[n] < 0:
                raise DecodeError(f"{name}: sample {n} has no .{suffix} member")
            self.fields.check_size(name, int(sizes[n]))  # before a byte of it is read
            members.append((int(offsets[n]), int(sizes[n])))
        if len(members) == 1:
            return shard, self.shards.paths[shard], members, image, image + members[0][1]
        return shard, self.shards.paths[shard], members, \
            min(offset for offset, _ in members), max(offset + size for offset, size in members)

    def read_into(self, storage: Storage, path: str, index: int, arrays: dict[str, np.ndarray],
                  row: int, decoders: Decoders, stages: Mapping[str, Any]) -> None:
        crop, flip = self.transform.choose(index)
        shard, path, members, start, end = self._members(index)
        version = self._versions[shard]
        if self._s3[shard]:
            reader = partial(self._chunks.take, storage, index,
                             partial(self._unchanged, shard, storage.read_range, path, start,
                                     end - start, None, version))
        else:  # one pread on the stream's open descriptor of the shard
            reader = partial(self._unchanged, shard, self._files.read, storage, shard, path,
                             start, end - start, version)
        try:
            data, read = timed_read(stages, reader)
        except ShardChanged as e:
            if shard not in self._changed:  # its samples fail from now on, unread
                self._changed[shard] = str(e)
                forget_index(path, version)
            raise
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

    def _unchanged(self, shard: int, read: Callable[..., bytes], *args) -> bytes:
        """``read(*args)``, unless the shard was found changed: ShardChanged again, unread."""
        changed = self._changed.get(shard)
        if changed is not None:
            raise ShardChanged(changed)
        return read(*args)


def _label(n: int, text: bytes) -> int:
    if len(text) > _LABEL_MAX_BYTES:
        raise DecodeError(f"sample {n}'s label member is {len(text)} bytes, not an int")
    try:
        return int(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise DecodeError(f"sample {n}'s label {text[:20]!r} is not an integer") from None
