"""Counting delivered images and what they cost, the same way for every row.

A ``Meter`` sees every batch a trainer receives. The clock starts at the last
of the ``warmup`` batches and stops at the last batch received: that window is
the steady state, and images/s and CPU are taken over the batches inside it.
What comes before (process start-up, imports, spawning workers or a server,
the first batches) and after (the iterator noticing the end of the sequence,
workers and servers shutting down) is not throughput; it is reported apart,
as ``startup_seconds`` and ``teardown_seconds``. TensorFlow, for one, can
stall for seconds at the end of a sequence: timed up to the iterator's end, a
tf.data row of 4000 images read a third slower than its own progress lines.

While the clock runs the meter logs a progress line about once a second (the
images/s since the clock started, from the same clock and the same start as
the final figure), so a result that looks wrong can be checked against the
row's own history; the lines are kept in the result too.

The trainer's own CPU (this process alone, ``time.process_time``) is taken
over the same window and reported per batch: what a training step pays to
receive its batch, apart from what the loader spends elsewhere.

CPU is the CPU time of this process and all of its descendants (decode
threads, DataLoader workers, the gpufeed server, the tf.data service), read
from /proc at the window's two ends. That counts everything a row spends,
wherever it runs, and nothing another program on the machine spends.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

__all__ = ["Meter", "Result", "TreeCpu", "descendants", "proc_status", "tree_cpu_seconds",
           "tree_usage", "write_report"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class Result:
    """One row of the table; ``images`` counts every image delivered, warm-up included.

    ``seconds`` and ``cpu_seconds`` are the steady-state window's; ``startup_seconds``
    runs from the row's start to its first batch, ``teardown_seconds`` from its last
    batch to the row's end, of which ``end_of_sequence_seconds`` until the loader said
    it had no more. ``progress`` holds the progress lines as (seconds, images, images/s).
    """

    name: str
    images: int
    expected: int
    measured_images: int
    seconds: float
    cpu_seconds: float
    note: str = ""
    startup_seconds: float | None = None
    end_of_sequence_seconds: float | None = None
    teardown_seconds: float | None = None
    progress: list[tuple[float, int, float]] = field(default_factory=list)
    measured_batches: int = 0
    trainer_cpu_seconds: float | None = None  # this process alone, over the window

    @property
    def trainer_cpu_ms_per_batch(self) -> float | None:
        if self.trainer_cpu_seconds is None or not self.measured_batches:
            return None
        return 1000 * self.trainer_cpu_seconds / self.measured_batches

    @property
    def images_per_second(self) -> float:
        return self.measured_images / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_per_1000(self) -> float:
        return 1000 * self.cpu_seconds / self.measured_images if self.measured_images else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "images_per_second": self.images_per_second,
                "cpu_seconds_per_1000": self.cpu_per_1000,
                "trainer_cpu_ms_per_batch": self.trainer_cpu_ms_per_batch}


class Meter:
    """``meter.batch(n)`` after each batch, ``meter.stop()`` when the loader is exhausted,
    ``meter.result(...)`` when the row has shut everything down.

    Times are ``time.monotonic()`` (CLOCK_MONOTONIC), comparable with the stamps
    trainer processes print.
    """

    def __init__(self, name: str, expected: int, *, warmup: int = 3, log=None):
        self.name = name
        self.expected = expected
        self.warmup = max(1, warmup)  # the clock starts at a batch, never before the first
        self.images = 0
        self._batches = 0
        self._born = time.monotonic()
        self._cpu = TreeCpu()
        self._first: float | None = None
        self._start: tuple[float, float, int] | None = None  # (time, CPU s, images)
        self._last: tuple[float, float, int] | None = None
        self._own: tuple[tuple[float, int], tuple[float, int]] | None = None  # (CPU s, batch)
        self._exhausted: float | None = None
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._next_report = 0.0
        self._progress: list[tuple[float, int, float]] = []

    def batch(self, size: int) -> None:
        now = time.monotonic()
        self.images += size
        self._batches += 1
        if self._first is None:
            self._first = now
        if self._batches < self.warmup:
            return
        point = (now, self._cpu(), self.images)
        own = (time.process_time(), self._batches)
        if self._batches == self.warmup:
            self._start = self._last = point
            self._own = (own, own)
            self._next_report = now + 1.0
            return
        self._last = point
        self._own = (self._own[0], own)
        if now >= self._next_report:
            self._next_report = now + 1.0
            seconds, images = now - self._start[0], self.images - self._start[2]
            rate = images / seconds
            self._progress.append((round(seconds, 3), images, round(rate, 1)))
            self._log(f"    {self.name}: {self.images}/{self.expected} images, "
                      f"{rate:.0f} img/s over {seconds:.1f} s")

    def stop(self) -> None:
        """The loader is exhausted: the end of its sequence has been noticed."""
        if self._exhausted is None:
            self._exhausted = time.monotonic()

    def window(self, start: tuple[float, float, int], end: tuple[float, float, int]) -> None:
        """Set the measured window directly, as (monotonic time, CPU s, images) at its ends.

        For rows whose batches arrive in other processes (several trainers): they
        decide the window themselves and count ``images`` as batches arrive.
        """
        self._start, self._last = start, end
        self._own = None  # the batches arrived elsewhere
        self._first = self._first or start[0]

    def result(self, note: str = "") -> Result:
        finished = time.monotonic()
        self.stop()
        if self._start is None or self._last is None:  # fewer batches than the warm-up
            return Result(self.name, self.images, self.expected, 0, 0.0, 0.0, note)
        (t0, c0, n0), (t1, c1, n1) = self._start, self._last
        if self._progress or n1 > n0:
            self._log(f"    {self.name}: steady state {n1 - n0} images in {t1 - t0:.2f} s, "
                      f"{(n1 - n0) / (t1 - t0) if t1 > t0 else 0:.0f} img/s")
        own = {}
        if self._own is not None:
            (cpu0, batch0), (cpu1, batch1) = self._own
            own = dict(measured_batches=batch1 - batch0, trainer_cpu_seconds=cpu1 - cpu0)
        return Result(self.name, self.images, self.expected, n1 - n0, t1 - t0, c1 - c0, note,
                      startup_seconds=self._first - self._born,
                      end_of_sequence_seconds=max(0.0, self._exhausted - t1),
                      teardown_seconds=max(0.0, finished - t1),
                      progress=self._progress, **own)


class TreeCpu:
    """User + system CPU seconds of a process tree, cheap enough to read at every batch.

    Walking all of /proc costs milliseconds on a busy host, so the tree's members
    are found again at most once per ``rescan`` seconds, and each call reads
    only their own stat files. A member that has exited keeps the CPU it had
    when last read (its parent's "children" counters are not read, so nothing
    is counted twice).
    """

    def __init__(self, root: int | None = None, rescan: float = 1.0):
        self.root = os.getpid() if root is None else root
        self.rescan = rescan
        self._members: list[int] = []
        self._found = float("-inf")
        self._seconds: dict[int, float] = {}  # pid -> CPU s when last read

    def __call__(self) -> float:
        now = time.monotonic()
        if now - self._found >= self.rescan:
            self._members, self._found = list(_tree(self.root)), now
        for pid in self._members:
            stat = _stat(pid)
            if stat is not None:
                self._seconds[pid] = stat.cpu
        return sum(self._seconds.values())


def tree_cpu_seconds(root: int | None = None) -> float:
    """User + system CPU seconds of ``root`` (default: this process) and its descendants."""
    return sum(u.cpu for u in _tree(os.getpid() if root is None else root).values())


def tree_usage(root: int) -> tuple[float, float, int]:
    """User and system CPU seconds and minor page faults of ``root`` and its descendants."""
    usage = _tree(root).values()
    return (sum(u.user for u in usage), sum(u.system for u in usage),
            sum(u.faults for u in usage))


class _Usage(NamedTuple):
    """One process's line of /proc/<pid>/stat, the fields these measurements use."""

    parent: int
    user: float  # CPU seconds
    system: float
    faults: int  # minor page faults

    @property
    def cpu(self) -> float:
        return self.user + self.system


def descendants(root: int) -> list[int]:
    """``root`` and its live descendants (one walk of /proc)."""
    return list(_tree(root))


_STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssShmem", "RssFile", "Threads")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssShmem, RssFile (kB) and Threads from /proc/<pid>/status."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _STATUS_FIELDS:
                out[key] = int(value.split()[0])
    return out


def _tree(root: int) -> dict[int, _Usage]:
    """``root`` and each of its descendants, by pid (one walk of /proc)."""
    stats: dict[int, _Usage] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                stats[int(entry)] = stat
    children: dict[int, list[int]] = {}
    for pid, stat in stats.items():
        children.setdefault(stat.parent, []).append(pid)
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            found[pid] = stats[pid]
        todo.extend(children.get(pid, ()))
    return found


def _stat(pid: int) -> _Usage | None:
    """``pid``'s usage, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "
    # fields[1] is ppid, fields[7] minflt, fields[11], fields[12] utime, stime
    # (stat fields 4, 10, 14, 15).
    return _Usage(int(fields[1]), int(fields[11]) / _TICKS, int(fields[12]) / _TICKS,
                  int(fields[7]))


def write_report(report: dict, out: Path, name: str, latest: str) -> Path:
    """``report`` as ``out/<name>-<time>.json`` and as ``out/<latest>``; the first's path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    text = json.dumps(report, indent=1)
    path.write_text(text)
    (out / latest).write_text(text)
    return path
