"""The GPU device check (bench/gpu/), dry-run here so that it cannot rot between the
sessions that have a GPU: prepare's extensions, the laid-out package, the CUDA layer's
tests and the GPU bench rows, with its log and JSON where the device tool fetches them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpufeed.server.media import batch_resample

_ROOT = Path(__file__).resolve().parents[1]
_GPU_ROWS = {"gpufeed-shm-h2d-rrc-u8", "gpufeed-cuda-rrc-u8", "gpufeed-nvimgcodec-rrc-u8",
             "torchvision-gpu-rrc-u8"}


@pytest.mark.slow
def test_the_dry_run_does_every_step_and_reports_what_the_device_tool_fetches(tmp_path):
    gpu, out = tmp_path / "gpu", tmp_path / "out"
    env = {**os.environ, "GPUFEED_GPU_DIR": str(gpu), "OUT": str(out), "PYTHON": sys.executable}
    subprocess.run(["bash", "bench/gpu/prepare.sh", "--ext-only"], cwd=_ROOT, env=env, check=True,
                   timeout=120)
    done = subprocess.run(["bash", "bench/gpu/run.sh", "--dry-run", "--data-dir",
                           str(tmp_path / "data")], cwd=_ROOT, env=env, timeout=600,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    # What comes back from the device: at most 8 files, named as the tool allows.
    names = sorted(p.name for p in out.iterdir())
    assert len(names) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names), names
    log = (out / "device-check.log").read_text()
    assert "3/3 python -m bench.gpu.check" in log and "done, exit 0" in log
    report = json.loads((out / "device-check.json").read_text())
    assert report["dry_run"] is True

    # gpufeed came from the laid-out copy, with the extensions prepare.sh built for the
    # stable ABI (the device's Python is another minor version), not from the checkout.
    machine = report["machine"]
    assert machine["status"] == "ok" and not machine["gpufeed"].startswith(str(_ROOT))
    if Path("/usr/include/jpeglib.h").exists():
        assert (gpu / "ext" / "_jpeg.abi3.so").exists()
        assert machine["jpeg"].startswith("JPEG decoder: libjpeg-turbo"), machine["jpeg"]
    assert machine["augment_kernels"] == "C"
    # The nvimgcodec path's resample kernel, where nvcc is here to build it: a library that
    # loads on a machine without a GPU (the CUDA runtime is linked in) with both entries.
    if shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists():
        kernel = batch_resample.load_kernel(gpu / "ext" / "_resample.so")
        assert kernel is not None and hasattr(kernel, "gpufeed_resample_cuda")

    # The CUDA tests of the three modules were collected from the laid-out copy; with no
    # device here they all skip (the suite runs the modules' other tests itself).
    tests = report["tests"]
    assert tests["passed_all"] and tests["failed"] == [] and tests["tests"] >= 10
    if not torch.cuda.is_available():
        assert tests["skipped"] == tests["tests"]

    # The dry run's bench: the CPU row, and the cuda_ipc row saying why it cannot run.
    rows = report["bench"]["rows"]
    assert set(rows) == {"gpufeed-shm-rrc-u8", "gpufeed-cuda-rrc-u8"}
    cpu_row = rows["gpufeed-shm-rrc-u8"]
    assert cpu_row["status"] == "ok" and cpu_row["images"] == cpu_row["expected"] == 48
    assert cpu_row["trainer_cpu_ms_per_batch"] > 0
    if not torch.cuda.is_available():
        assert rows["gpufeed-cuda-rrc-u8"]["status"] == "unavailable"
        assert rows["gpufeed-cuda-rrc-u8"]["note"] == "no CUDA device"
        assert {t["verdict"] for t in report["targets"]} == {"not measured"}

    # The probe of nvImageCodec's configurations ran on the bench's JPEGs (on its CPU
    # backend here), each configuration decoding every image it was given.
    probe = report["probe"]
    assert probe["status"] == "ok", probe
    for name, found in probe["configs"].items():
        assert found["status"] == "ok" and found["images_per_second"] > 0, (name, found)
        assert found["not_decoded"] == 0, (name, found)


def test_the_device_checks_rows_are_the_benchs():
    """Rows the dry run leaves out are still rows bench.run knows, with a GPU to ask for."""
    from bench import worker
    from bench.gpu import check

    assert set(check._ROWS) <= set(worker.ROWS)
    assert _GPU_ROWS <= set(check._ROWS)
