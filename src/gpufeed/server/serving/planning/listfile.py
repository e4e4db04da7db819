"""A list file's bytes as sample names (and labels): one pass of numpy over the whole file.

The rules (docs/guide/data-sources.md, "List files"): one sample per line; blank lines skipped,
each line stripped (Python's ``str.strip``), lines broken where
``str.splitlines`` breaks them (so CRLF files read the same); the file is
UTF-8, refused when it is not. With labels, a line is ``path<TAB>label`` when
the first line holds a TAB, else the label is the last whitespace-separated
word (``path label``, Caffe's and mmcls's); the path keeps its inner spaces,
not the whitespace before the label. A line without an integer label is
refused naming its number (counting non-blank lines). Without labels, a list
whose first line is a labelled one is refused: every sample would be missing.

``parse_reference`` is those rules as they were first written, a line at a
time in Python: 5-7 s of CPU for ImageNet's 1.28M lines, with 100+ MB of
short-lived objects the allocator keeps. ``parse_list`` tries ``_parse_fast``
first, which finds line ends, separators and labels over the whole file with
numpy (about a second for the same file), and gives up (returns None) on
anything it does not decide exactly: a file that is not valid UTF-8, non-ASCII
whitespace, a line without a label, a label that is not ``[+-]digits`` of at
most 18 digits, more lines than the limit, a run of more than ``_MAX_RUN``
spaces at a line's edge. The reference then decides, and words the refusal
(tests/test_shared_lists.py checks that the two agree on random and hostile
lists). So a well-formed list is read fast, and a bad one gets the same
refusal it always got.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from ...media.samples import is_sample_file
from .names import SampleNames, TooManyNames
from .thread import PlanStopped

__all__ = ["ListFileError", "parse_list", "parse_reference"]

_LIST_CHUNK = 1 << 20  # bytes of a list file the reference decodes at a time
# Where str.splitlines breaks a line, and what str.isspace (so strip and split) calls
# whitespace, among ASCII bytes.
_BREAKS = b"\n\r\x0b\x0c\x1c\x1d\x1e"
_SPACES = _BREAKS + b"\t \x1f"
# The non-ASCII characters either treats so (U+0085, U+00A0, U+1680, U+2000-U+200A,
# U+2028, U+2029, U+202F, U+205F, U+3000), UTF-8 encoded: a file holding one is left to
# the reference.
_WIDE_SPACES = tuple(chr(c).encode() for c in (0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                                               0x2028, 0x2029, 0x202F, 0x205F, 0x3000))
_SPACE = np.zeros(256, np.bool_)
_SPACE[list(_SPACES)] = True
_MAX_RUN = 64  # spaces stripped from a line's edge one vectorised step at a time
_MAX_DIGITS = 18  # any such label fits an int64


class ListFileError(Exception):
    """A list file that cannot serve the request. ``message(list_file)`` words the refusal
    for a request that named the file ``list_file`` (a shared parse serves requests that
    may spell it differently); ``limit``: over ``--max-samples``, not malformed."""

    def __init__(self, before: str, after: str | None = None, limit: bool = False):
        super().__init__(before if after is None else f"{before}<list file>{after}")
        self.before, self.after, self.limit = before, after, limit

    def message(self, list_file: str) -> str:
        return self.before if self.after is None else f"{self.before}{list_file!r}{self.after}"


def parse_list(data: bytes, labelled: bool, max_samples: int,
               stopped: Callable[[], bool] = lambda: False
               ) -> tuple[SampleNames, np.ndarray | None]:
    """A list file's names, packed, and its labels (int64) when ``labelled``, else None.

    ListFileError for a list that breaks the rules or has more than ``max_samples``
    lines; PlanStopped once ``stopped()``, checked between the steps.
    """
    parsed = _parse_fast(data, labelled, max_samples, stopped)
    if parsed is None:
        return parse_reference(data, labelled, max_samples, stopped)
    return parsed


def parse_reference(data: bytes, labelled: bool, max_samples: int,
                    stopped: Callable[[], bool] = lambda: False
                    ) -> tuple[SampleNames, np.ndarray | None]:
    """``parse_list`` a line at a time: the rules as first written, and the refusals'
    words. At most ``max_samples`` (and a chunk) of lines are worked on."""
    lines = _checked(_list_lines(data), stopped)
    try:
        if not labelled:
            return SampleNames.pack(_unlabelled(lines), limit=max_samples), None
        labels = array("q")
        names = SampleNames.pack(_split_labels(lines, labels), limit=max_samples)
    except TooManyNames:
        raise ListFileError(f"samples: more than {max_samples} samples, over the server's "
                            f"--max-samples {max_samples}", limit=True) from None
    except UnicodeDecodeError as e:
        raise ListFileError("list_file: cannot read ", f": {e}") from None
    return names, np.frombuffer(labels, np.int64) if labels else np.zeros(0, np.int64)


def _checked(lines: Iterator[str], stopped: Callable[[], bool]) -> Iterator[str]:
    for number, line in enumerate(lines):
        if number % 65536 == 0 and stopped():
            raise PlanStopped("the call ended while its list file was read")
        yield line


def _list_lines(data: bytes) -> Iterator[str]:
    """The non-blank lines of a list file, stripped, decoded a chunk at a time: no
    list of every line is ever made."""
    start = 0
    while start < len(data):
        end = data.find(b"\n", start + _LIST_CHUNK)
        end = len(data) if end < 0 else end + 1
        for line in data[start:end].decode("utf-8").splitlines():
            if line := line.strip():
                yield line
        start = end


def _split_labels(lines: Iterable[str], labels: array) -> Iterator[str]:
    """The paths of labelled lines; their labels are appended to ``labels``.

    A line is a path and an integer label. If the first line has a TAB, every
    line is ``path<TAB>label``; otherwise the label is the last whitespace-separated
    word and the path what comes before it (Caffe's and mmcls's ``path label``):
    ``my file.jpg 3`` is ``my file.jpg``, 3. Paths may hold spaces either way; the
    whitespace between path and label is not the path's. Deciding once, from the
    first line, keeps a line ``frame 12`` of a TAB file an error (a path with no
    label) instead of a path ``frame`` labelled 12.
    """
    tabs = None
    for number, line in enumerate(lines, 1):
        if tabs is None:
            tabs = "\t" in line
        split = _split_line(line, tabs)
        try:
            if split is None:
                raise ValueError
            labels.append(split[1])
        except (ValueError, OverflowError):
            form = "path<TAB>integer label" if tabs else "path, whitespace, integer label"
            raise ListFileError(f"list_file: line {number} is not `{form}`: {line!r}") from None
        yield split[0]


def _split_line(line: str, tabs: bool) -> tuple[str, int] | None:
    """(path, label) of a stripped list-file line (``_split_labels``'s rule); None when it
    has no integer label after a path."""
    if tabs:
        name, _, label = line.rpartition("\t")
    else:
        words = line.rsplit(None, 1)
        name, label = words if len(words) == 2 else ("", line)
    name = name.rstrip()
    if not name:
        return None
    try:
        return name, int(label)
    except ValueError:
        return None


def _unlabelled(lines: Iterator[str]) -> Iterator[str]:
    """A list file's lines as paths, for a request that did not ask for its labels."""
    first = next(lines, None)
    if first is None:
        return
    _check_unlabelled(first)
    yield first
    yield from lines


def _check_unlabelled(first: str) -> None:
    """Refuse a list read as paths whose first line is a labelled one (``_split_labels``'s),
    as every sample would then fail to be found: a TAB and an integer at its end, or a
    sample file's name (an image, video or array suffix), whitespace and an integer."""
    labelled = _split_line(first, tabs="\t" in first)
    if labelled is not None and ("\t" in first or is_sample_file(labelled[0])):
        raise ListFileError("list_file: ", f" has labels (its first line, {first!r}, is a path "
                            f"and the label {labelled[1]}): pass labels=\"list_file\" to use "
                            f"them (label_source LABELS_FROM_LIST_FILE), or list paths only")


def _parse_fast(data: bytes, labelled: bool, max_samples: int, stopped: Callable[[], bool]
                ) -> tuple[SampleNames, np.ndarray | None] | None:
    """``parse_reference``'s answer for a list it can decide over the whole file at once,
    or None (the module docstring says when).

    One scratch array of the file's size is the only full-size temporary (the
    page faults of fresh memory cost as much as the work): it holds where a byte
    is a line break, then a separator, then which bytes are names'. Whitespace at
    a line's edges is found by looking at the edges alone.
    """
    if not data.isascii():
        if any(space in data for space in _WIDE_SPACES):
            return None
        try:
            data.decode("utf-8")  # only checked: UTF-8 bytes are the names' own
        except UnicodeDecodeError:
            return None
    _check(stopped)
    raw = np.frombuffer(data, np.uint8)
    scratch = [np.empty(len(raw), np.bool_)]  # _packed takes it out, to free it early
    breaks = _positions(raw, _BREAKS, data, scratch[0])
    starts = np.concatenate(([0], breaks + 1))
    stops = np.concatenate((breaks, [len(raw)]))
    del breaks
    if not (_strip_leading(raw, starts, stops) and _strip_trailing(raw, starts, stops)):
        return None
    lines = np.flatnonzero(stops > starts)
    if len(lines) > max_samples:
        return None  # the reference refuses it, after at most that many lines
    starts, stops = starts[lines], stops[lines]
    del lines
    if not len(starts):
        return SampleNames(b"", np.zeros(0, np.int64)), (np.zeros(0, np.int64) if labelled
                                                          else None)
    first = data[starts[0]:stops[0]].decode("utf-8")
    _check(stopped)
    if not labelled:
        _check_unlabelled(first)
        return _packed(raw, starts, stops, scratch), None
    tabs = "\t" in first
    seps = _positions(raw, b"\t" if tabs else b"\t \x1f", data, scratch[0])
    split = _split_fast(raw, seps, starts, stops, tabs)
    if split is None:
        return None
    ends, labels = split
    _check(stopped)
    return _packed(raw, starts, ends, scratch), labels


def _check(stopped: Callable[[], bool]) -> None:
    if stopped():
        raise PlanStopped("the call ended while its list file was read")


def _positions(raw: np.ndarray, chars: bytes, data: bytes, scratch: np.ndarray) -> np.ndarray:
    """Where any of ``chars`` is in the file, in order (``scratch``: a bool array of its
    size to compare into)."""
    found = []
    for char in chars:
        if bytes([char]) in data:  # a C scan, no array: most of them are absent
            np.equal(raw, char, out=scratch)
            found.append(np.flatnonzero(scratch))
    if len(found) == 1:
        return found[0]
    return np.sort(np.concatenate(found)) if found else np.zeros(0, np.int64)


def _strip_leading(raw: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> bool:
    """Move each line's start past its leading whitespace (in place); False past
    ``_MAX_RUN`` steps."""
    moving = np.flatnonzero(starts < stops)
    for _ in range(_MAX_RUN):
        moving = moving[_SPACE[raw[starts[moving]]]]
        if not len(moving):
            return True
        starts[moving] += 1
        moving = moving[starts[moving] < stops[moving]]
    return False


def _strip_trailing(raw: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> bool:
    """Move each line's end before its trailing whitespace (in place); as above."""
    moving = np.flatnonzero(starts < stops)
    for _ in range(_MAX_RUN):
        moving = moving[_SPACE[raw[stops[moving] - 1]]]
        if not len(moving):
            return True
        stops[moving] -= 1
        moving = moving[starts[moving] < stops[moving]]
    return False


def _split_fast(raw: np.ndarray, seps: np.ndarray, starts: np.ndarray, stops: np.ndarray,
                tabs: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """(each name's end, the labels) of stripped lines by ``_split_line``'s rule, given
    the positions of the separators (TABs, or whitespace inside a line); None where a
    line has no label the fast path can read."""
    last = np.searchsorted(seps, stops) - 1  # each line's last separator, if in the line
    if (last < 0).any():
        return None
    sep = seps[last]
    del last
    if (sep < starts).any():
        return None  # a line without a separator: no label
    ends = sep.copy()
    begin = sep + 1
    if not _strip_trailing(raw, starts, ends) or (ends <= starts).any():
        return None  # the whitespace before the label is not the name's; no name is no label
    if tabs:  # int() skips spaces after the TAB (a space file's label is one word)
        moving = np.flatnonzero(raw[begin] == ord(" "))
        for _ in range(_MAX_RUN):
            if not len(moving):
                break
            begin[moving] += 1
            moving = moving[begin[moving] < stops[moving]]
            moving = moving[raw[begin[moving]] == ord(" ")]
        else:
            return None
    labels = _integers(raw, begin, stops)
    return None if labels is None else (ends, labels)


def _integers(raw: np.ndarray, begin: np.ndarray, end: np.ndarray) -> np.ndarray | None:
    """The integers ``[+-]?[0-9]{1,18}`` at ``raw[begin:end]`` of each line; None if any
    field is not one."""
    if (begin >= end).any():
        return None
    sign = raw[begin]
    negative = sign == ord("-")
    begin = begin + (negative | (sign == ord("+")))
    digits = end - begin
    if digits.min() < 1 or digits.max() > _MAX_DIGITS:
        return None
    values = np.zeros(len(begin), np.int64)
    for k in range(int(digits.max())):
        live = np.flatnonzero(digits > k)
        digit = raw[begin[live] + k].astype(np.int64) - ord("0")
        if ((digit < 0) | (digit > 9)).any():
            return None
        values[live] = values[live] * 10 + digit
    np.negative(values, out=values, where=negative)
    return values


def _packed(raw: np.ndarray, starts: np.ndarray, stops: np.ndarray, scratch: list[np.ndarray]
            ) -> SampleNames:
    """The names at ``raw[starts[i]:stops[i]]``, packed: a mask over the file's bytes
    (made in the one ``scratch`` array, taken from the list so that it goes before the
    blob is copied out: +1 where a name starts, -1 where one stops, summed) keeps the
    names' bytes and drops the rest in one pass."""
    edges = scratch.pop().view(np.int8)
    edges.fill(0)
    edges[starts] = 1
    edges[stops[stops < len(edges)]] = -1  # lines are apart: no name stops where one starts
    np.cumsum(edges, dtype=np.int8, out=edges)
    kept = raw[edges.view(np.bool_)]
    del edges
    return SampleNames(kept.tobytes(), np.cumsum(stops - starts))
