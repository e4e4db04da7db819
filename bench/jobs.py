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

__all__ = ["AUGMENT", "FLIP", "JITTER", "JOBS", "MEAN", "RATIO", "SCALE", "STD", "centre_box",
           "check_batch", "shorter_side"]

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


def check_batch(shape, dtype, size: tuple[int, int], job: str) -> None:
    """Raise unless a batch is N images of ``size``, NCHW or NHWC, in the job's dtype."""
    want = "float16" if job == "train-f16" else "uint8"
    got = str(dtype).removeprefix("torch.")  # torch's dtypes print as torch.uint8, numpy's as uint8
    height, width = size
    shape = tuple(int(x) for x in shape)
    if got != want or shape[1:] not in ((3, height, width), (height, width, 3)):
        raise RuntimeError(f"the {job} job wants [N, 3, {height}, {width}] or [N, {height}, "
                           f"{width}, 3] {want}; the row delivered {list(shape)} {got}")
