"""Counting delivered images and what they cost, the same way for every row.

A ``Meter`` sees every batch a trainer receives. The first ``warmup`` batches
start the clock (process start-up, worker spawn and import time are not
throughput); images/s and CPU are taken over the batches after them.

CPU is the CPU time of this process and all of its descendants (decode
threads, DataLoader workers, the gpufeed server, the tf.data service), read
from /proc. That counts everything a row spends, wherever it runs, and
nothing another program on the machine spends.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from dataclasses import asdict, dataclass

__all__ = ["Meter", "Result", "tree_cpu_seconds"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class Result:
    """One row of the table; ``images`` counts every image delivered, warm-up included."""

    name: str
    images: int
    expected: int
    measured_images: int
    seconds: float
    cpu_seconds: float
    note: str = ""

    @property
    def images_per_second(self) -> float:
        return self.measured_images / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_per_1000(self) -> float:
        return 1000 * self.cpu_seconds / self.measured_images if self.measured_images else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "images_per_second": self.images_per_second,
                "cpu_seconds_per_1000": self.cpu_per_1000}


class Meter:
    """``meter.batch(n)`` after each batch; ``meter.result(...)`` at the end."""

    def __init__(self, name: str, expected: int, *, warmup: int = 3, log=None):
        self.name = name
        self.expected = expected
        self.warmup = warmup
        self.images = 0
        self._batches = 0
        self._start: tuple[float, float, int] | None = None
        self._end: tuple[float, float, int] | None = None
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._next_report = 0.0

    def batch(self, size: int) -> None:
        self.images += size
        self._batches += 1
        now = time.perf_counter()
        if self._batches == self.warmup:
            self._start = (now, tree_cpu_seconds(), self.images)
            self._next_report = now + 1.0
        elif self._start and now >= self._next_report:
            self._next_report = now + 1.0
            t0, _, n0 = self._start
            self._log(f"    {self.name}: {self.images}/{self.expected} images, "
                      f"{(self.images - n0) / (now - t0):.0f} img/s")

    def stop(self) -> None:
        """Read the clock before the loader shuts down (workers exiting is not throughput)."""
        if self._end is None:
            self._end = (time.perf_counter(), tree_cpu_seconds(), self.images)

    def window(self, start: tuple[float, float, int], end: tuple[float, float, int]) -> None:
        """Set the measured window directly, as (time, CPU s, images) at its start and end.

        For rows whose batches arrive in other processes (several trainers): they
        decide the window themselves and count ``images`` as batches arrive.
        """
        self._start, self._end = start, end

    def result(self, note: str = "") -> Result:
        self.stop()
        if self._start is None:  # fewer batches than the warm-up: time nothing
            return Result(self.name, self.images, self.expected, 0, 0.0, 0.0, note)
        (t0, c0, n0), (t1, c1, n1) = self._start, self._end
        return Result(self.name, self.images, self.expected, n1 - n0, t1 - t0, c1 - c0, note)


def tree_cpu_seconds(root: int | None = None) -> float:
    """User + system CPU seconds of ``root`` (default: this process) and its descendants."""
    root = os.getpid() if root is None else root
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read().decode()
        except OSError:
            continue  # gone meanwhile
        fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "
        # fields[1] is ppid; fields[11], fields[12] are utime, stime (stat fields 14, 15).
        stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total


def write_report(report: dict, out: Path, name: str, latest: str) -> Path:
    """``report`` as ``out/<name>-<time>.json`` and as ``out/<latest>``; the first's path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    text = json.dumps(report, indent=1)
    path.write_text(text)
    (out / latest).write_text(text)
    return path
