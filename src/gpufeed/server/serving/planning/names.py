"""A stream's sample names, packed: one bytes blob and an array of where each name ends.

A plan of millions of samples kept as a Python list of ``str`` costs ~60 bytes
of object header and a pointer per name on top of its characters, all in small
allocations the interpreter keeps: six sequential 2M-sample streams left a
server ~1.8 GB larger with nothing alive. Packed, a name costs its UTF-8 bytes
plus 8, in two large allocations that go back to the system when the stream
ends. Names are decoded one at a time, when a decode thread reads the sample.

What planning asks of every name (is each a sample file, of which kind, is
each a tar shard) depends on its suffix alone, and a list of millions of names
has a handful of suffixes: ``by_suffix`` finds each name's suffix over the
whole blob with numpy, once per sequence (kept: a sequence never changes, and
a shared list's serves every stream planned on it), and asks the question once
per distinct suffix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import TypeVar

import numpy as np

__all__ = ["SampleNames", "TooManyNames"]

_CHUNK = 1 << 16  # names encoded (and decoded, when iterating) per step
# Suffixes up to this many bytes are told apart in one 8-byte key (the length first);
# a name with a longer one is asked about alone.
_SUFFIX_BYTES = 7
_LONG = 0xFF  # the key's length byte of a longer suffix
_DOT, _SLASH = ord("."), ord("/")

Answer = TypeVar("Answer")


class TooManyNames(Exception):
    """More names than the caller's limit; packing stopped there."""


class SampleNames(Sequence[str]):
    """An immutable sequence of names in ``len(blob) + 8 * len(names)`` bytes."""

    def __init__(self, blob: bytes, ends: np.ndarray):
        self._blob = blob
        self._ends = ends
        # by_suffix's (each name's suffix number, a name of each number, names with a long
        # suffix), made when first asked.
        self._suffixes: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def pack(cls, names: Iterable[str], limit: int | None = None) -> SampleNames:
        """Pack ``names`` (any iterable, consumed once, a chunk at a time).

        Raises TooManyNames as soon as there are more than ``limit``, so an
        oversized list costs at most ``limit`` names' work.
        """
        names = iter(names)
        chunks: list[bytes] = []
        lengths: list[np.ndarray] = []
        count = 0
        while chunk := [name.encode(errors="surrogateescape") for name in islice(names, _CHUNK)]:
            count += len(chunk)
            if limit is not None and count > limit:
                raise TooManyNames(f"more than {limit} names")
            chunks.append(b"".join(chunk))
            lengths.append(np.fromiter(map(len, chunk), np.int64, len(chunk)))
        ends = np.cumsum(np.concatenate(lengths)) if lengths else np.zeros(0, np.int64)
        return cls(b"".join(chunks), ends)

    @property
    def nbytes(self) -> int:
        """The blob and the ends, and the suffix numbers once ``by_suffix`` has made them."""
        suffixes = 0 if self._suffixes is None else self._suffixes[0].nbytes
        return len(self._blob) + self._ends.nbytes + suffixes

    @property
    def longest(self) -> int:
        """The most UTF-8 bytes a name has (0 for none): one numpy pass, no name decoded."""
        if not len(self._ends):
            return 0
        return int(np.diff(self._ends, prepend=0).max())

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> str:
        if not -len(self) <= index < len(self):
            raise IndexError(f"name {index} of {len(self)}")
        index %= len(self)
        start = int(self._ends[index - 1]) if index else 0
        return self._blob[start:int(self._ends[index])].decode(errors="surrogateescape")

    def contains(self, part: str) -> bool:
        """Whether ``part`` occurs in a name (or across two: a cheap, conservative test)."""
        return self._blob.find(part.encode(errors="surrogateescape")) >= 0

    def any_starts_with(self, char: str) -> bool:
        """Whether a name starts with the one-byte ``char``."""
        starts = np.concatenate(([0], self._ends[:-1]))
        starts = starts[starts < self._ends]  # not the empty names
        return bool((np.frombuffer(self._blob, np.uint8)[starts] == ord(char)).any())

    def by_suffix(self, answer: Callable[[str], Answer]) -> tuple[list[Answer], np.ndarray]:
        """(answers, codes): ``answers[codes[i]] == answer(self[i])``, for an ``answer`` that
        depends only on a name's suffix (``posixpath.splitext``'s, before any
        ``lower()``): asked once per distinct suffix, of a name that has it, and once per
        name whose suffix is over ``_SUFFIX_BYTES`` bytes. Every answer is some name's."""
        codes, examples, long = self.suffixes()
        answers = [answer(self[int(i)]) for i in examples]
        if len(long):
            codes = codes.astype(np.int64)
            codes[long] = np.arange(len(answers), len(answers) + len(long))
            answers += [answer(self[int(i)]) for i in long]
        return answers, codes

    def suffixes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(each name's suffix number, the first name of each number, the names whose suffix
        is longer than ``_SUFFIX_BYTES``: they share one number, and are told apart by
        ``by_suffix``). Made once, over the whole blob."""
        if self._suffixes is None:
            self._suffixes = _suffix_numbers(np.frombuffer(self._blob, np.uint8), self._ends)
        return self._suffixes

    def ends_with(self, suffix: str) -> np.ndarray:
        """Whether each name ends with ``suffix`` (bytes compared, as ``str.endswith``)."""
        data = suffix.encode(errors="surrogateescape")
        blob = np.frombuffer(self._blob, np.uint8)
        ends = self._ends
        ok = np.diff(ends, prepend=0) >= len(data)
        for k, byte in enumerate(data):
            at = np.flatnonzero(ok)
            ok[at] = blob[ends[at] - len(data) + k] == byte
        return ok

    def __iter__(self) -> Iterator[str]:
        blob, start = self._blob, 0
        for first in range(0, len(self), _CHUNK):
            for end in self._ends[first:first + _CHUNK].tolist():
                yield blob[start:end].decode(errors="surrogateescape")
                start = end


def _last_before(positions: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """For each end, the last of the sorted ``positions`` before it; -1 when none is."""
    index = np.searchsorted(positions, ends) - 1
    return np.where(index >= 0, positions[np.maximum(index, 0)] if len(positions) else -1, -1)


def _suffix_numbers(blob: np.ndarray, ends: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``SampleNames.suffixes`` of the names ``blob[ends[i - 1]:ends[i]]``.

    ``posixpath.splitext``'s rule in bytes (a dot or a slash is one byte in UTF-8
    and in surrogate escapes alike): a name's suffix runs from the last dot of its
    file name (after its last slash) to its end, if a byte other than a dot comes
    before that dot in the file name (``.bashrc`` has none). Each suffix of up to
    ``_SUFFIX_BYTES`` is packed with its length into one uint64, and the keys
    numbered by ``np.unique``.
    """
    count = len(ends)
    if not count:
        return np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.concatenate(([0], ends[:-1]))
    dots = np.flatnonzero(blob == _DOT)
    dot = _last_before(dots, ends)
    named = np.maximum(_last_before(np.flatnonzero(blob == _SLASH), ends) + 1, starts)
    has = dot >= named  # the dot is in the file name, and a byte before it is not a dot:
    has &= np.searchsorted(dots, dot) - np.searchsorted(dots, named) < dot - named
    length = np.where(has, ends - dot, 0)
    del named, has, dots
    keys = np.zeros((count, 8), np.uint8)
    short = length <= _SUFFIX_BYTES
    keys[:, 0] = np.where(short, length, _LONG)
    for k in range(int(length[short].max(initial=0))):
        live = np.flatnonzero(short & (length > k))
        keys[live, k + 1] = blob[dot[live] + k]
    values, examples, codes = np.unique(keys.view(np.uint64).ravel(), return_index=True,
                                        return_inverse=True)
    long = np.flatnonzero(~short)
    smallest = np.uint8 if len(values) <= 0x100 else np.uint16 if len(values) <= 0x10000 \
        else np.int64
    return codes.astype(smallest), examples, long
