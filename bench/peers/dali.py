"""NVIDIA DALI on the CPU only (``device_id=None``), as DALI's own ImageNet examples build it.

``fn.readers.file`` reads the files (padding the last batch of a pass, which is
not counted), ``num_threads`` = the core count, and the trainer reads torch
tensors through DALI's PyTorch iterator (``DALIGenericIterator``, partial last
batch), one pass per epoch of the reader:

- squash: ``fn.decoders.image`` -> ``fn.resize`` to H x W (linear, DALI's
  default antialiasing), uint8 HWC.
- training: ``fn.decoders.image_random_crop`` (area and aspect ranges of
  ``bench.jobs``, 10 attempts; it decodes only the crop where the codec
  can) -> ``fn.resize`` to H x W -> a coin-flip ``fn.flip``, uint8 HWC; or,
  for float16, ``fn.crop_mirror_normalize`` (flip by the same coin,
  normalise, float16 CHW), DALI's usual last step.
- evaluation: ``fn.decoders.image`` -> ``fn.resize(resize_shorter=256)`` ->
  ``fn.crop`` of the centre H x W, uint8 HWC.

The wheel is ``nvidia-dali-cuda120``; its CPU operators need no GPU.
"""

from __future__ import annotations

from .. import jobs
from . import Unavailable

_READER = "Reader"


def run(config, meter, job: str) -> str:
    try:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError:
        raise Unavailable("DALI is not installed (pip install nvidia-dali-cuda120)") from None
    height, width = config.size

    @pipeline_def(batch_size=config.batch_size, num_threads=config.threads, device_id=None,
                  seed=0)
    def pipeline():
        files, _ = fn.readers.file(files=config.paths, name=_READER, pad_last_batch=True)
        if job == "squash":
            images = fn.decoders.image(files, device="cpu", output_type=types.RGB)
            return fn.resize(images, resize_x=width, resize_y=height)
        if job == "eval":
            images = fn.decoders.image(files, device="cpu", output_type=types.RGB)
            images = fn.resize(images, resize_shorter=jobs.shorter_side(config.size))
            return fn.crop(images, crop=(height, width))
        images = fn.decoders.image_random_crop(
            files, device="cpu", output_type=types.RGB, random_area=list(jobs.SCALE),
            random_aspect_ratio=list(jobs.RATIO), num_attempts=10)
        images = fn.resize(images, resize_x=width, resize_y=height)
        coin = fn.random.coin_flip(probability=jobs.FLIP)
        if job == "train-u8":
            return fn.flip(images, horizontal=coin)
        return fn.crop_mirror_normalize(
            images, dtype=types.FLOAT16, output_layout="CHW", mirror=coin,
            mean=[255 * m for m in jobs.MEAN], std=[255 * s for s in jobs.STD])

    loader = DALIGenericIterator(pipeline(), ["image"], reader_name=_READER,
                                 last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)
    for _ in range(config.passes):
        for (batch,) in loader:
            image = batch["image"]
            if meter.images == 0:
                jobs.check_batch(image.shape, image.dtype, tuple(config.size), job)
            meter.batch(int(image.shape[0]))
    meter.stop()
    layout = "CHW" if job == "train-f16" else "HWC"
    return f"{config.threads} CPU threads, device_id=None, {layout}"
