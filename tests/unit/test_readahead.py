"""The I/O stage's byte budget (src/gpufeed/server/storage/readahead.py), over a fake object store:
bodies are read only within the budget, reads of unknown size included, and every read
gives back the bytes it held. The real-S3 passes are in test_s3.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from gpufeed.server.storage.readahead import ReadAhead, StreamReads
from support import wait_until


class _Store:
    """Objects of given sizes. Counts the bytes of bodies read by the I/O stage and not yet
    taken (what the budget bounds), and the bodies closed unread."""

    def __init__(self, sizes: list[int]):
        self.objects = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
        self._lock = threading.Lock()
        self.in_memory = self.most_in_memory = self.closed_unread = 0
        self._ahead: set[int] = set()  # objects an I/O thread read

    def read(self, i: int) -> bytes:  # the whole read: an I/O thread's, or a decode thread's
        if threading.current_thread().name.startswith("gpufeed-io"):
            self.got(i)
        return self.objects[i]

    def got(self, i: int) -> None:
        with self._lock:
            self._ahead.add(i)
            self.in_memory += len(self.objects[i])
            self.most_in_memory = max(self.most_in_memory, self.in_memory)

    def open(self, i: int) -> tuple[int, _Body]:
        return len(self.objects[i]), _Body(self, i)

    def taken(self, i: int) -> None:
        with self._lock:
            if i in self._ahead:
                self._ahead.remove(i)
                self.in_memory -= len(self.objects[i])


class _Body:
    def __init__(self, store: _Store, i: int):
        self._store, self._i = store, i

    def read(self) -> bytes:
        self._store.got(self._i)
        return self._store.objects[self._i]

    def close(self) -> None:
        with self._store._lock:
            self._store.closed_unread += 1


def _issue(stage: ReadAhead, store: _Store, sized: bool) -> list:
    return [stage.issue(len(data) if sized else None, lambda i=i: store.read(i),
                        None if sized else (lambda i=i: store.open(i)))
            for i, data in enumerate(store.objects)]


def _take_all(stage: ReadAhead, store: _Store, pending: list) -> None:
    """Take every read in order: each one's bytes, the budget kept, nothing left held."""
    for i, read in enumerate(pending):
        assert stage.take(read) == store.objects[i]
        store.taken(i)
    assert store.most_in_memory <= max(stage.budget, *map(len, store.objects))
    assert stage.depth() == (0, 0) and store.in_memory == 0


@contextmanager
def _stage(threads: int, budget: int) -> Iterator[ReadAhead]:
    stage = ReadAhead(threads, budget)
    try:
        yield stage
    finally:
        stage.close()


def test_a_read_of_unknown_size_that_no_longer_fits_goes_back_unread():
    # One I/O thread: the first two (100 B) fit; the third, charged the mean so far
    # (100 B), turns out 900 B and 200 + 900 > 1000: its body is closed unread.
    store = _Store([100, 100, 900, 900, 50, 400])
    with _stage(threads=1, budget=1000) as stage:
        pending = _issue(stage, store, sized=False)
        assert wait_until(lambda: stage.depth() == (4, 200))
        assert store.in_memory == 200 and store.closed_unread == 1
        _take_all(stage, store, pending)


def test_the_budget_bounds_the_bytes_read_ahead_with_many_threads():
    rng = np.random.default_rng(3)
    for sized in (True, False):
        store = _Store(rng.integers(1, 700, 300).tolist())
        with _stage(threads=4, budget=2000) as stage:
            pending = _issue(stage, store, sized)
            assert wait_until(lambda: stage.started > 0)
            _take_all(stage, store, pending)


def test_a_read_larger_than_the_budget_still_starts_alone():
    store = _Store([5000, 10])
    with _stage(threads=2, budget=1000) as stage:
        pending = _issue(stage, store, sized=False)
        assert wait_until(lambda: stage.depth() == (1, 5000))  # the second waits for the first
        _take_all(stage, store, pending)


def test_reads_of_an_ended_stream_give_their_bytes_back():
    store = _Store([300] * 10)
    reads = StreamReads()
    with _stage(threads=2, budget=1000) as stage:
        for i in range(10):
            reads.issue(stage, i, None, lambda i=i: store.read(i), lambda i=i: store.open(i))
        reads.issue(stage, 0, None, lambda: b"", lambda: (0, None))  # a repeat: read once
        assert reads.take(stage, 0, lambda: b"not ahead") == store.objects[0]
        assert reads.take(stage, 0, lambda: b"not ahead") == b"not ahead"
        reads.forget(stage)
        assert wait_until(lambda: stage.depth() == (0, 0))


def test_a_read_with_several_takers_holds_its_bytes_until_the_last_takes_it():
    # A chunk of a shard (chunks.py): one read, a taker per sample it holds.
    store = _Store([800, 300])
    with _stage(threads=2, budget=1000) as stage:
        chunk = stage.issue(800, lambda: store.read(0), takers=3)
        other = stage.issue(300, lambda: store.read(1))
        assert wait_until(lambda: stage.depth() == (1, 800))  # 800 + 300 > 1000: it waits
        assert stage.take(chunk) == store.objects[0]
        assert stage.take(chunk) == store.objects[0]
        assert stage.depth() == (1, 800)  # one taker still to come: the bytes are held
        assert stage.take(chunk) == store.objects[0]
        store.taken(0)
        assert stage.take(other) == store.objects[1]
        store.taken(1)
        assert stage.depth() == (0, 0)


def test_a_read_not_started_is_read_once_by_its_first_taker_for_all():
    reads = []
    with _stage(threads=1, budget=10) as stage:
        blocker = stage.issue(10, lambda: b"x" * 10)  # holds the whole budget, untaken
        assert wait_until(lambda: stage.depth() == (0, 10))
        chunk = stage.issue(50, lambda: reads.append(1) or b"y" * 50, takers=2)
        assert stage.take(chunk) == b"y" * 50  # read here: the I/O stage has no room
        assert stage.take(chunk) == b"y" * 50 and reads == [1]
        stage.take(blocker)
        assert stage.depth() == (0, 0)


def test_a_stream_that_ends_drops_a_read_all_its_takers_would_have_taken():
    with _stage(threads=1, budget=1000) as stage:
        chunk = stage.issue(500, lambda: b"z" * 500, takers=4)
        assert wait_until(lambda: stage.depth() == (0, 500))
        stage.take(chunk)
        stage.drop(chunk)
        assert stage.depth() == (0, 0)
