"""PyTorch's DataLoader as most trainers use it: worker processes, Pillow decode, torch ops.

Each worker opens a file with Pillow (RGB) and makes one image of the job,
the way torchvision's transforms would on a Pillow image (torchvision itself
does not import here, so its steps are written out with Pillow and torch):

- squash: ``resize`` to H x W, bilinear.
- training: a random-resized-crop box sampled like torchvision's
  ``RandomResizedCrop.get_params`` (10 tries at a random area and log-uniform
  aspect, else the centre at the nearest allowed aspect), the box scaled to
  H x W in one Pillow ``resize(box=...)`` (crop and bilinear scale, without
  copying the crop), a horizontal flip with probability 0.5; uint8, or
  ``x / 255``, normalised, float16 (``ToTensor`` + ``Normalize`` + half).
- training with augmentations: the training image, then ColorJitter and
  TrivialAugmentWide as torch operations on the [3, H, W] tensor.
- evaluation: the centre box a shorter side of 256 and a centre 224 keep,
  scaled to H x W in one ``resize(box=...)``: ``Resize(256)`` +
  ``CenterCrop(224)`` without the intermediate image.

Every image is a [3, H, W] tensor; the default collate stacks 32 of them in
shared memory for the trainer. Workers persist across passes, as
``persistent_workers`` does; random choices come from torch's generator,
which DataLoader seeds differently in each worker.
"""

from __future__ import annotations

from typing import IO

import numpy as np
import torch
from PIL import Image

from .. import jobs


class _Images:
    def __init__(self, paths: list[str], size: tuple[int, int], job: str):
        self.paths = paths
        self.size = size
        self.job = job

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return pillow_image(self.paths[i], self.size, self.job)


def pillow_image(file: str | IO[bytes], size: tuple[int, int], job: str) -> torch.Tensor:
    """One image of ``job`` from a JPEG's path or bytes, as the module docstring says."""
    height, width = size
    with Image.open(file) as im:
        rgb = im if im.mode == "RGB" else im.convert("RGB")
        if job == "squash":
            out = rgb.resize((width, height), Image.BILINEAR)
        elif job == "eval":
            left, top, box_width, box_height = jobs.centre_box(*rgb.size, size)
            out = rgb.resize((width, height), Image.BILINEAR,
                             box=(left, top, left + box_width, top + box_height))
        else:
            left, top, box_width, box_height = jobs.random_box(*rgb.size)
            out = rgb.resize((width, height), Image.BILINEAR,
                             box=(left, top, left + box_width, top + box_height))
            if torch.rand(()) < jobs.FLIP:
                out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    chw = np.asarray(out).transpose(2, 0, 1)
    if job == "train-aug":
        return _augmented(chw.copy())
    if job != "train-f16":
        return torch.from_numpy(chw.copy())
    image = torch.from_numpy(chw.astype(np.float32))
    return image.mul_(_SCALE).sub_(_SHIFT).half()  # (x / 255 - mean) / std


_augment = None


def _augmented(chw: np.ndarray) -> torch.Tensor:
    """ColorJitter then TrivialAugmentWide on one uint8 [3, H, W] image, in torch: the
    operations torchvision.transforms.v2 runs on a tensor (gpufeed's built-ins compute
    the same formulas, and torchvision does not import here): gpufeed's torch path, not
    its C kernels, which are gpufeed's own. Draws from torch's generator, which
    DataLoader seeds per worker."""
    global _augment
    if _augment is None:  # once per worker
        from gpufeed.server.media.transforms import builtins as augment

        augment.use_native(False)
        _augment = (augment.color_jitter(**jobs.JITTER), augment.trivial_augment_wide())
    rng = np.random.default_rng(int(torch.randint(0, 2**62, ()).item()))
    sample = {"image": chw}
    for step in _augment:
        sample = step(sample, rng)
    image = sample["image"]
    return image if isinstance(image, torch.Tensor) else torch.from_numpy(image)


# (x / 255 - mean) / std as one multiply and one subtract per pixel and channel.
_SCALE = torch.tensor([1 / (255 * s) for s in jobs.STD]).view(3, 1, 1)
_SHIFT = torch.tensor([m / s for m, s in zip(jobs.MEAN, jobs.STD)]).view(3, 1, 1)


def run(config, meter, job: str, workers: int) -> str:
    import warnings

    from torch.utils.data import DataLoader

    # More workers than cores is the point of the 4-worker row; torch warns about it.
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    size = tuple(config.size)
    loader = DataLoader(_Images(config.paths, size, job), batch_size=config.batch_size,
                        num_workers=workers, persistent_workers=True)
    for _ in range(config.passes):
        for batch in loader:
            if meter.images == 0:
                jobs.check_batch(batch.shape, batch.dtype, size, job)
            meter.batch(int(batch.shape[0]))
    meter.stop()
    return f"{workers} worker processes, Pillow + torch ops"
