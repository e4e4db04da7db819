"""bench/pace.py run tiny, so it never rots: both modes (two remote servers of unequal
speed; a local server and a remote one), the three rows, one round.

No speed is asserted (bench/RESULTS.md has the figures); the run must finish, print
its ratio, read the local server over shm and the remote one inline, and the pass
over both servers must have been made by the two together, every batch once. It
runs as its own process: the bench moves itself into a network namespace.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import pace

_WHY_NOT = pace.unavailable_reason()
_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(_WHY_NOT is not None, reason=f"cannot run here: {_WHY_NOT}")
@pytest.mark.parametrize("mode, ratio, transports", [
    ([], "both / (A alone + B alone) = ", ["inline", "inline"]),
    (["--local"], "adding B raised the rate by ", ["shm", "inline"]),
])
def test_pace_tiny(tmp_path, mode, ratio, transports):
    done = subprocess.run(
        [sys.executable, "-m", "bench.pace", "--images", "64", "--batch-size", "16",
         "--rounds", "1", "--warmup", "1", "--data-dir", str(tmp_path), *mode],
        cwd=_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert ratio in done.stdout
    assert re.findall(r"\] transport (\w+)", done.stdout)[-2:] == transports
    (both,) = re.findall(r"A \+ B, .*\[(\d+), (\d+)\]", done.stdout)
    assert sum(map(int, both)) == 4, both  # 64 images in batches of 16, each made once
