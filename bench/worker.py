"""One row of the table in a fresh process: ``python -m bench.worker ROW CONFIG_JSON``.

A fresh process per row means no row inherits another's threads, imports or
warm caches of its own making. Progress goes to stderr as the row runs; the
result is the last line of stdout, as JSON (nothing is pickled).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .measure import Meter
from .peers import Unavailable

__all__ = ["ROWS", "Config", "group"]


@dataclass
class Config:
    """What every row shares: the files, the output, how much to read, how many threads."""

    root: str
    list_file: str  # relative to root
    names: list[str] = field(repr=False)
    batch_size: int = 32
    size: tuple[int, int] = (224, 224)
    passes: int = 2
    threads: int = 2
    warmup: int = 3
    arrays_root: str = ""  # the .npy/.npz set (bench.arrays), for the array rows
    array_passes: int = 10

    @property
    def paths(self) -> list[str]:
        return [str(Path(self.root) / name) for name in self.names]

    @property
    def expected(self) -> int:
        return len(self.names) * self.passes


def _ceiling(c, m):
    from .peers import ceiling
    return ceiling.run(c, m)


def _gpufeed(transport, **options):
    def run(c, m):
        from .peers import gpufeed
        return gpufeed.run(c, m, transport, **options)
    return run


def _trainers(count):
    def run(c, m):
        from .peers import gpufeed
        return gpufeed.run_trainers(c, m, count)
    return run


def _arrays(fmt, how, workers=0):
    def run(c, m):
        from .peers import arrays
        if how == "gpufeed":
            return arrays.run_gpufeed(c, m, fmt)
        if how == "numpy":
            return arrays.run_numpy(c, m, fmt)
        return arrays.run_torch(c, m, fmt, workers)
    return run


# Training augmentation as the issue states it: torchvision's ImageNet recipe.
_RRC = dict(resize="random_resized_crop", flip=0.5, dtype="float16",
            mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


def _torch(workers):
    def run(c, m):
        from .peers import torch_loader
        return torch_loader.run(c, m, workers)
    return run


def _spdl(c, m):
    from .peers import spdl_pipeline
    return spdl_pipeline.run(c, m)


def _tf(service):
    def run(c, m):
        from .peers import tfdata
        return tfdata.run(c, m, service)
    return run


# Row id -> (label in the table, runner). Imports stay inside the runners so a
# row pays only for its own packages.
ROWS = {
    "ceiling": ("gpufeed decoder ceiling (threads, no service)", _ceiling),
    "gpufeed-shm": ("gpufeed -> trainer process, shm", _gpufeed("shm")),
    "gpufeed-inline": ("gpufeed -> trainer process, inline", _gpufeed("inline")),
    "gpufeed-shm-rrc": ("gpufeed -> trainer process, shm, random-resized-crop + flip + "
                        "normalize, float16", _gpufeed("shm", **_RRC)),
    # The same crops and flips with uint8 out: what the crop costs apart from the normalize.
    "gpufeed-shm-rrc-u8": ("gpufeed -> trainer process, shm, random-resized-crop + flip, uint8",
                           _gpufeed("shm", resize="random_resized_crop", flip=0.5)),
    "torch-2": ("torch DataLoader, 2 workers (Pillow)", _torch(2)),
    "torch-4": ("torch DataLoader, 4 workers (Pillow)", _torch(4)),
    "spdl": ("SPDL pipeline", _spdl),
    "tf": ("tf.data, in-process", _tf(False)),
    "tf-service": ("tf.data service -> trainer process", _tf(True)),
    # Several trainer processes on one server (issue 8): aggregate over all of them.
    "trainers-1": ("gpufeed shm, 1 trainer process", _trainers(1)),
    "trainers-2": ("gpufeed shm, 2 concurrent trainer processes", _trainers(2)),
    "trainers-4": ("gpufeed shm, 4 concurrent trainer processes", _trainers(4)),
    # Pre-computed arrays (issue 7), on the bench.arrays set rather than the JPEGs.
    "npy-gpufeed": (".npy: gpufeed -> trainer process, shm", _arrays("npy", "gpufeed")),
    "npy-numpy": (".npy: numpy.load in a thread pool", _arrays("npy", "numpy")),
    "npy-torch-2": (".npy: torch DataLoader, 2 workers", _arrays("npy", "torch", 2)),
    "npz-gpufeed": (".npz: gpufeed -> trainer process, shm", _arrays("npz", "gpufeed")),
    "npz-numpy": (".npz: numpy.load in a thread pool", _arrays("npz", "numpy")),
    "npz-torch-2": (".npz: torch DataLoader, 2 workers", _arrays("npz", "torch", 2)),
}


def group(row: str) -> str:
    """Which table a row belongs to: "images" (the JPEG rows), "trainers" or "arrays"."""
    if row.startswith("trainers-"):
        return "trainers"
    if row.startswith(("npy-", "npz-")):
        return "arrays"
    return "images"


def main(argv: list[str]) -> int:
    row, raw = argv
    config = Config(**json.loads(raw))
    label, runner = ROWS[row]
    meter = Meter(row, config.expected, warmup=config.warmup)
    try:
        returned = runner(config, meter)
        note, extra = (returned, {}) if isinstance(returned, str) else returned
        result = meter.result(note)
        out = {"row": row, "label": label, "status": "ok", **result.to_json(), **extra}
        if result.images != result.expected:
            out["status"] = "failed"
            out["note"] = f"delivered {result.images} of {result.expected} images"
    except Unavailable as e:
        out = {"row": row, "label": label, "status": "unavailable", "note": str(e)}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
