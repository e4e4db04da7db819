"""``python -m bench.gpu.check --out DIR [--dry-run]``: the GPU device check's body.

bench/gpu/run.sh runs it on the device machine once gpufeed and the carried
packages are on the path. Three steps, each bounded in time and recorded even
when one before it failed, so a single run of a few minutes brings back all it can:

1. the machine: Python, torch and CUDA, the GPU and its driver, where gpufeed
   was imported from and which JPEG path it has, and whether PyAV, grpcio,
   protobuf, nvImageCodec and torchvision import;
2. the CUDA layer's tests: ``tests/test_cuda_ipc.py`` (its ``cuda`` tests and
   the CPU tests of what surrounds the CUDA calls), ``tests/test_resume.py``
   (resume over every transport, cuda_ipc included) and
   ``tests/test_batch_jpeg.py`` (``--decoder nvimgcodec`` on the GPU, and on its
   CPU backend), with a JUnit XML;
3. the GPU bench (``bench.run``): the training crop (random-resized crop + flip,
   224 x 224 uint8) delivered to the trainer's GPU by gpufeed (shm and the
   trainer's own copy; cuda_ipc; ``--decoder nvimgcodec``), by torchvision on the
   GPU, and nvImageCodec's own ceiling, with every decode thread the machine has;
4. where a batch's time goes in the ``--decoder nvimgcodec`` path
   (``bench.gpu.stages``: the server's batch decode timed on 1 to 16 threads,
   with the resample kernel and with torch, and profiled);
5. nvImageCodec's decode alone in the configurations the server could use
   (``bench.gpu.probe``), on the bench's JPEGs.

``device-check.json`` is rewritten after every step, so a run stopped at its limit
still brings back what the steps before finished. The steps' default limits add up to
under the 570 s the device call is given.

It ends with ``device-check.json`` and a short table of the GPU decode's targets
(a ratio is only ever taken between rows of the same run). ``--dry-run`` is the
same on a machine without a GPU, tiny: only the CUDA tests are selected (they skip),
and the bench runs the CPU row and one GPU row, which says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

__all__ = ["main"]

_ROOT = Path(__file__).resolve().parents[2]
_TESTS = ["tests/test_cuda_ipc.py", "tests/test_resume.py", "tests/test_batch_jpeg.py"]
_ROWS = ["gpufeed-shm-rrc-u8", "gpufeed-shm-h2d-rrc-u8", "gpufeed-cuda-rrc-u8",
         "gpufeed-nvimgcodec-rrc-u8", "torchvision-gpu-rrc-u8", "nvimgcodec-ceiling-rrc-u8"]
# The GPU decode's targets: (what, row, metric, than row or None, bound). With another
# row: the row's images/s at least ``bound`` times that row's; without: the row's
# ``metric`` under ``bound``.
_TARGETS = [
    ("nvImageCodec decode >= 2x gpufeed's CPU path (cuda_ipc, every core)",
     "gpufeed-nvimgcodec-rrc-u8", "images_per_second", "gpufeed-cuda-rrc-u8", 2.0),
    ("nvImageCodec decode >= 1.5x torchvision on the GPU",
     "gpufeed-nvimgcodec-rrc-u8", "images_per_second", "torchvision-gpu-rrc-u8", 1.5),
    ("nvImageCodec decode under 0.3 CPU s / 1000 images",
     "gpufeed-nvimgcodec-rrc-u8", "cpu_seconds_per_1000", None, 0.3),
    ("the trainer's CPU per cuda_ipc batch under 0.2 ms",
     "gpufeed-cuda-rrc-u8", "trainer_cpu_ms_per_batch", None, 0.2),
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="where the log's JSON files go")
    p.add_argument("--dry-run", action="store_true",
                   help="on a machine without a GPU: a tiny bench, the CUDA parts skipped")
    p.add_argument("--data-dir", type=Path, default=_ROOT / "bench" / "data",
                   help="where bench.run builds or reuses its JPEG set (default bench/data)")
    p.add_argument("--tests-timeout", type=float, default=150.0)
    p.add_argument("--bench-timeout", type=float, default=240.0)
    p.add_argument("--stages-timeout", type=float, default=60.0)
    p.add_argument("--tests", default=",".join(_TESTS),
                   help="the test modules, comma-separated (default: the three; none: skip "
                        "the tests)")
    p.add_argument("--rows", default=",".join(_ROWS),
                   help="the bench rows, comma-separated (default: all of them)")
    p.add_argument("--prefetch", type=int, default=0,
                   help="the gpufeed rows' batches ahead (bench.run --prefetch; default: the "
                        "server's)")
    p.add_argument("--probe", default="",
                   help="the probe's configurations, comma-separated (default: all; none: "
                        "skip the probe)")
    p.add_argument("--probe-timeout", type=float, default=90.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report: dict = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dry_run": args.dry_run}

    def save() -> None:
        report["seconds"] = round(time.monotonic() - started, 1)
        (args.out / "device-check.json").write_text(json.dumps(report, indent=1))

    def record(name: str, run, *step_args) -> dict:
        report[name] = _step(name, run, *step_args)
        save()
        return report[name]

    record("machine", _machine)
    record("tests", _tests, args.out, _listed(args.tests), args.dry_run, args.tests_timeout)
    bench = record("bench", _bench, args.out, args.data_dir, args.dry_run, _listed(args.rows),
                   args.prefetch, args.bench_timeout)
    record("stages", _stages, bench.get("data_set"), args.dry_run, args.stages_timeout)
    record("probe", _probe, args.out, bench.get("data_set"), args.probe, args.dry_run,
           args.probe_timeout)
    report["targets"] = _targets(bench.get("rows", {}))
    save()
    print(_table(report), flush=True)
    ok = report["tests"].get("passed_all") and report["bench"].get("status") == "ok"
    return 0 if ok else 1


def _say(line: str) -> None:
    print(f"[check] {line}", flush=True)


def _step(name: str, run, *args) -> dict:
    """``run(*args)``'s dict, timed; an exception is recorded, and the next step runs."""
    _say(f"{name} ...")
    began = time.monotonic()
    try:
        result = run(*args)
    except Exception as e:  # a step that breaks must not cost the others
        result = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    result["seconds"] = round(time.monotonic() - began, 1)
    _say(f"{name}: {json.dumps(result)[:2000]}")
    return result


def _machine() -> dict:
    import torch

    found: dict = {"status": "ok", "python": platform.python_version(), "cpus": os.cpu_count(),
                   "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                   "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                        "multiprocessors": props.multi_processor_count,
                        "capability": f"{props.major}.{props.minor}"}
        found["nvidia_smi"] = _command(["nvidia-smi", "--format=csv,noheader",
                                        "--query-gpu=name,driver_version,memory.total"])
        # Whether a CUDA extension could be built there (a batched decode in native code).
        from torch.utils import cpp_extension

        found["nvcc"] = (_command(["nvcc", "--version"]).splitlines() or ["none"])[-1]
        found["cuda_home"] = str(cpp_extension.CUDA_HOME)
    from gpufeed.server.media import jpeg
    from gpufeed.server.media.transforms import builtins as augment

    found["gpufeed"] = str(Path(jpeg.__file__).parents[2])
    found["jpeg"] = jpeg.describe()
    found["augment_kernels"] = "C" if augment.NATIVE_BUILT else "torch (C kernels not built)"
    found["packages"] = {name: _version(name) for name in
                         ("av", "grpc", "google.protobuf", "torchvision", "nvidia.nvimgcodec")}
    return found


def _version(module: str) -> str:
    try:
        imported = __import__(module, fromlist=["__version__"])
    except Exception as e:
        return f"does not import: {type(e).__name__}: {e}"
    return str(getattr(imported, "__version__", "imported"))


def _command(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{argv[0]}: {e}"


def _tests(out: Path, modules: list[str], dry_run: bool, timeout: float) -> dict:
    if modules == ["none"]:
        return {"status": "not run", "passed_all": True, "note": "--tests none"}
    junit = out / "junit.xml"
    # A dry run collects every module from the laid-out copy but runs only the CUDA
    # tests, which skip without a device: the suite runs the rest from the checkout.
    only = ["-m", "cuda"] if dry_run else []
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "timeout=120",
            f"--junitxml={junit}", *only, *modules]
    try:
        code = subprocess.run(argv, cwd=_ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "passed_all": False,
                "note": f"pytest ran past {timeout:g} s; the log has each test's result so far"}
    if not junit.exists():
        return {"status": "error", "passed_all": False, "exit_code": code}
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for suite in ElementTree.parse(junit).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            problem = case.find("failure")
            if problem is None:
                problem = case.find("error")
            if problem is not None:
                failed.append({"test": f"{case.get('classname')}::{case.get('name')}",
                               "message": (problem.get("message") or "")[:500]})
    return {"status": "ok", "exit_code": code, **counts, "failed": failed,
            "passed_all": code == 0 and not failed}


def _bench(out: Path, data_dir: Path, dry_run: bool, rows: list[str], prefetch: int,
           timeout: float) -> dict:
    size = ["--images", "48", "--passes", "1", "--batch-size", "8", "--size", "64", "--warmup",
            "1", "--threads", "2"] if dry_run else ["--passes", "5"]  # 2000 images, every core
    # A dry run: the CPU row, and one GPU row to say "no CUDA device" (each row is a
    # process that imports torch; the others would say the same).
    if dry_run:
        rows = [_ROWS[0], _ROWS[2]]
    argv = [sys.executable, "-m", "bench.run", "--rows", ",".join(rows), "--psnr-images", "0",
            "--row-timeout", "120", "--data-dir", str(data_dir), "--out", str(out),
            "--prefetch", str(prefetch), *size]
    try:
        code = subprocess.run(argv, cwd=_ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "note": f"bench.run ran past {timeout:g} s"}
    latest = out / "latest.json"
    if code != 0 or not latest.exists():
        return {"status": "error", "exit_code": code}
    report = json.loads(latest.read_text())
    keys = ("status", "images_per_second", "cpu_seconds_per_1000", "trainer_cpu_ms_per_batch",
            "startup_seconds", "images", "expected", "note")
    found = {r["row"]: {k: r.get(k) for k in keys} for r in report["rows"]}
    return {"status": "ok", "data_set": report["data_set"], "config": report["config"],
            "rows": found}


def _listed(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def _stages(data_set: dict | None, dry_run: bool, timeout: float) -> dict:
    """bench.gpu.stages; its lines are in the log."""
    if dry_run:
        return {"status": "not run", "note": "the stages need a GPU"}
    if not data_set:
        return {"status": "not run", "note": "the bench built no data set"}
    argv = [sys.executable, "-m", "bench.gpu.stages", "--data", data_set["root"]]
    try:
        code = subprocess.run(argv, cwd=_ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "note": f"the stages ran past {timeout:g} s; the log "
                                               "has each line so far"}
    return {"status": "ok"} if code == 0 else {"status": "error", "exit_code": code}


def _probe(out: Path, data_set: dict | None, configs: str, dry_run: bool, timeout: float
           ) -> dict:
    if configs == "none":
        return {"status": "not run", "note": "--probe none"}
    if not data_set:
        return {"status": "not run", "note": "the bench built no data set"}
    if dry_run:
        configs = configs or "default-roi-b32,default-roi-b32-x4-t4"
    written = out / "probe.json"
    argv = [sys.executable, "-m", "bench.gpu.probe", "--data", data_set["root"],
            "--out", str(written), *(["--seconds", "0.3"] if dry_run else []),
            *(["--configs", configs] if configs else [])]
    try:
        code = subprocess.run(argv, cwd=_ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "note": f"the probe ran past {timeout:g} s; the log "
                                               "has each configuration's result so far"}
    if code != 0 or not written.exists():
        return {"status": "error", "exit_code": code}
    return {"status": "ok", "configs": json.loads(written.read_text())}


def _targets(rows: dict) -> list[dict]:
    """The targets (``_TARGETS``), each met, missed, or not measured (a row or figure
    missing)."""
    found = []
    for what, row, metric, than, bound in _TARGETS:
        value, why = _figure(rows, row, metric)
        if than is not None and value is not None:
            other, why = _figure(rows, than, metric)
            value = value / other if other else None
            why = why or f"{than}: no {metric}"
        if value is None:
            found.append({"target": what, "verdict": "not measured", "why": why})
            continue
        met = value >= bound if than is not None else value < bound
        found.append({"target": what, "verdict": "met" if met else "missed",
                      "value": round(value, 3)})
    return found


def _figure(rows: dict, row: str, metric: str) -> tuple[float | None, str]:
    """A row's ``metric``, or None and why not."""
    found = rows.get(row, {})
    if found.get("status") != "ok":
        return None, f"{row}: {found.get('note') or 'no row'}"
    value = found.get(metric)
    return (value, "") if value is not None else (None, f"{row}: no {metric}")


def _table(report: dict) -> str:
    machine = report["machine"]
    gpu = machine.get("gpu", {}).get("name", "no GPU")
    tests = report["tests"]
    lines = [f"device check ({'dry run, ' if report['dry_run'] else ''}{gpu}, "
             f"{machine.get('cpus')} CPUs, torch {machine.get('torch')}), {report['seconds']} s",
             f"JPEG path: {machine.get('jpeg', '?')}",
             f"tests: {tests.get('status')}, {tests.get('tests', 0)} run, "
             f"{tests.get('failures', 0)} failed, {tests.get('errors', 0)} errors, "
             f"{tests.get('skipped', 0)} skipped",
             "", "| row | images/s | CPU s / 1000 | trainer CPU ms / batch | note |",
             "|---|---:|---:|---:|---|"]
    for row, r in report["bench"].get("rows", {}).items():
        if r["status"] == "ok":
            lines.append(f"| {row} | {_shown(r['images_per_second'], 0)} | "
                         f"{_shown(r['cpu_seconds_per_1000'], 2)} | "
                         f"{_shown(r['trainer_cpu_ms_per_batch'], 2)} | {r['note']} |")
        else:
            lines.append(f"| {row} | - | - | - | {r['status']}: {r['note']} |")
    lines.append("")
    for t in report["targets"]:
        value = f" ({t['value']})" if "value" in t else f": {t['why']}"
        lines.append(f"target: {t['target']}: {t['verdict']}{value}")
    return "\n".join(lines)


def _shown(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
