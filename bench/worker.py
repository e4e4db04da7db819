"""One row of the table in a fresh process: ``python -m bench.worker ROW CONFIG_JSON``.

A fresh process per row means no row inherits another's threads, imports or
warm caches of its own making. Progress goes to stderr as the row runs; the
result is the last line of stdout, as JSON (nothing is pickled).
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from .measure import Meter
from .peers import Unavailable

__all__ = ["ROWS", "Config", "Row", "group"]


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
    prefetch: int = 0  # gpufeed's batches decoded ahead of the trainer; 0: the server's default

    @property
    def paths(self) -> list[str]:
        return [str(Path(self.root) / name) for name in self.names]

    @property
    def expected(self) -> int:
        return len(self.names) * self.passes


class Row(NamedTuple):
    """A row of the table: its label, what runs it, and the job it does (image rows only)."""

    label: str
    runner: Callable
    job: str = ""


def _ceiling(c, m):
    from .peers import ceiling
    return ceiling.run(c, m)


def _row(label: str, module: str, job: str, *args) -> Row:
    """A row of ``job`` whose runner is ``bench.peers.<module>.run(config, meter, job, *args)``."""
    def run(c, m):
        return importlib.import_module(f"{__package__}.peers.{module}").run(c, m, job, *args)
    return Row(label, run, job)


def _trainers(count):
    def run(c, m):
        from .peers import gpufeed
        return gpufeed.run_trainers(c, m, count)
    return run


def _gpufeed_gpu(how):
    def run(c, m):
        from .peers import gpufeed
        return gpufeed.run_gpu(c, m, "train-u8", how)
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


def _tf_shards(where):
    def run(c, m):
        from .peers import tfdata
        return tfdata.run_shards(c, m, "squash", where)
    return run


def _spdl(c, m):
    from .peers import spdl_pipeline
    return spdl_pipeline.run(c, m)


# Row id -> Row. Imports stay inside the runners so a row pays only for its own
# packages. The image rows come in jobs (bench.jobs), one table each in bench.run.
ROWS = {
    # squash: the whole image to 224x224, uint8
    "ceiling": Row("gpufeed decoder ceiling (threads, no service)", _ceiling, "squash"),
    "gpufeed-shm": _row("gpufeed -> trainer process, shm", "gpufeed", "squash", "shm"),
    "gpufeed-inline": _row("gpufeed -> trainer process, inline", "gpufeed", "squash", "inline"),
    "torch-2": _row("torch DataLoader, 2 workers (Pillow)", "torch_loader", "squash", 2),
    "torch-4": _row("torch DataLoader, 4 workers (Pillow)", "torch_loader", "squash", 4),
    "spdl": Row("SPDL pipeline", _spdl, "squash"),
    "tf": _row("tf.data, in-process", "tfdata", "squash"),
    "tf-service": _row("tf.data service -> trainer process", "tfdata", "squash", True),
    "dali": _row("DALI, CPU only (decoders.image + resize)", "dali", "squash"),
    # Across a network hop (bench/netns.py): server and trainer in two namespaces.
    "gpufeed-inline-veth": _row("gpufeed -> trainer over a veth link, inline", "remote", "squash",
                                None),
    "gpufeed-inline-10g": _row("gpufeed -> trainer over a 10 Gbit/s link, inline", "remote",
                               "squash", "10gbit"),
    "gpufeed-inline-1g": _row("gpufeed -> trainer over a 1 Gbit/s link, inline", "remote",
                              "squash", "1gbit"),
    "tf-service-veth": _row("tf.data service -> trainer over a veth link", "remote", "squash",
                            None, "tf"),
    "tf-service-10g": _row("tf.data service -> trainer over a 10 Gbit/s link", "remote",
                           "squash", "10gbit", "tf"),
    "tf-service-1g": _row("tf.data service -> trainer over a 1 Gbit/s link", "remote",
                          "squash", "1gbit", "tf"),
    # the same JPEGs in tar shards of ~100 MB: local disk, or local S3 (SeaweedFS)
    "shards-local": _row("gpufeed tar shards, local disk -> trainer process, shm", "shards",
                         "squash", "local"),
    "shards-s3": _row("gpufeed tar shards, SeaweedFS S3, read-ahead on", "shards", "squash",
                      "s3"),
    "shards-s3-no-readahead": _row("gpufeed tar shards, SeaweedFS S3, read-ahead off",
                                   "shards", "squash", "s3-no-readahead"),
    "shards-s3-5ms": _row("gpufeed tar shards, SeaweedFS S3 + 5 ms per request, read-ahead on",
                          "shards", "squash", "s3-5ms"),
    "shards-s3-5ms-no-readahead": _row("gpufeed tar shards, SeaweedFS S3 + 5 ms per request, "
                                       "read-ahead off", "shards", "squash",
                                       "s3-5ms-no-readahead"),
    # peers on the same tar shards
    "wds-torch-2-local": _row("WebDataset + torch DataLoader, 2 workers, tar shards, local disk",
                              "webdataset_loader", "squash", "local"),
    "wds-torch-2-s3": _row("WebDataset + torch DataLoader, 2 workers, tar shards, SeaweedFS S3",
                           "webdataset_loader", "squash", "s3"),
    "tf-shards-local": Row("tf.data, tar shards (generator), local disk", _tf_shards("local"),
                           "squash"),
    "tf-shards-s3": Row("tf.data, tar shards (generator), SeaweedFS S3", _tf_shards("s3"),
                        "squash"),
    # training: random-resized-crop + flip, uint8
    "gpufeed-shm-rrc-u8": _row("gpufeed -> trainer process, shm, random-resized-crop + flip",
                               "gpufeed", "train-u8", "shm"),
    "torch-2-rrc-u8": _row("torch DataLoader, 2 workers (Pillow RandomResizedCrop + flip)",
                           "torch_loader", "train-u8", 2),
    "tf-rrc-u8": _row("tf.data, in-process (decode_and_crop_jpeg + flip)", "tfdata", "train-u8"),
    "dali-rrc-u8": _row("DALI, CPU only (decoders.image_random_crop + resize + flip)", "dali",
                        "train-u8"),
    # training on a GPU host (bench/gpu/run.sh): the batches end on the trainer's GPU
    "gpufeed-shm-h2d-rrc-u8": Row("gpufeed -> trainer process, shm, then the trainer's copy to "
                                  "the GPU, random-resized-crop + flip", _gpufeed_gpu("shm-h2d"),
                                  "train-u8"),
    "gpufeed-cuda-rrc-u8": Row("gpufeed -> trainer process, cuda_ipc (CPU decode), "
                               "random-resized-crop + flip", _gpufeed_gpu("cuda_ipc"), "train-u8"),
    "gpufeed-nvimgcodec-rrc-u8": Row("gpufeed -> trainer process, cuda_ipc, --decoder nvimgcodec, "
                                     "random-resized-crop + flip", _gpufeed_gpu("nvimgcodec"),
                                     "train-u8"),
    "torchvision-gpu-rrc-u8": _row("torch DataLoader, 4 workers reading bytes; torchvision "
                                   "decode_jpeg + RandomResizedCrop + flip on the GPU",
                                   "torchvision_gpu", "train-u8", 4),
    "nvimgcodec-ceiling-rrc-u8": _row("nvImageCodec batched region decode + resize + flip "
                                      "(no service; its ceiling)", "nvimgcodec_ceiling",
                                      "train-u8"),
    # training: the same, normalised, float16 (torchvision's ImageNet recipe)
    "gpufeed-shm-rrc": _row("gpufeed -> trainer process, shm, random-resized-crop + flip + "
                            "normalize, float16", "gpufeed", "train-f16", "shm"),
    "torch-2-rrc": _row("torch DataLoader, 2 workers (Pillow RandomResizedCrop + flip + "
                        "normalize)", "torch_loader", "train-f16", 2),
    "tf-rrc": _row("tf.data, in-process (decode_and_crop_jpeg + flip + normalize)", "tfdata",
                   "train-f16"),
    "dali-rrc": _row("DALI, CPU only (decoders.image_random_crop + resize + "
                     "crop_mirror_normalize)", "dali", "train-f16"),
    # training with augmentations: ColorJitter + TrivialAugmentWide, uint8
    "gpufeed-shm-aug": _row("gpufeed -> trainer process, shm, random-resized-crop + flip + "
                            "color_jitter + trivial_augment_wide", "gpufeed", "train-aug", "shm"),
    "torch-2-aug": _row("torch DataLoader, 2 workers (Pillow random-resized-crop + flip, "
                        "ColorJitter + TrivialAugmentWide in torch)", "torch_loader", "train-aug",
                        2),
    # a GIL-holding pure-Python sample transform: on the decode threads, or in processes
    "gpufeed-shm-pyloop-threads": _row("gpufeed, shm, pure-Python transform on the decode "
                                       "threads", "gpufeed", "train-pyloop", "shm",
                                       "py_pixels"),
    "gpufeed-shm-pyloop-processes": _row("gpufeed, shm, pure-Python transform in worker "
                                         "processes (holds_gil=True)", "gpufeed",
                                         "train-pyloop", "shm", "py_pixels_in_processes"),
    # evaluation: shorter side 256, centre 224, uint8
    "gpufeed-shm-eval": _row("gpufeed -> trainer process, shm, center_crop (shorter side 256)",
                             "gpufeed", "eval", "shm"),
    "torch-2-eval": _row("torch DataLoader, 2 workers (Pillow centre box + resize)",
                         "torch_loader", "eval", 2),
    "tf-eval": _row("tf.data, in-process (decode_and_crop_jpeg of the centre box)", "tfdata",
                    "eval"),
    "dali-eval": _row("DALI, CPU only (decoders.image + resize shorter + crop)", "dali", "eval"),
    # Several trainer processes on one server: aggregate over all of them.
    "trainers-1": Row("gpufeed shm, 1 trainer process", _trainers(1)),
    "trainers-2": Row("gpufeed shm, 2 concurrent trainer processes", _trainers(2)),
    "trainers-4": Row("gpufeed shm, 4 concurrent trainer processes", _trainers(4)),
    # Pre-computed arrays, on the bench.arrays set rather than the JPEGs.
    "npy-gpufeed": Row(".npy: gpufeed -> trainer process, shm", _arrays("npy", "gpufeed")),
    "npy-numpy": Row(".npy: numpy.load in a thread pool", _arrays("npy", "numpy")),
    "npy-torch-2": Row(".npy: torch DataLoader, 2 workers", _arrays("npy", "torch", 2)),
    "npz-gpufeed": Row(".npz: gpufeed -> trainer process, shm", _arrays("npz", "gpufeed")),
    "npz-numpy": Row(".npz: numpy.load in a thread pool", _arrays("npz", "numpy")),
    "npz-torch-2": Row(".npz: torch DataLoader, 2 workers", _arrays("npz", "torch", 2)),
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
    label, runner, _ = ROWS[row]
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
