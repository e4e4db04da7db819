"""The README's main job, small: data set, server, trainer-like client, throughput lines."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "gpufeed.server.demo", "--data-dir", str(tmp_path), "--images", "24",
         "--epochs", "2", "--batch-size", "8", "--size", "64"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert len(list(tmp_path.glob("*.jpg"))) == 24
    assert "epoch 0: 24 images" in result.stdout
    assert "epoch 1: 24 images" in result.stdout
    assert "img/s over shm" in result.stdout
