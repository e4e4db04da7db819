"""``python -m bench.run``: build or reuse the JPEG set, measure every row, print the table.

Each row runs in its own process (``bench.worker``), one after another, on the
same files, output size and batch size; a row whose package is missing is
listed as unavailable. The table and everything needed to read it (data set,
decoder accuracy, versions, machine) are written as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from . import arrays, dataset
from .accuracy import crop_psnr, decoder_psnr
from .jobs import JOBS
from .measure import write_report
from .worker import ROWS, Config, group

__all__ = ["main"]

_HERE = Path(__file__).resolve().parent
# Per job, gpufeed's row: every other row of the job is compared with it.
# Tar shards: peer row -> (gpufeed's row on the same shards, or the loose files; the goal).
_SHARD_PAIRS = {"wds-torch-2-local": ("shards-local", 1.5), "wds-torch-2-s3": ("shards-s3", 1.5),
                "tf-shards-local": ("shards-local", None), "tf-shards-s3": ("shards-s3", None),
                "gpufeed-shm": ("shards-s3", 0.9)}
_REFERENCES = {"squash": "gpufeed-shm", "train-u8": "gpufeed-shm-rrc-u8",
               "train-f16": "gpufeed-shm-rrc", "eval": "gpufeed-shm-eval",
               "train-aug": "gpufeed-shm-aug", "train-pyloop": "gpufeed-shm-pyloop-processes"}
# The image jobs' targets: gpufeed's images/s at least this many times the row's. And in
# every job, gpufeed's CPU per image at or below the best peer's.
_TARGETS = {"tf": 1.1, "tf-rrc-u8": 1.3, "dali-rrc-u8": 1.5, "tf-rrc": 1.3, "dali-rrc": 1.5,
            "tf-eval": 1.2, "torch-2-aug": 1.5}
_PACKAGES = ("av", "torch", "pillow", "grpcio", "spdl", "tensorflow-cpu", "nvidia-dali-cuda120",
             "numpy")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    p.add_argument("--images", type=int, default=2000,
                   help="JPEGs in the set (default %(default)s)")
    p.add_argument("--data-dir", type=Path, default=_HERE / "data",
                   help="where sets are built and reused (default bench/data)")
    p.add_argument("--out", type=Path, default=_HERE / "results",
                   help="folder for the JSON results (default bench/results)")
    p.add_argument("--rows", default=",".join(ROWS),
                   help="comma-separated rows to run (default: all): " + ", ".join(ROWS))
    p.add_argument("--passes", type=int, default=2,
                   help="passes over the set per row (per trainer in the trainers rows)")
    p.add_argument("--arrays", type=int, default=2000,
                   help="samples in the .npy and in the .npz set (default %(default)s)")
    p.add_argument("--array-passes", type=int, default=10,
                   help="passes over the array set per array row (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=224, help="output height and width")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="decode threads / parallel calls (default: cores, %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="batches before the clock starts")
    p.add_argument("--prefetch", type=int, default=0,
                   help="gpufeed's batches decoded ahead of the trainer (default: the server's, 4)")
    p.add_argument("--psnr-images", type=int, default=200,
                   help="files to check the decoder's accuracy on (0: skip)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds over all rows; each row keeps its fastest round (a shared "
                        "machine's noise only ever slows a row down)")
    p.add_argument("--jobs", type=int, default=1,
                   help="rows run at once (default 1). Anything above 1 is for smoke runs only: "
                        "rows running together share the cores and disturb each other's figures")
    p.add_argument("--row-timeout", type=float, default=300.0,
                   help="seconds before a row is killed")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = set(rows) - set(ROWS)
    if unknown:
        _parser().error(f"unknown rows: {', '.join(sorted(unknown))}")
    started = time.perf_counter()
    data = dataset.build(args.data_dir / f"jpeg{args.images}", args.images, log=_say)
    _say(f"data set: {len(data.names)} JPEGs from {data.source}, mean "
         f"{data.mean_width:.0f}x{data.mean_height:.0f}, {data.mean_bytes / 1000:.0f} KB, "
         f"quality {data.quality} ({data.root})")
    array_set = None
    if any(group(r) == "arrays" for r in rows):
        array_set = arrays.build(args.data_dir / f"arrays{args.arrays}", args.arrays, log=_say)
        _say(f"array set: {array_set.count} .npy ({array_set.npy_bytes / 1000:.0f} KB each) and "
             f".npz ({array_set.npz_bytes / 1000:.0f} KB each) in {array_set.root}")
    config = Config(root=str(data.root.resolve()), list_file=data.list_file.name, names=data.names,
                    batch_size=args.batch_size, size=(args.size, args.size), passes=args.passes,
                    threads=args.threads, warmup=args.warmup,
                    arrays_root=str(array_set.root.resolve()) if array_set else "",
                    array_passes=args.array_passes, prefetch=args.prefetch)
    accuracy = None
    if args.psnr_images:
        accuracy = decoder_psnr(config.paths[:args.psnr_images], config.size)
        _say(f"decoder accuracy vs Pillow decode + bilinear resize: mean "
             f"{accuracy['mean_db']:.2f} dB, worst {accuracy['min_db']:.2f} dB "
             f"over {accuracy['images']} images")
        accuracy["crop"] = crop = crop_psnr(config.paths[:args.psnr_images], config.size)
        _say(f"random-resized crops vs Pillow on the same box: mean {crop['mean_db']:.2f} dB, "
             f"worst {crop['min_db']:.2f} dB over {crop['images']} images")
    runs: dict[str, list[dict]] = {row: [] for row in rows}

    def one(row: str, round_: int) -> dict:
        _say(f"[{row}] {ROWS[row][0]} (round {round_ + 1}/{args.repeat}; load average "
             f"{_loadavg()}) ...")
        result = {**_run_row(row, config, args.row_timeout), "load_average_after": _loadavg()}
        _say(f"[{row}] {_summary(result)}")
        return result

    for round_ in range(args.repeat):
        if args.jobs <= 1:
            for row in rows:
                runs[row].append(one(row, round_))
        else:
            with ThreadPoolExecutor(args.jobs) as pool:
                for row, result in zip(rows, pool.map(one, rows, [round_] * len(rows))):
                    runs[row].append(result)
    results = [_best(runs[row]) for row in rows]
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python -m bench.run", *(argv if argv is not None else sys.argv[1:])]),
        "config": {k: v for k, v in asdict(config).items() if k != "names"},
        "jobs": args.jobs,
        "data_set": data.describe(),
        "array_set": array_set.describe() if array_set else None,
        "decoder_accuracy": accuracy,
        "machine": _machine(),
        "rows": results,
        "server_overhead": _overhead(results, args.batch_size),
        "seconds": time.perf_counter() - started,
        "load_average_end": _loadavg(),
    }
    print(format_table(report), flush=True)
    _say(f"wrote {write_report(report, args.out, 'bench', 'latest.json')}")
    return report


def _run_row(row: str, config: Config, timeout: float) -> dict:
    """Run one row in a fresh process; its progress streams to our stderr."""
    raw = json.dumps(asdict(config))
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "bench.worker", row, raw],
                              cwd=_HERE.parent, stdout=subprocess.PIPE, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"row": row, "label": ROWS[row][0], "status": "failed",
                "note": f"no result within {timeout:g} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"row": row, "label": ROWS[row][0], "status": "failed",
                "note": f"exit code {done.returncode}; see the traceback above"}
    return {**json.loads(lines[-1]), "row_seconds": time.perf_counter() - started}


def _best(runs: list[dict]) -> dict:
    """The fastest successful run of a row (or its last failure), with every run's figures."""
    ok = [r for r in runs if r["status"] == "ok"]
    best = dict(max(ok, key=lambda r: r["images_per_second"]) if ok else runs[-1])
    best["rounds"] = [{k: r.get(k) for k in ("status", "images_per_second", "cpu_seconds_per_1000",
                                             "startup_seconds", "teardown_seconds",
                                             "load_average_after")}
                      for r in runs]
    return best


def _summary(result: dict) -> str:
    """The row's figures in one line, next to its progress lines (the same clock and start)."""
    if result["status"] != "ok":
        return f"{result['status']}: {result['note']}"
    line = (f"{result['images_per_second']:.0f} img/s steady over {result['seconds']:.1f} s, "
            f"{result['cpu_seconds_per_1000']:.2f} CPU s / 1000 images "
            f"({result['images']}/{result['expected']} images delivered; row took "
            f"{result['row_seconds']:.1f} s")
    if result.get("startup_seconds") is not None:
        line += (f": start-up {result['startup_seconds']:.1f} s, teardown "
                 f"{result['teardown_seconds']:.1f} s of which "
                 f"{result['end_of_sequence_seconds']:.1f} s to the end of sequence")
    line += ")"
    rates = [rate for _, _, rate in result.get("progress", [])]
    if rates:
        line += f"; progress lines {min(rates):.0f}-{max(rates):.0f} img/s"
        if not min(rates) * 0.9 <= result["images_per_second"] <= max(rates) * 1.1:
            line += " -- CHECK: the summary is outside its own progress lines"
    return line


def _overhead(results: list[dict], batch_size: int) -> dict:
    """What the service adds per batch over the bare decoder: wall time and CPU time."""
    ok = {r["row"]: r for r in results if r["status"] == "ok" and r["images_per_second"] > 0}
    if "ceiling" not in ok:
        return {}
    base = ok["ceiling"]
    out = {}
    for row in ("gpufeed-shm", "gpufeed-inline"):
        if row in ok:
            r = ok[row]
            out[row] = {
                "wall_ms_per_batch": 1000 * batch_size * (1 / r["images_per_second"]
                                                          - 1 / base["images_per_second"]),
                "cpu_ms_per_batch": batch_size * (r["cpu_seconds_per_1000"]
                                                  - base["cpu_seconds_per_1000"]),
                "fraction_of_ceiling": r["images_per_second"] / base["images_per_second"],
            }
    return out


def format_table(report: dict) -> str:
    """The results as Markdown tables, as bench/RESULTS.md shows them: one per group of rows."""
    groups: dict[str, list[dict]] = {}
    for r in report["rows"]:
        groups.setdefault(group(r["row"]), []).append(r)
    parts = []
    if "images" in groups:
        parts.append(_images_table(groups["images"], report))
    if "trainers" in groups:
        parts.append(_trainers_table(groups["trainers"]))
    if "arrays" in groups:
        parts.append(_arrays_table(groups["arrays"]))
    if report.get("jobs", 1) > 1:
        parts.append(f"(rows ran {report['jobs']} at a time: the figures disturb each other)")
    return "\n\n".join(parts)


def _images_table(rows: list[dict], report: dict) -> str:
    """One table per job, each row against gpufeed's row of the same job, then the targets."""
    parts = []
    for job, title in JOBS.items():
        in_job = [r for r in rows if ROWS[r["row"]].job == job]
        if in_job:
            parts.append(_job_table(job, title, in_job, report))
    return "\n\n".join(parts)


def _job_table(job: str, title: str, rows: list[dict], report: dict) -> str:
    ref = next((r for r in rows if r["row"] == _REFERENCES[job] and _timed(r)), None)
    lines = [f"{title}:", "",
             "| row | images/s | CPU s / 1000 images | gpufeed images/s ÷ row's | "
             "gpufeed CPU ÷ row's | start-up s | teardown s | delivered | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | – | – | – | – | – | – | – | "
                         f"{r['status']}: {r['note']} |")
            continue
        speed = _ratio(ref, r, "images_per_second") if ref else "–"
        cpu = _ratio(ref, r, "cpu_seconds_per_1000") if ref else "–"
        lines.append(f"| {r['label']} | {r['images_per_second']:.0f} | "
                     f"{r['cpu_seconds_per_1000']:.2f} | {speed} | {cpu} | "
                     f"{_seconds(r.get('startup_seconds'))} | "
                     f"{_seconds(r.get('teardown_seconds'))} | "
                     f"{r['images']}/{r['expected']} | {r['note']} |")
    if ref:
        lines.extend(_targets(ref, rows))
    lines.extend(_shard_ratios(rows))
    if job == "squash":
        for row, o in report.get("server_overhead", {}).items():
            lines.append(f"{row}: {100 * o['fraction_of_ceiling']:.0f}% of the ceiling; the "
                         f"service adds {o['wall_ms_per_batch']:.1f} ms wall and "
                         f"{o['cpu_ms_per_batch']:.1f} ms CPU per batch")
    return "\n".join(lines)


def _targets(ref: dict, rows: list[dict]) -> list[str]:
    """The targets for this job (bench/README.md lists them): met, or missed by how much."""
    lines = []
    for r in rows:
        want = _TARGETS.get(r["row"])
        if want and _timed(r):
            got = ref["images_per_second"] / r["images_per_second"]
            verdict = ("met" if got >= want else
                       f"missed: gpufeed needs {want * r['images_per_second']:.0f} img/s, "
                       f"{100 * (want / got - 1):.0f}% more than it has")
            lines.append(f"target: gpufeed >= {want}x {r['label']}: {got:.2f}x, {verdict}")
    peers = [r for r in rows if _timed(r) and not r["row"].startswith(("gpufeed", "ceiling"))]
    if peers:
        best = min(peers, key=lambda r: r["cpu_seconds_per_1000"])
        mine, theirs = ref["cpu_seconds_per_1000"], best["cpu_seconds_per_1000"]
        verdict = ("met" if mine <= theirs else
                   f"missed by {100 * (mine / theirs - 1):.0f}%" if theirs else "missed")
        lines.append(f"target: gpufeed's CPU s / 1000 images at or below the best peer's "
                     f"({best['label']}): {mine:.2f} vs {theirs:.2f}, {verdict}")
    return [""] + lines if lines else []


def _shard_ratios(rows: list[dict]) -> list[str]:
    """The tar-shard rows against gpufeed reading the same shards from the same
    place, and gpufeed's S3 shards against its local loose files (goals: >= 1.5x, >= 0.9x)."""
    timed = {r["row"]: r for r in rows if _timed(r)}
    lines = []
    for peer, (ours, want) in _SHARD_PAIRS.items():
        if peer in timed and ours in timed:
            a, b = timed[ours], timed[peer]
            goal = f" (goal >= {want}x)" if want else ""
            lines.append(f"{a['label']} ÷ {b['label']}: {_ratio(a, b, 'images_per_second')} "
                         f"images/s{goal}, {_ratio(a, b, 'cpu_seconds_per_1000')} CPU per image")
    return lines


def _timed(r: dict) -> bool:
    return r["status"] == "ok" and r["images_per_second"] > 0


def _ratio(ref: dict, r: dict, key: str) -> str:
    return f"{ref[key] / r[key]:.2f}x" if r[key] else "–"


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _trainers_table(rows: list[dict]) -> str:
    """Aggregate and per-trainer rates of N concurrent trainers, against 1 trainer."""
    one = next((r for r in rows if r.get("trainers") == 1 and r["status"] == "ok"), None)
    lines = ["| trainers | aggregate images/s | per-trainer images/s | aggregate vs 1 trainer | "
             "CPU s / 1000 images | delivered |",
             "|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | – | – | – | – | {r['status']}: {r['note']} |")
            continue
        ratio = (f"{r['images_per_second'] / one['images_per_second']:.2f}x"
                 if one and one["images_per_second"] else "–")
        per = ", ".join(f"{x:.0f}" for x in r["per_trainer_images_per_second"])
        lines.append(f"| {r['trainers']} | {r['images_per_second']:.0f} | {per} | {ratio} | "
                     f"{r['cpu_seconds_per_1000']:.2f} | {r['images']}/{r['expected']} |")
    return "\n".join(lines)


def _arrays_table(rows: list[dict]) -> str:
    """Samples/s per array row, with gpufeed's speed-up over each row of the same format."""
    refs = {r["row"].split("-")[0]: r for r in rows
            if r["row"].endswith("-gpufeed") and r["status"] == "ok"}
    lines = ["| row | samples/s | CPU s / 1000 samples | gpufeed shm speed-up | delivered | note |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | – | – | – | – | {r['status']}: {r['note']} |")
            continue
        ref = refs.get(r["row"].split("-")[0])
        speedup = (f"{ref['images_per_second'] / r['images_per_second']:.2f}x"
                   if ref and r["images_per_second"] else "–")
        lines.append(f"| {r['label']} | {r['images_per_second']:.0f} | "
                     f"{r['cpu_seconds_per_1000']:.2f} | {speedup} | "
                     f"{r['images']}/{r['expected']} | {r['note']} |")
    return "\n".join(lines)


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {"cores": len(os.sched_getaffinity(0)), "cpu": cpu, "python": platform.python_version(),
            "packages": versions}


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
