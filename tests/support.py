"""Helpers the tests share: a reference decode, PSNR, and what is in /dev/shm."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import numpy as np

# Pixels within this PSNR of Pillow's decode + bilinear resize count as equal: the
# two differ in chroma upsampling, YUV->RGB rounding and the scaler's filter taps.
MIN_PSNR_DB = 30.0


def reference_decode(path: Path, height: int, width: int) -> np.ndarray:
    """Pillow's decode, RGB, bilinear resize to (height, width), as uint8 [3, H, W]."""
    from PIL import Image

    with Image.open(io.BytesIO(path.read_bytes())) as im:
        rgb = im.convert("RGB").resize((width, height), Image.BILINEAR)
    return np.asarray(rgb).transpose(2, 0, 1)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def shm_prefix(address: str) -> str:
    """The prefix of every /dev/shm name of the server at ``address`` (from its probe's name)."""
    from gpufeed.client import FeedClient

    with FeedClient(address) as feed:
        return feed.info().shm_probe.name.removesuffix("probe")


def stream_segments(prefix: str) -> set[str]:
    """The stream segments (not the probe) that a server with ``prefix`` has in /dev/shm."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix) and not n.endswith("probe")}


def status_mb(pid: int, field: str = "VmRSS") -> float:
    """A memory figure of process ``pid`` (VmRSS, VmHWM, ...) from /proc/<pid>/status, in MB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def reset_peak_mb(pid: int) -> float:
    """Start process ``pid``'s peak memory (VmHWM) afresh (Linux: "5" to clear_refs); its
    memory now, in MB: what the peak after is compared with."""
    with open(f"/proc/{pid}/clear_refs", "w") as clear:
        clear.write("5")
    return status_mb(pid)


def wait_until(condition, timeout: float = 20.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()
