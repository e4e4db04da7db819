"""What each image becomes: per-sample geometry before scaling, one batch pass after.

Geometry is a crop box per sample: the window of the source, in source pixels
(top, left, height, width; floats, since a centre crop's box falls between
pixels), that is resized to the output. It is decided on the CPU from the
source size, and the decoder decodes and scales only that window (crop, then
scale). The random choices of a sample (crop box, flip) come from a generator
seeded with (seed, epoch, sample index): the same on every run, thread count
and resume, and ``OutputTransform.box`` gives the same box however often it is
asked.

Everything after the decode (x / 255, normalisation, dtype, layout; the flip
of video clips) is ``finish_slot``: torch operations on whichever device holds
the batch (the GPU with ``--device cuda:N``, the CPU otherwise), run once per
batch. Images are flipped by the decoder as it writes their row, at no cost: a
flip in the batch pass was three copies of the batch on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import OUTPUT_DTYPES, carrier_dtype

from .draws import FLIP, SampleDraws, sample_draws

__all__ = ["Box", "CropRule", "OutputTransform", "random_resized_crop_box"]

_DTYPES = {name: getattr(torch, name) for name in OUTPUT_DTYPES}


# (top, left, height, width) of the source window that becomes the output, in source pixels.
Box = tuple[float, float, float, float]
# (source height, source width) -> the Box of one sample; None means the whole image.
CropRule = Callable[[int, int], Box]


# Aspect ratios of random crops outside [1/100, 100] only make degenerate crops
# (a row of pixels scaled up a hundredfold). No real normalisation has a std under
# 1e-6, and a much smaller one overflows float32 in 1 / (255 std).
_MIN_RATIO = 0.01
_MIN_STD = 1e-6

def random_resized_crop_box(rng: SampleDraws | np.random.Generator, height: int, width: int,
                            scale: tuple[float, float], ratio: tuple[float, float]
                            ) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a crop as torchvision's RandomResizedCrop picks it.

    Ten tries at an area fraction in ``scale`` and a log-uniform aspect in
    ``ratio``; failing those, the largest centred crop within the ratio range.
    """
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, max(1, int(round(width / ratio[0])))
    elif in_ratio > ratio[1]:
        h, w = height, max(1, int(round(height * ratio[1])))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class OutputTransform:
    """One stream's OutputSpec, checked; ``ValueError`` names the field at fault."""

    def __init__(self, spec: feed_pb2.OutputSpec, seed: int, epoch: int, frames: int = 0):
        self.height, self.width = spec.height, spec.width
        self.frames = frames  # video: k frames per sample, each [3, H, W]; 0 for images
        self.resize = spec.resize
        if spec.resize not in feed_pb2.Resize.values():
            raise ValueError(f"output.resize: unknown value {spec.resize}")
        if spec.layout not in feed_pb2.Layout.values():
            raise ValueError(f"output.layout: unknown value {spec.layout}")
        self.seed, self.epoch = seed, epoch
        self.flip_probability = spec.flip_probability
        if not 0 <= spec.flip_probability <= 1:
            raise ValueError("output.flip_probability must be in [0, 1], "
                             f"got {spec.flip_probability}")
        # torchvision's and timm's evaluation default: floor(size / 0.875), 256 for 224
        # and 109 (not 110) for 96; 0.875 is 7 / 8, so integers say it exactly.
        self.shorter_side = spec.shorter_side or max(self.height, self.width) * 8 // 7
        if self.resize == feed_pb2.RESIZE_SHORTER_CENTER_CROP and \
                self.shorter_side < max(self.height, self.width):
            raise ValueError(f"output.shorter_side must be at least the output size, "
                             f"got {self.shorter_side} for {self.height}x{self.width}")
        self.scale = (spec.scale_min, spec.scale_max) if spec.scale_max else (0.08, 1.0)
        self.ratio = (spec.ratio_min, spec.ratio_max) if spec.ratio_max else (3 / 4, 4 / 3)
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"output.scale_min/scale_max must satisfy 0 < min <= max <= 1, "
                             f"got {self.scale}")
        if not _MIN_RATIO <= self.ratio[0] <= self.ratio[1] <= 1 / _MIN_RATIO:
            raise ValueError(f"output.ratio_min/ratio_max must satisfy {_MIN_RATIO:g} <= min "
                             f"<= max <= {1 / _MIN_RATIO:g}, got {self.ratio}")
        if spec.dtype and spec.dtype not in _DTYPES:
            raise ValueError(f"output.dtype must be one of {', '.join(_DTYPES)}, "
                             f"got {spec.dtype!r}")
        self.dtype = _DTYPES[spec.dtype or "uint8"]
        if bool(spec.mean) != bool(spec.std) or len(spec.mean) not in (0, 3) or \
                len(spec.std) not in (0, 3):
            raise ValueError("output.mean and output.std need three values each")
        if not all(math.isfinite(m) for m in spec.mean):
            raise ValueError(f"output.mean must be finite, got {list(spec.mean)}")
        if not all(_MIN_STD <= s < math.inf for s in spec.std):
            raise ValueError(f"output.std must be finite and at least {_MIN_STD:g}, "
                             f"got {list(spec.std)}")
        for name, values in (("mean", spec.mean), ("std", spec.std)):
            if any(v > 1 for v in values):  # 0-255 values would put every output near -2
                raise ValueError(f"output.{name} must be at most 1, got {list(values)}: mean and "
                                 f"std are in units of x/255: for 0-255 values divide by 255")
        if spec.mean and self.dtype == torch.uint8:
            raise ValueError("output.mean/std need a float output.dtype")
        self.mean, self.std = list(spec.mean), list(spec.std)
        self._affines: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.channels_last = spec.layout == feed_pb2.LAYOUT_NHWC
        # The decoder writes uint8 NCHW; anything else needs a region of its own.
        self.converts = self.dtype != torch.uint8 or self.channels_last

    @property
    def has_batch_pass(self) -> bool:
        """Whether ``finish_slot`` does anything: a conversion, or flips of video clips."""
        return self.converts or bool(self.flip_probability and self.frames)

    @property
    def random(self) -> bool:
        return self.resize == feed_pb2.RESIZE_RANDOM_RESIZED_CROP or self.flip_probability > 0

    @property
    def image_dtype(self) -> np.dtype:
        return carrier_dtype(str(self.dtype).removeprefix("torch."))  # bfloat16: uint16 bits

    @property
    def image_shape(self) -> tuple[int, ...]:
        frame = (self.height, self.width, 3) if self.channels_last else (3, self.height, self.width)
        return (self.frames, *frame) if self.frames else frame

    @property
    def decoded_shape(self) -> tuple[int, ...]:
        frame = (3, self.height, self.width)
        return (self.frames, *frame) if self.frames else frame

    def choose(self, index: int) -> tuple[CropRule | None, bool]:
        """(crop rule, flip) for sample ``index``; the rule maps (src_h, src_w) to its Box,
        None (squash) keeps the whole image."""
        crop = None if self.resize == feed_pb2.RESIZE_SQUASH else \
            lambda src_h, src_w: self.box(index, src_h, src_w)
        flip = bool(self.flip_probability and sample_draws(self.seed, self.epoch, index, FLIP)
                    .random() < self.flip_probability)
        return crop, flip

    def box(self, index: int, src_h: int, src_w: int) -> Box:
        """The source window sample ``index`` keeps (whole image for squash)."""
        if self.resize == feed_pb2.RESIZE_SQUASH:
            return 0, 0, src_h, src_w
        if self.resize == feed_pb2.RESIZE_SHORTER_CENTER_CROP:
            return self._centre(src_h, src_w)
        return random_resized_crop_box(sample_draws(self.seed, self.epoch, index), src_h, src_w,
                                       self.scale, self.ratio)

    def _centre(self, src_h: int, src_w: int) -> Box:
        """The window that resizing the shorter side to ``shorter_side`` and cutting the
        centre H x W out of that shows, in source pixels: the same pixels, one resize."""
        short = self.shorter_side
        if src_h <= src_w:
            scaled_h, scaled_w = short, int(short * src_w / src_h)
        else:
            scaled_h, scaled_w = int(short * src_h / src_w), short
        top = int(round((scaled_h - self.height) / 2.0))
        left = int(round((scaled_w - self.width) / 2.0))
        sy, sx = src_h / scaled_h, src_w / scaled_w
        return top * sy, left * sx, self.height * sy, self.width * sx

    def finish_slot(self, arrays: dict[str, torch.Tensor], rows: int) -> None:
        """The batch pass over a slot's first ``rows`` rows: flip (video clips; images
        arrive flipped), scale to [0, 1], normalise, cast, lay out, into ``arrays["image"]``.

        ``arrays`` are the slot's BatchLayout views as tensors, on the host or
        (cuda_ipc) on the device after the copy: the same code for both. The
        decoder's uint8 [n, 3, H, W] (video: [n, k, 3, H, W]) is in
        ``arrays["decoded"]``, or in ``image`` itself when nothing but flips is
        asked; ``arrays["flip"]`` is bool [n].
        """
        image = arrays["image"][:rows]
        decoded = arrays["decoded"][:rows] if "decoded" in arrays else image
        if self.flip_probability and self.frames:  # no data-dependent branch: no device sync
            mask = arrays["flip"][:rows].view(-1, *[1] * (decoded.dim() - 1))
            decoded.copy_(torch.where(mask, decoded.flip(-1), decoded))
        if not self.converts:
            return
        x = decoded
        if self.dtype != torch.uint8:
            x = x.to(torch.float32)
            if self.mean:
                scale, shift = self._affine(x.device)
                # (x / 255 - mean) / std, into x's own float32 copy: a second [n, 3, H, W]
                # float32 allocation per batch cost ~2.5x this whole pass in CPU time
                torch.addcmul(shift, x, scale, out=x)
            else:
                x = x.mul_(1 / 255)
        target = image.view(self.dtype) if self.dtype == torch.bfloat16 else image
        target.copy_(x.movedim(-3, -1) if self.channels_last else x)

    def _affine(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(1 / (255 std), -mean / std) on ``device``, made once: made per batch, the
        copy from pageable host memory would make the host wait for the GPU."""
        affine = self._affines.get(device)
        if affine is None:
            std = torch.tensor(self.std).view(3, 1, 1)
            mean = torch.tensor(self.mean).view(3, 1, 1)
            affine = (1 / (255 * std)).to(device), (-mean / std).to(device)
            self._affines[device] = affine
        return affine
