"""The jobs an image row does, and the numbers every peer's pipeline for a job shares.

Each image row runs one job, in its own loader's best way:

- ``squash``: the whole image to H x W, uint8 (no augmentation).
- ``train-u8``: training, random-resized-crop (area ``SCALE``, aspect ``RATIO``,
  torchvision's ImageNet recipe) to H x W, then a horizontal flip with
  probability ``FLIP``, uint8.
- ``train-f16``: the same, normalised (x / 255 - ``MEAN``) / ``STD``, float16.
- ``train-aug``: ``train-u8``, then torchvision's ColorJitter(``JITTER``) and
  TrivialAugmentWide on each image (gpufeed: its built-in sample transforms).
- ``train-pyloop``: ``train-u8``, then a pure-Python transform that holds the GIL
  (bench/gil_plugin.py): gpufeed on its decode threads against in worker processes.
- ``eval``: evaluation, shorter side to ``shorter_side(size)`` (256 for 224),
  the centre H x W: the same pixels as scaling the centre box of
  H * s / 256 x W * s / 256 source pixels (s the source's shorter side) to H x W.

``check_batch`` makes every row prove, on its first batch, that it delivers
what the job asks for, so a row cannot look fast by doing less.
"""

from __future__ import annotations

import math

__all__ = ["AUGMENT", "FLIP", "JITTER", "JOBS", "MEAN", "RATIO", "SCALE", "STD", "centre_box",
           "check_batch", "random_box", "shorter_side"]

# Job -> its title in the table.
JOBS = {
    "squash": "squash: the whole image to H x W, uint8",
    "train-u8": "training: random-resized-crop + flip, uint8",
    "train-f16": "training: random-resized-crop + flip, normalised float16",
    "train-aug": "training: random-resized-crop + flip + ColorJitter + TrivialAugmentWide, uint8",
    "train-pyloop": "training: random-resized-crop + flip + a GIL-holding pure-Python transform, "
                    "uint8",
    "eval": "evaluation: shorter side 256, centre 224, uint8",
}
SCALE = (0.08, 1.0)  # the crop's share of the image's area
RATIO = (3 / 4, 4 / 3)  # the crop's width / height
FLIP = 0.5
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# torchvision's ColorJitter arguments in the train-aug job (a common ImageNet recipe's).
JITTER = {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1}
AUGMENT = [("color_jitter", JITTER), ("trivial_augment_wide", {})]


def shorter_side(size: tuple[int, int]) -> int:
    """The evaluation's shorter side for an output ``size``: 256 for 224 (8 / 7 of it)."""
    return round(min(size) * 8 / 7)


def centre_box(width: int, height: int, size: tuple[int, int]) -> tuple[float, float, float, float]:
    """The evaluation's source box (left, top, box width, box height) in a width x height image.

    Scaling the shorter side to ``shorter_side(size)`` and keeping the centre
    ``size`` keeps exactly this box of the source.
    """
    scale = min(width, height) / shorter_side(size)
    box_height, box_width = size[0] * scale, size[1] * scale
    return (width - box_width) / 2, (height - box_height) / 2, box_width, box_height


def random_box(width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, width, height) of a random-resized-crop box in a width x height image,
    sampled as torchvision's ``RandomResizedCrop.get_params`` does, from torch's generator
    (which DataLoader seeds differently in each worker)."""
    import torch

    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * torch.empty(()).uniform_(*SCALE).item()
        aspect = math.exp(torch.empty(()).uniform_(*log_ratio).item())
        box_width = round(math.sqrt(target * aspect))
        box_height = round(math.sqrt(target / aspect))
        if 0 < box_width <= width and 0 < box_height <= height:
            top = int(torch.randint(0, height - box_height + 1, ()).item())
            left = int(torch.randint(0, width - box_width + 1, ()).item())
            return left, top, box_width, box_height
    # No try fitted: the centre, at the allowed aspect nearest the image's.
    aspect = min(max(width / height, RATIO[0]), RATIO[1])
    if width / height < aspect:  # too tall: full width
        box_width, box_height = width, round(width / aspect)
    else:  # too wide, or allowed as it is: full height
        box_width, box_height = round(height * aspect), height
    return (width - box_width) // 2, (height - box_height) // 2, box_width, box_height


def check_batch(shape, dtype, size: tuple[int, int], job: str) -> None:
    """Raise unless a batch is N images of ``size``, NCHW or NHWC, in the job's dtype."""
    want = "float16" if job == "train-f16" else "uint8"
    got = str(dtype).removeprefix("torch.")  # torch's dtypes print as torch.uint8, numpy's as uint8
    height, width = size
    shape = tuple(int(x) for x in shape)
    if got != want or shape[1:] not in ((3, height, width), (height, width, 3)):
        raise RuntimeError(f"the {job} job wants [N, 3, {height}, {width}] or [N, {height}, "
                           f"{width}, 3] {want}; the row delivered {list(shape)} {got}")
