"""Many ranks opening one ImageNet-sized list together, gpufeed against DataLoader +
DistributedSampler: seconds to every rank's first batch, the server's growth, and the
memory (PSS) of everything that serves the ranks.

Run from the repository root (the data set is built on the first run, ~20 s)::

    .venv/bin/python -m bench.open_scale                               # 8 ranks, both sides
    .venv/bin/python -m bench.open_scale --ranks 1,4,8 --rounds 2      # bench/RESULTS.md's table

Each row is one side at one number of ranks, run alone (one row after another,
never two at once; the 1-minute load average is read before and after each).
Every rank is its own process (``bench.open_scale_rank``, as torchrun would
start it): it imports torch and its loader's modules, then waits at a start
barrier; the rows's clock starts when every rank is released at one moment,
and each rank reports the CLOCK_MONOTONIC time of its first batch. The rank
then takes ``--more`` batches and holds (stream open, workers alive, their
prefetched batches queued, its last batch kept); ``--settle`` seconds after
the last rank holds, the memory is read; then the ranks end.

- gpufeed: a fresh server on the data set (``--threads`` decode threads), one
  small warm-up stream (imports, thread stacks, the decoders), then the ranks
  open ``rank=r, world_size=N, shuffle=True`` loaders on the list file over shm.
  The server's RSS is read after the warm-up, when the memory is read, and its
  peak (VmHWM) in between.
- dataloader: each rank builds torchvision ImageFolder's index of the same
  samples (bench/open_scale_rank.py says how), a DistributedSampler(shuffle)
  and a DataLoader of ``--workers`` persistent workers (prefetch_factor 2)
  doing the same job (random-resized crop + flip to 224, uint8, batch 32).

**Total PSS** is the memory of every process that serves the ranks (gpufeed:
the server and the rank processes; DataLoader: the rank processes and all
their worker processes), with each page shared by several processes split
among them (PSS), and shared memory counted once, whole: the sum over the
processes of ``Pss - Pss_Shmem`` (smaps_rollup: anonymous and file-backed
pages), plus the allocated size of every shared-memory object that any of them
maps or holds open (/dev/shm files, deleted or not, and memfds; found in each
process's ``maps`` and ``fd``, each object once by device and inode). So
gpufeed's slot rings and DataLoader's batches in /dev/shm count whole, whether
a batch is mapped by the rank, by a worker, or only held as a descriptor
waiting to be passed on, and nothing is counted twice.

Before each row the memory its ranks may take is estimated from the side's
last row, and a row whose estimate would take the machine's used memory past
``--max-used-gib`` is skipped; while a row runs, the machine's used memory
(MemTotal - MemAvailable) is read twice a second, and a row that passes it is
stopped, its processes killed, with a message saying so.

1.28M valid paths without 1.28M files: ``pool/`` holds ``--pool`` small JPEGs
and ``train/`` 1000 class folders that are symbolic links to it, so the list's
lines are ``train/n01440764/ILSVRC2012_img_0001.JPEG<TAB>0`` (40 bytes of
path), the label the class's number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .measure import descendants, proc_status

__all__ = ["build", "main", "memory_of"]

_LINES = 1_281_167  # ImageNet-1k's training set
_CLASSES = 1000
_REPO = Path(__file__).resolve().parent.parent
_SIDES = ("gpufeed", "dataloader")
_TARGETS = {"every_first_batch_s": 15.0, "rss_growth_mb": 300.0, "pss_ratio": 0.4}


def build(root: Path, lines: int = _LINES, pool: int = 1300, side: int = 64) -> Path:
    """The data set under ``root`` (reused when its list has ``lines`` lines); its list file."""
    listed = root / f"train-{lines}.flist"
    if listed.exists():
        return listed
    from gpufeed.server.demo import encode_jpeg, synthetic_photo

    (root / "pool").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = [f"ILSVRC2012_img_{i:04d}.JPEG" for i in range(pool)]
    for name in names:
        if not (root / "pool" / name).exists():
            (root / "pool" / name).write_bytes(encode_jpeg(synthetic_photo(rng, side, side)))
    (root / "train").mkdir(exist_ok=True)
    classes = [f"n{1440764 + 7 * c:08d}" for c in range(_CLASSES)]
    for wnid in classes:
        link = root / "train" / wnid
        if not link.is_symlink():
            link.symlink_to("../pool", target_is_directory=True)
    per_class = np.full(_CLASSES, lines // _CLASSES)
    per_class[:lines % _CLASSES] += 1
    if per_class.max() > pool:
        raise SystemExit(f"--pool {pool} is fewer than the {per_class.max()} images a class needs")
    text = "".join(f"train/{wnid}/{names[i]}\t{c}\n" for c, (wnid, count)
                   in enumerate(zip(classes, per_class.tolist())) for i in range(count))
    tmp = listed.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(listed)
    return listed


# -- memory --------------------------------------------------------------------------------

_MB = 1024 * 1024
_RSS_PARTS = ("RssAnon", "RssShmem", "RssFile")
_SHARED = ("/dev/shm/", "/memfd:", "/dev/zero", "/SYSV")  # shmem objects, as maps names them


def _rollup(pid: int) -> dict[str, int]:
    """``Pss`` and ``Pss_Shmem`` of ``pid`` in bytes (smaps_rollup); empty if it is gone."""
    fields = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("Pss", "Pss_Shmem"):
                    fields[name] = int(rest.split()[0]) * 1024
    except OSError:
        return {}
    return fields


def _shared_objects(pid: int, objects: dict[tuple[int, int], int]) -> None:
    """Add the shared-memory objects ``pid`` maps or holds open to ``objects``:
    (device, inode) -> allocated bytes."""
    def note(path: str) -> None:
        try:
            info = os.stat(path)
        except OSError:
            return  # gone meanwhile
        objects[(info.st_dev, info.st_ino)] = info.st_blocks * 512

    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.readlines()
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for line in maps:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(_SHARED):
            note(f"/proc/{pid}/map_files/{parts[0]}")
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(_SHARED):
            note(f"/proc/{pid}/fd/{fd}")


def memory_of(groups: dict[str, list[int]]) -> dict:
    """The total PSS of the processes in ``groups`` (role -> pids), as the module docstring
    says: per role, its processes' PSS less their shared-memory part; shared memory once."""
    objects: dict[tuple[int, int], int] = {}
    out: dict = {"processes": 0, "pss_sum_mb": 0.0, "roles_mb": {}}
    for role, pids in groups.items():
        private = 0
        for pid in pids:
            fields = _rollup(pid)
            if not fields:
                continue
            out["processes"] += 1
            out["pss_sum_mb"] += fields["Pss"] / _MB
            private += fields["Pss"] - fields.get("Pss_Shmem", 0)
            _shared_objects(pid, objects)
        out["roles_mb"][role] = round(private / _MB, 1)
    out["shm_mb"] = round(sum(objects.values()) / _MB, 1)
    out["shm_objects"] = len(objects)
    out["pss_sum_mb"] = round(out["pss_sum_mb"], 1)
    out["total_pss_mb"] = round(sum(out["roles_mb"].values()) + out["shm_mb"], 1)
    return out


def _meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}


def _used_gib() -> float:
    info = _meminfo()
    return (info["MemTotal"] - info["MemAvailable"]) / 2**30


def _load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _running() -> int:
    """Tasks runnable at this moment, this process left out: the
    1-minute load average lags a minute behind, and still counts the last row's."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0]) - 1


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as clear:
        clear.write("5")


# -- a row ---------------------------------------------------------------------------------

class _Stopped(Exception):
    """A row stopped before its end (memory, a rank's error, a deadline): why."""


class _Ranks:
    """The rank processes of a row, each in its own session (its workers with it), and
    what they say, as (rank, word, rest) in one queue."""

    def __init__(self, argvs: list[list[str]], logs: Path):
        self.events: queue.Queue = queue.Queue()
        self.early: dict[str, dict[int, str]] = {}  # what came while _wait waited for another
        self.procs: list[subprocess.Popen] = []
        self.logs = [logs / f"rank{r}.log" for r in range(len(argvs))]
        for r, argv in enumerate(argvs):
            with open(self.logs[r], "w") as log:
                proc = subprocess.Popen([sys.executable, "-m", "bench.open_scale_rank", *argv],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=log, text=True, cwd=_REPO,
                                        start_new_session=True)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(r, proc), daemon=True).start()

    def _read(self, r: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            word, _, rest = line.strip().partition(" ")
            self.events.put((r, word, rest))
        self.events.put((r, "exit", ""))

    def tell(self, line: str) -> None:
        for proc in self.procs:
            try:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass

    def where(self, late: list[int]) -> str:
        """The stacks of the ``late`` ranks (faulthandler, on SIGUSR1, into their logs)."""
        for r in late:
            try:
                self.procs[r].send_signal(signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(1.0)
        return "\n".join(f"rank {r}:\n{self.log_tail(r)}" for r in late)

    def log_tail(self, r: int) -> str:
        try:
            return self.logs[r].read_text()[-4000:]
        except OSError:
            return ""

    def end(self, timeout: float = 60.0) -> None:
        """Let every rank end, then kill whatever of their sessions is left."""
        self.tell("stop")
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the session: the rank and its workers
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()


def _wait(ranks: _Ranks, word: str, count: int, *, began: float | None, limit_gib: float,
          deadline: float, what: str, progress) -> dict[int, str]:
    """Wait until ``count`` ranks have said ``word``: rank -> the rest of its line. Prints
    progress about every 2 s; raises _Stopped on an error, an exit, the memory limit or
    the deadline."""
    got: dict[int, str] = ranks.early.pop(word, {})
    shown = time.monotonic()
    while len(got) < count:
        try:
            r, said, rest = ranks.events.get(timeout=0.5)
        except queue.Empty:
            r, said, rest = -1, "", ""
        if said == word:
            got[r] = rest
            if word == "first":
                progress(f"  rank {r}: first batch after {float(rest) - began:.1f} s")
        elif said not in ("", "error", "exit"):
            ranks.early.setdefault(said, {})[r] = rest  # a fast rank's next word
        elif said in ("error", "exit"):
            raise _Stopped(f"rank {r} {'failed: ' + rest if said == 'error' else 'ended'}"
                           f"\n{ranks.log_tail(r)}")
        used = _used_gib()
        if used > limit_gib:
            raise _Stopped(f"the machine's used memory reached {used:.1f} GiB, past the "
                           f"{limit_gib:g} GiB limit (--max-used-gib), {what}: the row is "
                           f"stopped and its processes killed; rerun with fewer ranks or "
                           f"workers")
        now = time.monotonic()
        if now > deadline:
            late = [r for r in range(count) if r not in got]
            raise _Stopped(f"{len(got)}/{count} ranks {what} after the row's time limit "
                           f"(--timeout); where the late ones were:\n{ranks.where(late)}")
        if now - shown >= 2.0:
            shown = now
            since = f", {now - began:.1f} s since the start" if began is not None else ""
            progress(f"  ... {len(got)}/{count} ranks {what}{since}; the machine uses "
                     f"{used:.1f} GiB")
    return got


def _row(side: str, ranks: int, args, list_file: Path, progress) -> dict:
    row: dict = {"side": side, "ranks": ranks, "lines": args.lines, "status": "ok",
                 "load_before": _load(), "running_before": _running(),
                 "used_gib_before": round(_used_gib(), 2)}
    shmem_before = _meminfo()["Shmem"]
    server = None
    rank_argv = ["--world-size", str(ranks), "--more", str(args.more)]
    if side == "gpufeed":
        server = _server(args)
        rank_argv += ["--address", server.address, "--list-file", list_file.name]
    else:
        rank_argv += ["--root", str((args.root / "train").resolve()), "--lines",
                      str(args.lines), "--workers", str(args.workers)]
    limit = args.max_used_gib
    try:
        with tempfile.TemporaryDirectory(prefix="open-scale-") as logs:
            team = _Ranks([[side, "--rank", str(r), *rank_argv] for r in range(ranks)],
                          Path(logs))
            try:
                deadline = time.monotonic() + args.timeout
                _wait(team, "ready", ranks, began=None, limit_gib=limit, deadline=deadline,
                      what="ready (imports)", progress=progress)
                if server is not None:
                    before = proc_status(server.proc.pid)
                    row["rss_before_mb"] = round(before["VmRSS"] / 1024)
                    _reset_peak(server.proc.pid)
                row["load_at_start"] = _load()
                progress(f"{side}, {ranks} ranks: all ready; go (load average "
                         f"{row['load_at_start']:.2f})")
                began = time.monotonic()
                team.tell("go")
                deadline = began + args.timeout
                firsts = _wait(team, "first", ranks, began=began, limit_gib=limit,
                               deadline=deadline, what="have a first batch", progress=progress)
                held = _wait(team, "held", ranks, began=began, limit_gib=limit,
                             deadline=deadline, what="hold their batches", progress=progress)
                settle_end = time.monotonic() + args.settle
                while time.monotonic() < settle_end:  # the prefetch fills; the limit holds
                    time.sleep(0.5)
                    if _used_gib() > limit:
                        raise _Stopped(f"the machine's used memory passed {limit:g} GiB "
                                       f"while the ranks held: the row is stopped")
                groups = {"rank": [p.pid for p in team.procs]}
                workers = [pid for p in team.procs for pid in descendants(p.pid) if pid != p.pid]
                if workers:  # DataLoader's (a gpufeed rank has no children)
                    groups["worker"] = workers
                if server is not None:
                    groups["server"] = descendants(server.proc.pid)
                    after = proc_status(server.proc.pid)
                    row["rss_after_mb"] = round(after["VmRSS"] / 1024)
                    row["rss_peak_mb"] = round(after["VmHWM"] / 1024)
                    # What the growth is: heap (the list, the plans), the slot rings (shm
                    # the server maps and writes count in its RSS), mapped files.
                    row["rss_growth_parts_mb"] = {
                        k: round((after[k] - before[k]) / 1024) for k in _RSS_PARTS}
                row["memory"] = memory_of(groups)
                row["used_gib_held"] = round(_used_gib(), 2)
                row["shmem_delta_mb"] = round((_meminfo()["Shmem"] - shmem_before) / _MB, 1)
            finally:
                team.end()
    except _Stopped as e:
        row["status"], row["note"] = "stopped", str(e).splitlines()[0]
        progress(f"{side}, {ranks} ranks: STOPPED: {e}")
        return row
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    seconds = sorted(float(firsts[r]) - began for r in range(ranks))
    row.update(first_batch_s=round(seconds[0], 2), every_first_batch_s=round(seconds[-1], 2),
               firsts_s=[round(float(firsts[r]) - began, 2) for r in range(ranks)],
               all_held_s=round(max(float(h.split()[0]) for h in held.values()) - began, 2),
               batches_per_rank=1 + args.more, load_after=_load())
    if server is not None:
        row["rss_growth_mb"] = row["rss_after_mb"] - row["rss_before_mb"]
        row["peak_growth_mb"] = row["rss_peak_mb"] - row["rss_before_mb"]
    mem = row["memory"]
    growth = ""
    if server is not None:
        parts = ", ".join(f"{k[3:].lower()} +{v}" for k, v in row["rss_growth_parts_mb"].items())
        growth = (f"; server RSS +{row['rss_growth_mb']} MB ({parts}; peak "
                  f"+{row['peak_growth_mb']} MB)")
    progress(f"{side}, {ranks} ranks: first batch {row['first_batch_s']} s, every rank's "
             f"{row['every_first_batch_s']} s{growth}; total PSS {mem['total_pss_mb']:.0f} MB "
             f"({mem['processes']} processes: {_roles(mem)}, shm {mem['shm_mb']:.0f} MB in "
             f"{mem['shm_objects']} objects); load average {row['load_before']:.2f} before, "
             f"{row['load_after']:.2f} after")
    return row


def _roles(mem: dict) -> str:
    return ", ".join(f"{role}s {mb:.0f} MB" for role, mb in mem["roles_mb"].items())


def _server(args):
    from gpufeed.client import FeedClient
    from gpufeed.server.process import ServerProcess

    warm = args.root / "warm.flist"
    if not warm.exists():
        warm.write_text("".join(f"pool/ILSVRC2012_img_{i:04d}.JPEG\t0\n"
                                for i in range(min(64, args.pool))))
    server = ServerProcess(["--data-root", str(args.root), "--threads", str(args.threads)])
    server.start()
    try:
        with FeedClient(server.address) as feed:  # imports, thread stacks, the decoders
            for _ in feed.loader(warm.name, batch_size=min(32, args.pool), size=args.size,
                                 labels="list_file", transport="shm"):
                pass
        time.sleep(1.0)  # the warm-up stream's end settles
    except BaseException:
        server.kill()
        raise
    return server


# -- the table -----------------------------------------------------------------------------

def _median(rows: list[dict], key: str, sub: str | None = None) -> float | None:
    values = [(r[key][sub] if sub else r[key]) for r in rows if r["status"] == "ok"]
    return round(statistics.median(values), 2) if values else None


def summarise(rows: list[dict]) -> list[dict]:
    """Medians over the rounds, per side and number of ranks, and gpufeed ÷ DataLoader."""
    out = []
    for ranks in sorted({r["ranks"] for r in rows}):
        entry: dict = {"ranks": ranks}
        for side in _SIDES:
            mine = [r for r in rows if r["side"] == side and r["ranks"] == ranks]
            if not mine:
                continue
            ok = [r for r in mine if r["status"] == "ok"]
            entry[side] = {
                "rounds": len(ok), "stopped": len(mine) - len(ok),
                "every_first_batch_s": _median(mine, "every_first_batch_s"),
                "every_first_batch_rounds": [r["every_first_batch_s"] for r in ok],
                "first_batch_s": _median(mine, "first_batch_s"),
                "total_pss_mb": _median(mine, "memory", "total_pss_mb"),
                "total_pss_rounds": [r["memory"]["total_pss_mb"] for r in ok],
                "load_before": [r["load_before"] for r in mine],
                "running_before": [r.get("running_before") for r in mine],
            }
            if side == "gpufeed":
                entry[side]["rss_growth_mb"] = _median(mine, "rss_growth_mb")
                entry[side]["peak_growth_mb"] = _median(mine, "peak_growth_mb")
        ours, theirs = entry.get("gpufeed"), entry.get("dataloader")
        if ours and theirs and ours["total_pss_mb"] and theirs["total_pss_mb"]:
            entry["pss_ratio"] = round(ours["total_pss_mb"] / theirs["total_pss_mb"], 3)
        if ours and theirs and ours["every_first_batch_s"] and theirs["every_first_batch_s"]:
            entry["first_batch_ratio"] = round(
                ours["every_first_batch_s"] / theirs["every_first_batch_s"], 3)
        out.append(entry)
    return out


def targets(summary: list[dict], ranks: int = 8) -> list[str]:
    """The targets at ``ranks`` ranks (first batch, RSS growth, PSS), met or missed by how much."""
    entry = next((e for e in summary if e["ranks"] == ranks), None)
    ours = entry.get("gpufeed") if entry else None
    if not ours:
        return [f"targets: no gpufeed row at {ranks} ranks"]
    lines = []
    checks = [("every rank's first batch", ours["every_first_batch_s"],
               _TARGETS["every_first_batch_s"], "s"),
              ("server RSS growth", ours["rss_growth_mb"], _TARGETS["rss_growth_mb"], "MB"),
              ("total PSS ÷ DataLoader's", entry.get("pss_ratio"), _TARGETS["pss_ratio"], "x")]
    for what, value, limit, unit in checks:
        if value is None:
            lines.append(f"target: {what} at most {limit:g} {unit} at {ranks} ranks: not measured")
            continue
        verdict = "met" if value <= limit else f"MISSED by {value - limit:.2f} {unit}"
        lines.append(f"target: {what} at most {limit:g} {unit} at {ranks} ranks: "
                     f"{value:g} {unit}, {verdict}")
    return lines


def table(summary: list[dict]) -> str:
    head = ("| ranks | gpufeed: every rank's first batch s | DataLoader: every rank's first "
            "batch s | gpufeed server RSS growth MB (peak) | gpufeed total PSS MB | DataLoader "
            "total PSS MB | PSS gpufeed ÷ DataLoader |\n|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for e in summary:
        ours, theirs = e.get("gpufeed") or {}, e.get("dataloader") or {}

        def cell(side: dict, key: str) -> str:
            value = side.get(key)
            return "–" if value is None else f"{value:g}"

        growth = (f"{cell(ours, 'rss_growth_mb')} ({cell(ours, 'peak_growth_mb')})"
                  if ours else "–")
        ratio = f"{e['pss_ratio']:.2f}x" if "pss_ratio" in e else "–"
        lines.append(f"| {e['ranks']} | {cell(ours, 'every_first_batch_s')} | "
                     f"{cell(theirs, 'every_first_batch_s')} | {growth} | "
                     f"{cell(ours, 'total_pss_mb')} | {cell(theirs, 'total_pss_mb')} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="8", help="comma-separated rank counts, one row each")
    parser.add_argument("--sides", default=",".join(_SIDES), help="gpufeed, dataloader or both")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every row (medians)")
    parser.add_argument("--lines", type=int, default=_LINES, help="lines of the list file")
    parser.add_argument("--pool", type=int, default=1300, help="JPEGs the class folders share")
    parser.add_argument("--root", type=Path, default=Path("bench/data/open-scale"),
                        help="where the data set is built (and reused)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                        help="the server's decode threads")
    parser.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--more", type=int, default=5,
                        help="batches each rank takes after its first, before the memory is read")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds between the last rank holding and the memory read")
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between rows")
    parser.add_argument("--timeout", type=float, default=600.0, help="a row's time limit, s")
    parser.add_argument("--max-used-gib", type=float, default=20.0,
                        help="stop a row when the machine's used memory passes this")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--out", type=Path, default=Path("bench/results"),
                        help="the report goes here as open-scale-<time>.json and "
                             "open-scale-latest.json")
    args = parser.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    if not set(sides) <= set(_SIDES):
        parser.error(f"--sides: {args.sides!r}")
    counts = [int(n) for n in args.ranks.split(",")]
    _print(f"building or reusing the data set in {args.root} ...")
    list_file = build(args.root, args.lines, args.pool)
    rows: list[dict] = []
    skipped: dict[str, int] = {}  # side -> the fewest ranks not to run again
    for round_ in range(1, args.rounds + 1):
        for ranks in counts:
            for side in sides:
                if ranks >= skipped.get(side, sys.maxsize):
                    continue
                estimate = _estimate(rows, side, ranks)
                if estimate is not None and _used_gib() + estimate > args.max_used_gib:
                    _print(f"round {round_}: {side}, {ranks} ranks: SKIPPED: estimated to need "
                           f"~{estimate:.1f} GiB more, past --max-used-gib "
                           f"{args.max_used_gib:g} with {_used_gib():.1f} GiB in use")
                    rows.append({"side": side, "ranks": ranks, "round": round_,
                                 "status": "skipped", "estimate_gib": round(estimate, 1)})
                    skipped[side] = ranks
                    continue
                if rows:
                    time.sleep(args.pause)  # the last row's processes are gone; load settles
                guess = f", estimated ~{estimate:.1f} GiB" if estimate is not None else ""
                _print(f"round {round_}: {side}, {ranks} ranks (load average {_load():.2f}, "
                       f"{_running()} tasks running, {_used_gib():.1f} GiB in use{guess}) ...")
                row = _row(side, ranks, args, list_file, _print)
                row["round"] = round_
                rows.append(row)
                if row["status"] != "ok":
                    skipped[side] = ranks
    summary = summarise(rows)
    report = {"machine": _machine(), "args": {k: str(v) for k, v in vars(args).items()},
              "rows": rows, "summary": summary, "targets": targets(summary, max(counts))}
    _print("\n" + table(summary))
    for line in report["targets"]:
        _print(line)
    from bench.measure import write_report

    path = write_report(report, args.out, "open-scale", "open-scale-latest.json")
    _print(f"wrote {path}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _estimate(rows: list[dict], side: str, ranks: int) -> float | None:
    """GiB the side's ``ranks`` ranks may take: its last measured row's total PSS scaled
    by ranks, with a quarter more (None before the side's first row)."""
    done = [r for r in rows if r["side"] == side and r["status"] == "ok"]
    if not done:
        return None
    last = done[-1]
    return last["memory"]["total_pss_mb"] / last["ranks"] * ranks * 1.25 / 1024


def _machine() -> dict:
    import torch

    info = _meminfo()
    return {"cores": os.cpu_count(), "memory_gib": round(info["MemTotal"] / 2**30, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__}


def _print(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


if __name__ == "__main__":
    main()
