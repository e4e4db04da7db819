"""Names of tar shards: whether a request names shards, and brace patterns expanded.

``train-{0000..0146}.tar`` names 147 shards; ``{x,y}`` lists. A pattern is
bounded before its names are made (``TooManyShards``), since a short request
can name a billion shards. Every shard's path is confined to the data roots.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

from .paths import OutsideDataRoots

__all__ = ["TooManyShards", "expand_braces", "locate_shards", "names_shards"]

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


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


def names_shards(names: Sequence[str]) -> bool:
    """Whether a request's names are tar shards; ValueError when shards and loose files mix."""
    shards = [n.endswith(".tar") or "{" in n for n in names]
    if any(shards) and not all(shards):
        loose = names[shards.index(False)]
        raise ValueError(f"samples: {names[shards.index(True)]!r} is a tar shard but {loose!r} "
                         f"is not; a stream reads shards or loose files, not both")
    return bool(shards) and all(shards)


def locate_shards(names: Sequence[str], prefix: str, storage, limit: int = sys.maxsize
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
