"""``python -m bench.soak --minutes 10``: does the server leak memory or file descriptors?

Starts a ``gpufeed-server`` on the benchmark's JPEG set and two trainer
processes (``bench.trainer``) that stream epochs back to back: one over shm,
one over inline, so both transports' per-stream set-up and tear-down (a shared
memory segment, its mapping, a gRPC call) repeat every epoch. Every
``--interval`` seconds it samples the server's resident memory (VmRSS in
/proc/<pid>/status), its open file descriptors (the entries of
/proc/<pid>/fd), its threads, the server's shared-memory segments in /dev/shm
and each trainer's images/s, and prints a line. At the end it stops the
trainers, drains the server with SIGTERM, checks that /dev/shm holds nothing of
it, prints a table per minute and a verdict line (RSS of the first minute
against the last, file descriptors min/max), and writes the whole record as
JSON to ``--out`` (``soak-latest.json`` is the last one).

With ``--mix both`` (the default) the first half of the run is clean and the
second adds an adversarial mix beside the trainers (bench/adversary.py: idle
calls that never send ``open``, oversized requests, a stream of bad files); the
verdict compares the trainers' images/s in the two halves, and the report says
how each adversarial call ended. ``--mix clean`` or ``adversarial`` runs one
kind for the whole time.

This is a benchmark, not a test: nothing here fails on a threshold. The
verdict's "flat" means the last minute's mean RSS is within ``--tolerance-mb``
or ``--tolerance-pct`` of the first minute's, whichever is larger.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from . import dataset
from .adversary import Adversary, make_bad_files
from .measure import proc_status, write_report
from .trainer import TrainerProcess

__all__ = ["main"]

_HERE = Path(__file__).resolve().parent
_SHM = "/dev/shm"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0,
                   help="how long to stream (default %(default)s)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--images", type=int, default=2000,
                   help="JPEGs in the set (default %(default)s)")
    p.add_argument("--data-dir", type=Path, default=_HERE / "data")
    p.add_argument("--out", type=Path, default=_HERE / "results")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="server decode threads (default: cores, %(default)s)")
    p.add_argument("--transports", default="shm,inline",
                   help="one trainer per transport (default %(default)s)")
    p.add_argument("--mix", choices=("both", "clean", "adversarial"), default="both",
                   help="clean, adversarial, or both: a clean first half, then the adversarial "
                        "mix beside the trainers (default %(default)s)")
    p.add_argument("--idle-calls", type=int, default=4,
                   help="adversarial calls held open at a time without `open` "
                        "(default %(default)s)")
    p.add_argument("--tolerance-mb", type=float, default=10.0)
    p.add_argument("--tolerance-pct", type=float, default=5.0)
    return p


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _fd_targets(pid: int):
    """What each of the process's open descriptors points at (OSError if it is gone)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            yield os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue


def _shm_held(pid: int) -> dict[str, int]:
    """What the server still holds of shared memory whose name is gone (ended streams' segments):
    open descriptors to deleted /dev/shm files, and mappings of /dev/shm/gpufeed-* segments."""
    try:
        fds = sum(1 for target in _fd_targets(pid)
                  if target.startswith(_SHM + "/gpufeed-") and target.endswith("(deleted)"))
        with open(f"/proc/{pid}/maps") as f:
            maps = {line.split(None, 5)[5].strip() for line in f
                    if _SHM + "/gpufeed-" in line and "-probe" not in line}
    except OSError:
        return {"deleted_shm_fds": -1, "shm_mappings": -1}
    return {"deleted_shm_fds": fds, "shm_mappings": len(maps)}


def _shm_entries(server_id: str | None = None) -> list[str]:
    prefix = f"gpufeed-{server_id}-" if server_id else "gpufeed-"
    try:
        return sorted(n for n in os.listdir(_SHM) if n.startswith(prefix))
    except OSError:
        return []


def _server_id(pid: int, before: set[str]) -> str | None:
    """The server's id, from the probe segment it holds open (/dev/shm/gpufeed-<id>-probe)."""
    try:
        for target in _fd_targets(pid):
            name = os.path.basename(target)
            if target.startswith(_SHM + "/gpufeed-") and name.endswith("-probe"):
                return name.split("-")[1]
    except OSError:
        pass
    new = [n for n in _shm_entries() if n not in before and n.endswith("-probe")]
    return new[0].split("-")[1] if len(new) == 1 else None


def main(argv: list[str] | None = None) -> dict:
    from gpufeed.server.process import ServerProcess

    args = _parser().parse_args(argv)
    data = dataset.build(args.data_dir / f"jpeg{args.images}", args.images, log=_say)
    _say(f"data set: {len(data.names)} JPEGs ({data.root}); load average "
         f"{_loadavg()}; streaming for {args.minutes:g} min, a sample every {args.interval:g} s")
    bad_files = (make_bad_files(data.root, (data.root / data.names[0]).read_bytes())
                 if args.mix != "clean" else [])
    shm_before = set(_shm_entries())
    server = ServerProcess(["--data-root", str(data.root.resolve()),
                            "--threads", str(args.threads)])
    server.start()
    pid = server.proc.pid
    server_id = _server_id(pid, shm_before)
    transports = [t for t in args.transports.split(",") if t]
    trainers = [TrainerProcess(server.address, data.list_file.name, transport=t, passes=0,
                               batch_size=args.batch_size, size=str(args.size))
                for t in transports]
    adversary = Adversary(server.address, bad_files, idle_calls=args.idle_calls) \
        if bad_files else None
    adversarial_from = {"both": 30 * args.minutes, "adversarial": 0.0}.get(args.mix)
    samples: list[dict] = []
    stopped_early = ""
    started = time.monotonic()
    attacked = False
    try:
        for trainer in trainers:
            if not trainer.ready.wait(120) or trainer.proc.poll() is not None:
                raise RuntimeError(f"trainer ({trainer.transport}) did not start: {trainer.error}")
        for trainer in trainers:
            trainer.go()
        started = time.monotonic()
        last_t, last_images = started, [0] * len(trainers)
        _say("   t s | RSS MB | anon MB | shmem MB | HWM MB | fds | deleted shm fds | "
             "shm maps | threads | shm names | " +
             " | ".join(f"{t.transport} img/s" for t in trainers))
        end = started + 60 * args.minutes
        next_at = started + args.interval
        while True:
            if adversary and not attacked and next_at - started > adversarial_from:
                _say(f"{next_at - args.interval - started:6.0f} | adversarial mix starts")
                adversary.start()
                attacked = True
            time.sleep(max(0.0, next_at - time.monotonic()))
            now = time.monotonic()
            status = proc_status(pid)
            images = [t.images for t in trainers]
            sample = {
                "t": now - started, "due": next_at - started,
                "rss_kb": status["VmRSS"], "hwm_kb": status["VmHWM"],
                "phase": "adversarial" if attacked else "clean",
                "rss_anon_kb": status.get("RssAnon", 0), "rss_shmem_kb": status.get("RssShmem", 0),
                "rss_file_kb": status.get("RssFile", 0),
                "threads": status["Threads"], "fds": _fds(pid), **_shm_held(pid),
                "shm_segments": len(_shm_entries(server_id)) if server_id else None,
                "images": dict(zip(transports, images)),
                "images_per_second": {t: (n - m) / (now - last_t) for t, n, m
                                      in zip(transports, images, last_images)},
                "trainer_rss_kb": {t.transport: proc_status(t.proc.pid)["VmRSS"]
                                   for t in trainers if t.proc.poll() is None},
                "load_average": _loadavg(),
            }
            samples.append(sample)
            last_t, last_images = now, images
            _say(f"{sample['t']:6.0f} | {sample['rss_kb'] / 1024:6.1f} | "
                 f"{sample['rss_anon_kb'] / 1024:7.1f} | {sample['rss_shmem_kb'] / 1024:8.1f} | "
                 f"{sample['hwm_kb'] / 1024:6.1f} | {sample['fds']:3d} | "
                 f"{sample['deleted_shm_fds']:15d} | {sample['shm_mappings']:8d} | "
                 f"{sample['threads']:7d} | "
                 f"{sample['shm_segments'] if server_id else '?':>9} | " +
                 " | ".join(f"{sample['images_per_second'][t]:{len(t) + 6}.0f}"
                            for t in transports))
            dead = [t for t in trainers if t.proc.poll() is not None]
            if dead:
                stopped_early = "; ".join(f"trainer ({t.transport}) exited: {t.error or 'no error'}"
                                          for t in dead)
                _say(f"stopping early: {stopped_early}")
                break
            if server.proc.poll() is not None:
                stopped_early = f"server exited with {server.proc.returncode}"
                _say(f"stopping early: {stopped_early}")
                break
            if now >= end:
                break
            next_at += args.interval
    finally:
        attacks = adversary.stop() if attacked else {}
        codes = {t.transport: t.stop() for t in trainers}
        try:
            server_exit = server.stop(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server_exit = "killed: no exit within 60 s of SIGTERM"
    # Only this server's names: other servers (tests running meanwhile) come and go.
    leftovers = _shm_entries(server_id) if server_id else sorted(set(_shm_entries()) - shm_before)
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python -m bench.soak",
                             *(argv if argv is not None else sys.argv[1:])]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "data_set": data.describe(),
        "cores": len(os.sched_getaffinity(0)),
        "samples": samples,
        "minutes": _per_minute(samples, transports),
        "phases": _per_phase(samples, transports),
        "adversary": attacks,
        "trainers": {t.transport: {"exit_code": codes[t.transport], "error": t.error,
                                   "totals": t.done} for t in trainers},
        "server_exit_code": server_exit,
        "server_id": server_id,
        "shm_left_behind": leftovers,
        "stopped_early": stopped_early,
        "seconds": time.monotonic() - started,
    }
    report["verdict"] = _verdict(report, args)
    print(format_table(report), flush=True)
    if attacks:
        print("adversarial calls: "
              + "; ".join(f"{what}: {n}" for what, n in sorted(attacks.items())), flush=True)
    print(report["verdict"]["line"], flush=True)
    _say(f"wrote {write_report(report, args.out, 'soak', 'soak-latest.json')}")
    return report


def _per_minute(samples: list[dict], transports: list[str]) -> list[dict]:
    """Samples grouped by minute: mean and last RSS, fds min/max, each trainer's images/s."""
    minutes: dict[int, list[dict]] = {}
    for s in samples:
        # Bucket by the time the sample was due (k * interval), not when the sleep ended: a
        # sample closes the interval before it, so the one due at 60 s belongs to minute 1.
        minutes.setdefault(max(0, int((s.get("due", s["t"]) - 1e-6) // 60)), []).append(s)
    out, previous = [], None
    for m in sorted(minutes):
        group = minutes[m]
        t0 = previous["t"] if previous else 0.0
        t1 = group[-1]["t"]
        rates = {t: (group[-1]["images"][t] - (previous["images"][t] if previous else 0))
                 / (t1 - t0) for t in transports}
        out.append({
            "minute": m + 1,
            "rss_mb_mean": sum(s["rss_kb"] for s in group) / len(group) / 1024,
            "rss_mb_last": group[-1]["rss_kb"] / 1024,
            "rss_mb_min": min(s["rss_kb"] for s in group) / 1024,
            "rss_mb_max": max(s["rss_kb"] for s in group) / 1024,
            "anon_mb_mean": (sum(s["rss_anon_kb"] for s in group) / len(group) / 1024
                             if "rss_anon_kb" in group[0] else None),
            "shmem_mb_mean": (sum(s["rss_shmem_kb"] for s in group) / len(group) / 1024
                              if "rss_shmem_kb" in group[0] else None),
            "deleted_shm_fds_max": max(s.get("deleted_shm_fds", -1) for s in group),
            "fds_min": min(s["fds"] for s in group), "fds_max": max(s["fds"] for s in group),
            "threads_max": max(s["threads"] for s in group),
            "images_per_second": rates,
            "load_average": group[-1]["load_average"],
        })
        previous = group[-1]
    return out


def _per_phase(samples: list[dict], transports: list[str]) -> dict[str, dict[str, float]]:
    """Each trainer's images/s over each phase (clean, adversarial), from its first sample on."""
    out = {}
    for phase in ("clean", "adversarial"):
        group = [s for s in samples if s.get("phase") == phase]
        if len(group) >= 2:
            seconds = group[-1]["t"] - group[0]["t"]
            out[phase] = {t: (group[-1]["images"][t] - group[0]["images"][t]) / seconds
                          for t in transports}
    return out


def _throughput(phases: dict) -> str:
    """The adversarial phase's images/s against the clean phase's, per trainer."""
    if len(phases) < 2:
        return ""
    clean, attacked = phases["clean"], phases["adversarial"]
    each = ", ".join(f"{t} {attacked[t]:.0f}/{clean[t]:.0f}" for t in clean)
    ratio = sum(attacked.values()) / max(sum(clean.values()), 1e-9)
    return (f"; trainers' images/s with the adversarial mix: {100 * ratio:.0f}% of the clean "
            f"half ({each})")


def _verdict(report: dict, args) -> dict:
    minutes, samples = report["minutes"], report["samples"]
    if not minutes:
        return {"flat": None, "line": "verdict: no samples"}
    first, last = minutes[0], minutes[-1]
    growth = last["rss_mb_mean"] - first["rss_mb_mean"]
    pct = 100 * growth / first["rss_mb_mean"]
    allowed = max(args.tolerance_mb, first["rss_mb_mean"] * args.tolerance_pct / 100)
    fds = [s["fds"] for s in samples]
    images = sum(s for s in samples[-1]["images"].values())
    flat = abs(growth) <= allowed
    # Minute 1 includes the warm-up (pools, rings and allocator arenas filling): also from minute 2.
    second = minutes[1] if len(minutes) > 2 else None
    since_2 = (f"; from minute 2 ({second['rss_mb_mean']:.1f} MB): "
               f"{last['rss_mb_mean'] - second['rss_mb_mean']:+.1f} MB" if second else "")
    # Descriptors of ended streams come and go in bulk, so the count oscillates: "flat" means
    # the last minute's peak is no higher than the peak of the run's first half.
    first_half = minutes[:max(1, len(minutes) // 2)]
    fds_ceiling = max(m["fds_max"] for m in first_half)
    fds_flat = minutes[-1]["fds_max"] <= fds_ceiling
    anon = (f"; anon {first['anon_mb_mean']:.0f} -> {last['anon_mb_mean']:.0f} MB, shmem "
            f"{first['shmem_mb_mean']:.0f} -> {last['shmem_mb_mean']:.0f} MB"
            if first.get("anon_mb_mean") else "")
    clean = not report["shm_left_behind"] and report["server_exit_code"] == 0
    line = (f"verdict: RSS {'flat' if flat else 'GROWING'}: "
            f"first minute {first['rss_mb_mean']:.1f} MB, "
            f"last minute (minute {last['minute']}) {last['rss_mb_mean']:.1f} MB "
            f"({growth:+.1f} MB, {pct:+.1f}%; flat means within {allowed:.0f} MB{since_2}{anon}); "
            f"fds {'flat' if fds_flat else 'GROWING'}: min {min(fds)}, max {max(fds)} "
            f"(last minute's max {minutes[-1]['fds_max']}, first half's {fds_ceiling}); "
            f"{images} images delivered; server exit {report['server_exit_code']}, "
            f"/dev/shm left behind: {len(report['shm_left_behind'])}"
            + _throughput(report.get("phases", {}))
            + (f"; STOPPED EARLY: {report['stopped_early']}" if report["stopped_early"] else ""))
    growth_from_2 = last["rss_mb_mean"] - second["rss_mb_mean"] if second else None
    return {"flat": flat, "rss_growth_from_minute_2_mb": growth_from_2,
            "fds_flat": fds_flat, "clean_exit": clean, "rss_growth_mb": growth,
            "rss_growth_pct": pct, "fds_min": min(fds), "fds_max": max(fds), "line": line}


def format_table(report: dict) -> str:
    """Per minute, as bench/RESULTS.md shows it."""
    transports = list(report["samples"][0]["images"]) if report["samples"] else []
    lines = ["| minute | server RSS MB mean (min-max) | of which anon / shmem MB | fds (min-max) | "
             "deleted shm fds (max) | threads | " +
             " | ".join(f"{t} images/s" for t in transports) + " | load avg (1 min) |",
             "|---:|---:|---:|---:|---:|---:|" + "---:|" * len(transports) + "---:|"]
    for m in report["minutes"]:
        lines.append(f"| {m['minute']} | {m['rss_mb_mean']:.0f} ({m['rss_mb_min']:.0f}-"
                     f"{m['rss_mb_max']:.0f}) | "
                     f"{_mb(m['anon_mb_mean'])} / {_mb(m['shmem_mb_mean'])} | "
                     f"{m['fds_min']}-{m['fds_max']} | "
                     f"{m['deleted_shm_fds_max'] if m['deleted_shm_fds_max'] >= 0 else '–'} | "
                     f"{m['threads_max']} | " +
                     " | ".join(f"{m['images_per_second'][t]:.0f}" for t in transports) +
                     f" | {m['load_average'].split()[0]} |")
    return "\n".join(lines)


def _mb(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
