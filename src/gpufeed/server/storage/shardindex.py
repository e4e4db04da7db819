"""One tar shard's index: its members grouped into samples, as offsets and sizes.

A sample is the group of consecutive members sharing a key (shards.py gives
the layout); ``SampleGroups`` groups them as the index reads the headers, and
makes the ``ShardIndex``: each sample's image and label member, the first
member of each other extension (for a request's fields), its key, and why a
sample fails before any read (``SampleProblem``). A shard that cannot be read
has an index of no samples that says why.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from .tarindex import Member

__all__ = ["NOT_FOUND", "TAKEN_SUFFIXES", "SampleGroups", "SampleProblem", "ShardError",
           "ShardIndex", "unreadable_index"]

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


class SampleGroups:
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


def unreadable_index(why: str, error: type[Exception] = ShardError) -> ShardIndex:
    empty = np.zeros(0, np.int64)
    return ShardIndex(why, empty, empty, empty, empty, np.zeros(0, np.int8),
                      problem_error=error)


# Every missing shard's index: one object, not ~2 KB each (a request may name millions).
NOT_FOUND = unreadable_index("shard not found", FileNotFoundError)
