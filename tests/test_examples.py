"""The example training script, run small against a real server on generated class folders."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpufeed.server.demo import encode_jpeg
from gpufeed.server.process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_imagefolder.py"
COLOURS = {"blue": (40, 60, 200), "green": (40, 180, 60), "red": (200, 40, 40)}
TRAIN_PER_CLASS, BATCH, EPOCHS = 8, 8, 2  # 24 samples: 3 batches an epoch


@pytest.fixture(scope="module")
def imagefolder(tmp_path_factory) -> Path:
    """root/shapes/{train,val}/<colour>/*.jpg: noisy images whose class is their colour;
    val has no green folder at all (as a copied split drops an empty one), which must
    neither move red's label nor stop the script."""
    root = tmp_path_factory.mktemp("examples")
    rng = np.random.default_rng(3)
    for split, count in (("train", TRAIN_PER_CLASS), ("val", 3)):
        for name, colour in COLOURS.items():
            if (split, name) == ("val", "green"):
                continue
            folder = root / "shapes" / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                noise = rng.integers(-40, 40, (40, 48, 3))
                pixels = np.clip(np.asarray(colour) + noise, 0, 255).astype(np.uint8)
                (folder / f"{i}.jpg").write_bytes(encode_jpeg(pixels))
    return root


def _train(server, checkpoint: Path, *extra: str) -> str:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--server", server.address, "--data", "shapes",
         "--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--size", "32",
         "--checkpoint", str(checkpoint), *extra],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow
def test_example_trains_checkpoints_mid_epoch_and_resumes(imagefolder, tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"
    with ServerProcess(["--data-root", str(imagefolder), "--threads", "2"]) as server:
        first = _train(server, checkpoint, "--stop-after", "2")
        assert "stopped after step 2 (16 samples of epoch 0)" in first
        assert checkpoint.exists()
        second = _train(server, checkpoint)
    assert "resumed at epoch 0, sample 16 (step 2)" in second
    epochs = re.findall(r"epoch (\d+): (\d+) samples, last loss \S+, val accuracy ([\d.]+)",
                        second)
    # The resumed epoch gives the 8 samples the first run had not trained on, no more.
    assert [(e, n) for e, n, _ in epochs] == [("0", "8"), ("1", str(3 * TRAIN_PER_CLASS))]
    assert all(0.0 <= float(accuracy) <= 1.0 for _, _, accuracy in epochs)
