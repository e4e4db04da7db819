"""Lists shared by every stream on a server: a list file parsed, or a directory tree
listed, once per version, however many streams read it.

Eight ranks of one job name the same list, each for an eighth of it. Each stream
used to parse the whole list itself (seconds of CPU each, one after another
under the GIL) and keep its own copy of every name and label. Here a list is
read once and kept read-only (the packed names, the labels; a tree's class
folders), and each stream's plan holds only its own order (plan.py).

**Which version.** A list file is known by its path and what ``stat`` says of
it (device, inode, size, mtime and ctime, in nanoseconds); an S3 object by its
size and ETag. A directory tree by its path, and checked, each time it is
asked for, against the device, inode, mtime and ctime of every directory it
listed: adding, removing or renaming an entry changes its directory's mtime,
so a changed tree is found by a stat per directory, not by listing it again.
A list whose version differs from the kept one is read afresh; the old one is
dropped as soon as no stream holds it.

**Too fresh to trust.** A file system's timestamps are as coarse as its clock's
tick (milliseconds; a second or two on some), so a list changed twice within
one tick could look unchanged. A list file, or a listed directory, whose
mtime and ctime both lie within ``hot_seconds`` (2 s) of when it is read is
served to that stream alone, not kept: a change after that moves one of them
(``utime`` can set the mtime back, never the ctime).

**One read for many.** Streams that ask for a list being read wait for that
read (single flight) instead of reading it again. The read stops (PlanStopped)
once every stream waiting for it has stopped (its call ended); a waiting
stream that stops leaves the others waiting. A refusal (a malformed list, a
limit) goes to every waiting stream, worded for each (listfile.py).

**Lifetime and memory.** A stream holds a list from its plan until it ends
(``Hold.release``). Once no stream holds it, a list is kept ``idle_seconds``
(60 s, so a job's next epoch or a restarted rank finds it) and then dropped.
What a kept list holds counts once against the server's memory budget
(``--max-memory-bytes``): reserved when it is read, given back when it is
dropped; a stream's own plan counts only its own part. A reservation that
does not fit drops the unused lists first (``reclaim``).
"""

from __future__ import annotations

import copy
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...config import Limits
from ...memory.budget import MemoryBudget, return_free_memory
from ...storage.roots import Storage
from ...storage.s3 import is_s3
from .folders import ListedTree, list_tree
from .listfile import parse_list
from .names import SampleNames
from .thread import PlanStopped

__all__ = ["IDLE_SECONDS", "Hold", "ParsedList", "SharedLists"]

# Seconds an unused list is kept after the last stream holding it ended.
IDLE_SECONDS = 60.0
# A list changed this recently (mtime and ctime both) is not kept: see the module doc.
_HOT_SECONDS = 2.0
# Seconds between a waiting stream's looks at whether its call has ended.
_WAIT_STEP = 0.05
_NS = 1_000_000_000

# Whether a kept value still is what is on disk.
_Current = Callable[[], bool]
# Reading a list for the streams waiting (given whether all of them stopped): the value,
# and its _Current, or None when it is not to be kept.
_Read = Callable[[Callable[[], bool]], tuple[Any, "_Current | None"]]


@dataclass(frozen=True, eq=False)
class ParsedList:
    """A list file's names, packed, and its labels (None when not asked for)."""

    names: SampleNames
    labels: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return self.names.nbytes + (0 if self.labels is None else self.labels.nbytes)


class Hold:
    """A stream's hold on a list (``value``: a ParsedList or a ListedTree): shared, or
    read for this stream alone (``shared`` False). ``release()`` once the stream is
    done with it; more calls do nothing."""

    def __init__(self, value: Any, owner: SharedLists | None = None,
                 entry: _Entry | None = None):
        self.value = value
        self._owner, self._entry = owner, entry
        self._lock = threading.Lock()

    @property
    def shared(self) -> bool:
        return self._entry is not None

    def release(self) -> None:
        with self._lock:
            owner, entry, self._owner, self._entry = self._owner, self._entry, None, None
        if owner is not None and entry is not None:
            owner._release(entry)


class _Entry:
    """A kept list: its value, the bytes it reserved, the streams holding it."""

    def __init__(self, key: tuple, value: Any, nbytes: int, current: _Current):
        self.key, self.value, self.nbytes, self.current = key, value, nbytes, current
        self.users = 0
        self.stale = False  # a newer version is on disk: dropped when unused, not kept idle
        self.timer: threading.Timer | None = None


class _Flight:
    """A list being read for the streams waiting for it."""

    def __init__(self):
        self.waiting: list[Callable[[], bool]] = []  # each stream's stopped()
        self.done = False
        self.entry: _Entry | None = None
        self.error: BaseException | None = None  # else, with no entry: ask again

    def stopped(self) -> bool:
        """Whether every stream waiting for the read has stopped."""
        return all(stopped() for stopped in list(self.waiting))


class SharedLists:
    """The server's kept lists (the module docstring). ``budget``: the memory budget they
    count against; ``parsed(kind)``: told of each list file parsed (``"list_file"``)
    or tree listed (``"directory"``), for the metrics. Thread-safe."""

    def __init__(self, budget: MemoryBudget | None = None, idle_seconds: float = IDLE_SECONDS,
                 parsed: Callable[[str], None] = lambda kind: None,
                 hot_seconds: float = _HOT_SECONDS):
        self._budget = budget
        self.idle_seconds = idle_seconds
        self._parsed = parsed
        self._hot_ns = int(hot_seconds * _NS)
        self._cond = threading.Condition()
        self._entries: dict[tuple, _Entry] = {}
        self._latest: dict[tuple, tuple] = {}  # a list file's (path, reading): its newest key
        self._flights: dict[tuple, _Flight] = {}
        self._unlisted: set[_Entry] = set()  # stale entries still held, out of _entries
        self._closed = False

    # -- what planning asks for ------------------------------------------------

    def list_file(self, storage: Storage, path: str, labelled: bool, limits: Limits,
                  stopped: Callable[[], bool] = lambda: False) -> Hold:
        """The list file at the located ``path``, parsed (a ParsedList); OSError kinds as
        ``Storage.read`` raises them, ListFileError, MemoryExhausted, PlanStopped."""
        reading = (path, labelled, limits.max_samples, limits.max_list_bytes)

        def parse(stopped: Callable[[], bool]) -> ParsedList:
            try:
                data = storage.read(path, limits.max_list_bytes, "--max-list-bytes")
                self._parsed("list_file")
                return ParsedList(*parse_list(data, labelled, limits.max_samples, stopped))
            finally:
                data = None
                return_free_memory()  # the file's bytes and the parse's working arrays

        version = self._file_version(storage, path)
        if version is None:
            return Hold(parse(stopped))
        key = ("list_file", *reading, version)
        with self._cond:
            older = self._latest.get(reading)
            self._latest[reading] = key
            if older is not None and older != key and older in self._entries:
                self._retire(self._entries[older])

        def read(stopped: Callable[[], bool]) -> tuple[ParsedList, _Current | None]:
            parsed = parse(stopped)
            if self._file_version(storage, path) != version:
                return parsed, None  # changed while it was read
            parsed.names.suffixes()  # planning asks each stream; made once, counted here
            return parsed, _always  # its key names its version

        return self._hold(key, read, stopped)

    def tree(self, storage: Storage, directory: str, name: str, limit: int,
             stopped: Callable[[], bool] = lambda: False) -> Hold | None:
        """The sample files under a located local ``directory`` (folders.py's
        ``list_tree``: a ListedTree); None for an S3 one, which has no directories to
        check (the caller lists it itself). Raises as ``list_tree`` does."""
        if is_s3(directory):
            return None
        key = ("directory", directory, limit)

        def read(stopped: Callable[[], bool]) -> tuple[ListedTree, _Current | None]:
            self._parsed("directory")
            began = time.time_ns()
            tree = list_tree(directory, name, storage, limit, stopped)
            return_free_memory()  # the listing's strings, packed now
            # Stat'ed after the walk: a directory changed since it began is too fresh to keep.
            versions = _directory_versions(tree.directories)
            if versions is None or any(self._hot(mtime, ctime, began)
                                       for _, _, mtime, ctime in versions):
                return tree, None
            tree.paths.suffixes()
            return tree, lambda: _directory_versions(tree.directories) == versions

        return self._hold(key, read, stopped)

    # -- upkeep ------------------------------------------------------------------

    def reclaim(self) -> int:
        """Drop every list no stream holds; the bytes given back (the budget's hook)."""
        with self._cond:
            unused = [entry for entry in self._entries.values() if entry.users == 0]
            freed = sum(self._drop(entry) for entry in unused)
        if freed:
            return_free_memory()
        return freed

    def held(self) -> tuple[int, int]:
        """(lists kept, the bytes they count), held or idle."""
        with self._cond:
            entries = [*self._entries.values(), *self._unlisted]
            return len(entries), sum(entry.nbytes for entry in entries)

    def waiting(self) -> int:
        """Streams waiting for lists being read, their readers included."""
        with self._cond:
            return sum(len(flight.waiting) for flight in self._flights.values())

    def close(self) -> None:
        """Cancel the idle timers (kept lists go with the server)."""
        with self._cond:
            self._closed = True
            for entry in [*self._entries.values(), *self._unlisted]:
                if entry.timer is not None:
                    entry.timer.cancel()

    # -- one read for many -------------------------------------------------------

    def _hold(self, key: tuple, read: _Read, stopped: Callable[[], bool]) -> Hold:
        """A hold on the entry for ``key``: kept and current, or read by this stream (the
        leader) for every stream that asks meanwhile, or by another for this one.

        ``read(stopped)`` returns the value and how to tell later that it is still
        what is on disk, or None when it is not to be kept (a private hold).
        """
        while True:
            if stopped():
                raise PlanStopped("the call ended while its list was read")
            with self._cond:
                entry = self._entries.get(key)
                if entry is not None:
                    self._use(entry)
                    flight = None
                else:
                    flight = self._flights.get(key)
                    leader = flight is None
                    if flight is None:
                        flight = self._flights[key] = _Flight()
                    flight.waiting.append(stopped)
            if entry is not None:
                if entry.current():  # outside the lock: a tree's is a stat per directory
                    return Hold(entry.value, self, entry)
                with self._cond:
                    self._retire(entry)
                self._release(entry)
                continue
            assert flight is not None
            if leader:
                return self._lead(key, flight, read)
            hold = self._follow(flight, stopped)
            if hold is not None:
                return hold

    def _lead(self, key: tuple, flight: _Flight, read: _Read) -> Hold:
        entry = None
        try:
            value, current = read(flight.stopped)
            if current is not None:
                nbytes = value.nbytes
                if self._budget is not None:
                    self._budget.reserve(nbytes, f"a shared list of {len(_names(value))} "
                                                 f"samples")
                entry = _Entry(key, value, nbytes, current)
        except PlanStopped:
            self._land(key, flight, None, None)  # every stream waiting has stopped
            raise
        except BaseException as e:
            self._land(key, flight, None, e)
            raise
        if entry is None:  # not to be kept: the others read it again
            self._land(key, flight, None, None)
            return Hold(value)
        self._land(key, flight, entry, None)
        return Hold(value, self, entry)

    def _land(self, key: tuple, flight: _Flight, entry: _Entry | None,
              error: BaseException | None) -> None:
        """End a read: keep its entry, held by the leader and every stream still waiting."""
        with self._cond:
            del self._flights[key]
            if entry is not None:
                entry.users = len(flight.waiting)
                self._entries[key] = entry
                if key[0] == "list_file" and self._latest.get(key[1:-1]) != key:
                    self._retire(entry)  # a newer version was asked for meanwhile
            else:
                self._forget_latest(key)
            flight.entry, flight.error, flight.done = entry, error, True
            self._cond.notify_all()

    def _follow(self, flight: _Flight, stopped: Callable[[], bool]) -> Hold | None:
        """Wait for another stream's read: a hold on what it kept, its error, or None to ask
        again (it stopped, or the list changed while it was read)."""
        with self._cond:
            while not flight.done:
                if stopped():
                    flight.waiting.remove(stopped)
                    raise PlanStopped("the call ended while its list was read for it")
                self._cond.wait(_WAIT_STEP)
        if flight.entry is not None:  # counted for this stream when the read landed
            return Hold(flight.entry.value, self, flight.entry)
        if flight.error is not None:
            raise _copied(flight.error) from None  # each stream its own exception
        return None  # the caller asks again (and stops first if its call has ended)

    # -- lifetime ------------------------------------------------------------------

    def _use(self, entry: _Entry) -> None:
        entry.users += 1
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    def _release(self, entry: _Entry) -> None:
        freed = 0
        with self._cond:
            entry.users -= 1
            if entry.users > 0:
                return
            if entry.stale or self._closed:
                freed = self._drop(entry)
            elif self.idle_seconds <= 0:
                freed = self._drop(entry)
            else:
                entry.timer = threading.Timer(self.idle_seconds, self._expire, (entry,))
                entry.timer.daemon = True
                entry.timer.start()
        if freed:
            return_free_memory()

    def _expire(self, entry: _Entry) -> None:
        with self._cond:
            if entry.users or entry.timer is not threading.current_thread():
                return  # held again meanwhile
            freed = self._drop(entry)
        if freed:
            return_free_memory()

    def _retire(self, entry: _Entry) -> None:
        """A newer version exists: nobody new gets ``entry``; dropped once unused."""
        entry.stale = True
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            if entry.users:
                self._unlisted.add(entry)
            else:
                self._drop(entry)

    def _drop(self, entry: _Entry) -> int:
        """Forget ``entry`` and give its bytes back (under the lock); the bytes."""
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        self._unlisted.discard(entry)
        self._forget_latest(entry.key)
        if entry.nbytes and self._budget is not None:
            self._budget.give_back(entry.nbytes)
        freed, entry.nbytes = entry.nbytes, 0
        return freed

    def _forget_latest(self, key: tuple) -> None:
        """A list file's newest version goes with its entry (or its failed read)."""
        if key[0] == "list_file" and self._latest.get(key[1:-1]) == key:
            del self._latest[key[1:-1]]

    # -- versions ------------------------------------------------------------------

    def _file_version(self, storage: Storage, path: str) -> str | None:
        """What a list file is now (a tag that changes when it does), or None when it is
        not to be kept: changed too recently, not a regular file, outside the roots
        (``Storage.read`` then says why)."""
        if is_s3(path):
            return storage.version(path)  # size and ETag
        status = os.stat(path)
        if not stat.S_ISREG(status.st_mode) or self._hot(status.st_mtime_ns,
                                                        status.st_ctime_ns, time.time_ns()):
            return None
        if storage.root_of(os.path.realpath(path)) is None:
            return None
        return (f"{status.st_dev}:{status.st_ino}:{status.st_size}:{status.st_mtime_ns}:"
                f"{status.st_ctime_ns}")

    def _hot(self, mtime_ns: int, ctime_ns: int, now_ns: int) -> bool:
        """Whether mtime and ctime both lie within ``hot_seconds`` of ``now_ns`` (or after)."""
        return now_ns - mtime_ns < self._hot_ns and now_ns - ctime_ns < self._hot_ns


def _directory_versions(directories: list[str]) -> list[tuple[int, int, int, int]] | None:
    """(device, inode, mtime, ctime) of each directory (symlinks followed); None when one
    cannot be stat'ed any more."""
    try:
        return [(s.st_dev, s.st_ino, s.st_mtime_ns, s.st_ctime_ns)
                for s in map(os.stat, directories)]
    except OSError:
        return None


def _always() -> bool:
    return True


def _copied(error: BaseException) -> BaseException:
    """A copy of a read's error for one more stream (its traceback not shared), or the
    error itself where it cannot be copied."""
    try:
        return copy.copy(error)
    except Exception:
        return error


def _names(value: Any) -> SampleNames:
    return value.names if isinstance(value, ParsedList) else value.paths
