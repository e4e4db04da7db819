"""Batch-level augmentation on the trainer's side: mixup and cutmix over a delivered batch.

They pair each sample with its neighbour in the batch (the batch rolled by
one), as torchvision.transforms.v2.MixUp and CutMix do, with the same
formulas: mixup blends whole images with a weight lam ~ Beta(alpha, alpha);
cutmix pastes a box whose area is about 1 - lam of the image, and the labels
are mixed by the area actually pasted. They run with torch operations on
whatever device the batch is on (a cuda_ipc batch stays on the GPU).

Their random draws come from ``loader.batch_rng()``, a numpy generator seeded by
the loader's request seed, epoch, rank and the batch's place in the pass: a run
resumed from ``loader.state_dict()`` draws the same lam and box for the same
batch, and there is no global RNG state to save.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["cutmix", "mixup"]


def _targets(labels: torch.Tensor, num_classes: int, dtype: torch.dtype, lam: float
             ) -> torch.Tensor:
    """One-hot labels mixed with their rolled neighbours: lam * y + (1 - lam) * y_rolled."""
    if labels.dim() != 1:
        raise ValueError(f"labels must be int [N], got shape {list(labels.shape)}")
    one_hot = torch.nn.functional.one_hot(labels.long(), num_classes).to(dtype)
    return one_hot.roll(1, 0).mul_(1.0 - lam).add_(one_hot.mul(lam))


def _check(images: torch.Tensor, alpha: float) -> None:
    if not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    if images.dim() < 3:
        raise ValueError(f"images must be [N, ..., H, W], got shape {list(images.shape)}")


def mixup(images: torch.Tensor, labels: torch.Tensor, *, num_classes: int,
          rng: np.random.Generator, alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, targets): lam * x + (1 - lam) * x_rolled with lam ~ Beta(alpha, alpha), and
    the one-hot targets mixed alike (float, [N, num_classes]). ``images`` must be float
    (a blend of uint8 pixels would be rounded); ``rng``: ``loader.batch_rng()``."""
    _check(images, alpha)
    if not images.is_floating_point():
        raise TypeError(f"mixup blends pixels: give float images, got {images.dtype} "
                        f"(e.g. batch['image'].float().div_(255))")
    lam = float(rng.beta(alpha, alpha))
    mixed = images.roll(1, 0).mul_(1.0 - lam).add_(images.mul(lam))
    return mixed, _targets(labels.to(images.device), num_classes, images.dtype, lam)


def cutmix(images: torch.Tensor, labels: torch.Tensor, *, num_classes: int,
           rng: np.random.Generator, alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, targets): a box of each image replaced by the same box of its neighbour,
    its centre uniform over the image and its sides sqrt(1 - lam) of the image's
    (lam ~ Beta(alpha, alpha); clipped at the edges); the targets mixed by the area
    kept. Any dtype; images [N, ..., H, W] (NCHW; give NHWC batches permuted)."""
    _check(images, alpha)
    height, width = images.shape[-2:]
    lam = float(rng.beta(alpha, alpha))
    centre_x, centre_y = int(rng.integers(width)), int(rng.integers(height))
    r = 0.5 * math.sqrt(1.0 - lam)
    half_w, half_h = int(r * width), int(r * height)
    x1, y1 = max(centre_x - half_w, 0), max(centre_y - half_h, 0)
    x2, y2 = min(centre_x + half_w, width), min(centre_y + half_h, height)
    mixed = images.clone()
    mixed[..., y1:y2, x1:x2] = images.roll(1, 0)[..., y1:y2, x1:x2]
    kept = 1.0 - (x2 - x1) * (y2 - y1) / (width * height)
    dtype = images.dtype if images.is_floating_point() else torch.float32
    return mixed, _targets(labels.to(images.device), num_classes, dtype, kept)
