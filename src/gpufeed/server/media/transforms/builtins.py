"""The built-in sample transforms, written as a plugin like any other (registry.py).

``color_jitter``, ``trivial_augment_wide`` and ``random_erasing`` take
torchvision.transforms.v2's parameters, with its ranges and defaults, and
compute its formulas for uint8 images. The kernels below are torch operations
(torchvision's own: one float32 tensor per step, uint8 -> float -> uint8 per
operation) and, where the extension is built, C (_augment.c: the same float32
operations in the same order, pixel by pixel on the uint8 planes, the GIL
released), which take over from torch for uint8 CPU images: the same pixels
at a fraction of the CPU (bench/RESULTS.md, "Sample transforms"; ``use_native``
switches between the two). The one difference: warps (rotate, shear) map pixels in double in C,
float32 in torch, so a sample point on a pixel's edge may round either way.
Their random draws follow torchvision's distributions, taken
from the sample's generator rather than torch's global one, so a pass is
reproducible and resumable; the pixels for given parameters (factors, an
operation and its magnitude, a box) are torchvision's (tests/test_builtin_transforms.py
checks them against references written from its formulas).

Not offered: TrivialAugmentWide's bilinear interpolation (nearest only, its
default) and RandomErasing's ``value="random"`` (normal noise, meaningful for
float images only; rows here are uint8).

Where torchvision leaves a parameter unbounded, a request is bounded here, so
that every per-sample draw and kernel is finite and what a factory allocates
is small: ColorJitter's factors at most ``_MAX_FACTOR``, TrivialAugmentWide's
``num_magnitude_bins`` at most ``_MAX_BINS`` (its magnitude table, 11
operations x bins float32, is then at most 11 KiB), RandomErasing's ``ratio``
within ``_RATIO_RANGE``; lists have their length (a pair, one value or one
per channel) checked before their items.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.functional import conv2d, grid_sample

from .registry import SampleFn, register

try:
    from . import _augment
except ImportError:  # built without the C kernels: the torch path does all
    _augment = None

__all__ = ["NATIVE_BUILT", "adjust_brightness", "adjust_contrast", "adjust_hue",
           "adjust_saturation", "adjust_sharpness", "affine", "autocontrast", "equalize",
           "posterize", "rotate", "solarize", "use_native"]

_GRAY = (0.2989, 0.587, 0.114)  # torchvision's (ITU-R 601) luma weights
# ColorJitter's largest brightness, contrast or saturation factor: at 255 one level of
# difference already spans the whole uint8 range (torchvision's own examples stay under 2).
_MAX_FACTOR = 255.0
# TrivialAugmentWide's most magnitude bins: a uint8 image tells at most 256 magnitudes of an
# operation apart (256 solarize thresholds, colour factors 0.004 apart moving a pixel by about
# a level, translations of whole pixels in 0..32, 7 posterize bit counts); torchvision's
# default is 31.
_MAX_BINS = 256
# RandomErasing's aspect ratios (h / w): torchvision's (0.3, 3.3) and far beyond; the bound
# of a random crop's (output.py): outside it a box is a row of pixels.
_RATIO_RANGE = (0.01, 100.0)

NATIVE_BUILT = _augment is not None
_native: Any = _augment  # the C module while the C kernels are on, else None


def use_native(enabled: bool) -> None:
    """Run the kernels in C (the default where the extension is built) or as torch
    operations (torchvision's own, one float32 tensor per step): the bench's DataLoader
    peer runs the latter, as a torchvision user would; tests check the two agree."""
    global _native
    if enabled and _augment is None:
        raise RuntimeError("the C kernels (gpufeed.server.media.transforms._augment) are not built")
    _native = _augment if enabled else None


def _native_takes(image: torch.Tensor, rgb: bool = False) -> bool:
    """Whether the C kernels take ``image``: built and on, uint8 [..., C, H, W] on the CPU
    (C == 3 if ``rgb``)."""
    return (_native is not None and image.dtype == torch.uint8 and image.dim() >= 3
            and image.device.type == "cpu" and (not rgb or image.shape[-3] == 3))


def _run_native(kernel: Callable[..., None], image: torch.Tensor, layout: str,
                *args: object) -> torch.Tensor:
    """``kernel`` over ``image`` [..., C, H, W] into a new tensor, the shape given as
    ``layout`` says: "images" (images, C, H * W), "planes" (planes, 1, H * W), "rows"
    (planes, H, W), "warp" (images, C, H, W)."""
    src = image.contiguous()
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    channels, height, width = src.shape[-3:]
    planes = src.numel() // max(height * width, 1)
    shape = {"images": (planes // max(channels, 1), channels, height * width),
             "planes": (planes, 1, height * width), "rows": (planes, height, width),
             "warp": (planes // max(channels, 1), channels, height, width)}[layout]
    kernel(src.numpy(), out.numpy(), *shape, *args)
    return out


# --- kernels: uint8 [..., 3, H, W] in, uint8 out ------------------------------------------------

def _to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Clamp to [0, 255] and truncate, as torchvision's blends do."""
    return x.clamp_(0, 255).to(torch.uint8)


def _blend(image: torch.Tensor, other: torch.Tensor, factor: float) -> torch.Tensor:
    return _to_uint8(image.mul(factor).add_(other, alpha=1.0 - factor))


def _gray(image: torch.Tensor) -> torch.Tensor:
    """Luma as float [..., 1, H, W], floored (integer images)."""
    r, g, b = image.unbind(-3)
    luma = r.mul(_GRAY[0]).add_(g, alpha=_GRAY[1]).add_(b, alpha=_GRAY[2])
    return luma.floor_().unsqueeze(-3)


def adjust_brightness(image: torch.Tensor, factor: float) -> torch.Tensor:
    if _native_takes(image):
        return _run_native(_native.brightness, image, "images", factor)
    return _to_uint8(image.mul(factor))


def adjust_saturation(image: torch.Tensor, factor: float) -> torch.Tensor:
    if _native_takes(image, rgb=True):
        return _run_native(_native.saturation, image, "images", factor)
    return _blend(image, _gray(image), factor)


def adjust_contrast(image: torch.Tensor, factor: float) -> torch.Tensor:
    if _native_takes(image, rgb=True):
        return _run_native(_native.contrast, image, "images", factor)
    return _blend(image, _gray(image).mean(dim=(-3, -2, -1), keepdim=True), factor)


def adjust_hue(image: torch.Tensor, factor: float) -> torch.Tensor:
    """Rotate the hue by ``factor`` turns, through HSV in float32, as torchvision."""
    if _native_takes(image, rgb=True):
        return _run_native(_native.hue, image, "images", factor)
    x = image.to(torch.float32).mul_(1.0 / 255)
    h, s, v = _hsv(x)
    h = h.add_(factor).remainder_(1.0)
    return _rgb(h, s, v).mul_(255 + 1.0 - 1e-3).to(torch.uint8)


def _hsv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r, g, b = x.unbind(-3)
    low, high = torch.aminmax(x, dim=-3)
    grey = high == low
    spread = high - low
    ones = torch.ones_like(high)
    s = spread / torch.where(grey, ones, high)
    divisor = torch.where(grey, ones, spread)
    rc, gc, bc = ((high.unsqueeze(-3) - x) / divisor.unsqueeze(-3)).unbind(-3)
    red_max = high == r
    green_max = (high == g) & ~red_max
    blue_max = ~red_max & ~green_max
    h = (bc - gc) * red_max + (rc + 2.0 - bc) * green_max + (gc + 4.0 - rc) * blue_max
    h = h.mul_(1.0 / 6.0).add_(1.0).fmod_(1.0)
    return h, s, high


def _rgb(h: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    h6 = h * 6
    sector = torch.floor(h6)
    f = h6 - sector
    sector = sector.to(torch.int32).remainder_(6)
    p = ((1.0 - s) * v).clamp_(0.0, 1.0)
    q = ((1.0 - s * f) * v).clamp_(0.0, 1.0)
    t = ((s * f + (1.0 - s)) * v).clamp_(0.0, 1.0)
    candidates = torch.stack((v, p, q, t), dim=-3)
    # Which of (v, p, q, t) each channel takes in each of the six sectors.
    pick = torch.tensor([[0, 2, 1, 1, 3, 0], [3, 0, 0, 2, 1, 1], [1, 1, 3, 0, 0, 2]])
    index = pick[:, sector.long()]
    if index.dim() > 3:
        index = index.moveaxis(0, -3)
    return candidates.gather(-3, index)


def adjust_sharpness(image: torch.Tensor, factor: float) -> torch.Tensor:
    """Blend with a 3x3 smoothing (centre 5/13, ring 1/13) inside a one-pixel border."""
    channels, height, width = image.shape[-3:]
    if height <= 2 or width <= 2:
        return image
    if _native_takes(image):
        return _run_native(_native.sharpness, image, "rows", factor)
    shape = image.shape
    x = image.reshape(-1, channels, height, width).to(torch.float32)
    a, b = 1.0 / 13.0, 5.0 / 13.0
    kernel = torch.tensor([[a, a, a], [a, b, a], [a, a, a]]).expand(channels, 1, 3, 3)
    smooth = conv2d(x, kernel, groups=channels).round_()
    inner = x[..., 1:-1, 1:-1]
    inner.add_(smooth.sub_(inner), alpha=1.0 - factor)
    return _to_uint8(x).reshape(shape)


def posterize(image: torch.Tensor, bits: int) -> torch.Tensor:
    return image if bits >= 8 else image & (((1 << bits) - 1) << (8 - bits))


def solarize(image: torch.Tensor, threshold: float) -> torch.Tensor:
    return torch.where(image >= threshold, image.bitwise_not(), image)


def autocontrast(image: torch.Tensor) -> torch.Tensor:
    if _native_takes(image):
        return _run_native(_native.autocontrast, image, "planes")
    x = image.to(torch.float32)
    low = x.amin(dim=(-2, -1), keepdim=True)
    high = x.amax(dim=(-2, -1), keepdim=True)
    flat = high == low
    scale = (high - low).mul_(1.0 / 255)
    low[flat], scale[flat] = 0.0, 1.0
    return x.sub_(low).div_(scale).clamp_(0, 255).to(torch.uint8)


def equalize(image: torch.Tensor) -> torch.Tensor:
    """Per-channel histogram equalisation with Pillow's lookup table, as torchvision."""
    if _native_takes(image):
        return _run_native(_native.equalize, image, "planes")
    shape = image.shape[:-2]
    flat = image.flatten(-2).long()
    hist = torch.zeros(*shape, 256, dtype=torch.int32)
    hist.scatter_add_(-1, flat, torch.ones_like(flat, dtype=torch.int32))
    cum = hist.cumsum(-1)
    top = cum.argmax(-1, keepdim=True)  # the last level present
    step = (flat.shape[-1] - hist.gather(-1, top)).div(255, rounding_mode="floor")
    lut = (cum[..., :-1] + step // 2).div(step.clamp(min=1), rounding_mode="floor")
    lut = torch.cat([torch.zeros(*shape, 1, dtype=lut.dtype), lut.clamp_(0, 255)], -1)
    out = lut.to(torch.uint8).gather(-1, flat).view_as(image)
    return torch.where(step.unsqueeze(-1) != 0, out, image)


def _inverse_affine(center: tuple[float, float], angle: float, translate: tuple[float, float],
                    shear: tuple[float, float]) -> list[float]:
    """Output pixel -> input pixel, (x, y) about ``center`` (unit scale), as torchvision:
    the inverse of T * C * R(angle) * ShY * ShX * C^-1."""
    rot = math.radians(angle)
    sx, sy = math.radians(shear[0]), math.radians(shear[1])
    cx, cy = center
    tx, ty = translate
    a = math.cos(rot - sy) / math.cos(sy)
    b = -math.cos(rot - sy) * math.tan(sx) / math.cos(sy) - math.sin(rot)
    c = math.sin(rot - sy) / math.cos(sy)
    d = -math.sin(rot - sy) * math.tan(sx) / math.cos(sy) + math.cos(rot)
    m = [d, -b, 0.0, -c, a, 0.0]  # det [[a, b], [c, d]] is 1
    m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty) + cx
    m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty) + cy
    return m


def _warp(image: torch.Tensor, matrix: list[float], fill: list[float] | None) -> torch.Tensor:
    """Nearest-neighbour resampling of ``image`` through ``matrix`` (output -> input,
    about the image's centre); outside the image: ``fill``, or zeros. The C kernel maps
    pixels in double where torch's grid is float32: a point on a pixel's edge may round
    to the other neighbour (tests/test_builtin_transforms.py counts them)."""
    if _native_takes(image) and (fill is None or len(fill) in (1, image.shape[-3])):
        pixels = None
        if fill is not None:  # what the torch path's round_() makes of the fill
            values = torch.tensor(fill).round_().to(torch.uint8).expand(image.shape[-3])
            pixels = bytes(values.tolist())
        return _run_native(_native.warp, image, "warp", tuple(matrix), pixels)
    height, width = image.shape[-2:]
    shape = image.shape
    x = image.reshape(-1, *shape[-3:]).to(torch.float32)
    theta = torch.tensor(matrix, dtype=torch.float32).reshape(1, 2, 3)
    base = torch.empty(1, height, width, 3)
    base[..., 0].copy_(torch.linspace((1.0 - width) * 0.5, (width - 1.0) * 0.5, width))
    base[..., 1].copy_(torch.linspace((1.0 - height) * 0.5, (height - 1.0) * 0.5,
                                      height).unsqueeze_(-1))
    base[..., 2].fill_(1)
    scaled = theta.transpose(1, 2).div_(torch.tensor([0.5 * width, 0.5 * height]))
    grid = base.view(1, -1, 3).bmm(scaled).view(1, height, width, 2).expand(x.shape[0], -1, -1, -1)
    if fill is not None:
        x = torch.cat((x, torch.ones_like(x[:, :1])), dim=1)
    x = grid_sample(x, grid, mode="nearest", padding_mode="zeros", align_corners=False)
    if fill is not None:
        x, inside = x[:, :-1], x[:, -1:]
        x = torch.where(inside < 0.5, torch.tensor(fill).view(1, -1, 1, 1).expand_as(x), x)
    return x.round_().to(torch.uint8).reshape(shape)


def affine(image: torch.Tensor, angle: float = 0.0, translate: tuple[float, float] = (0, 0),
           shear: tuple[float, float] = (0.0, 0.0), center: tuple[float, float] | None = None,
           fill: list[float] | None = None) -> torch.Tensor:
    """torchvision's affine (unit scale, nearest); ``center`` in pixels, default the middle."""
    height, width = image.shape[-2:]
    about = (0.0, 0.0) if center is None else (center[0] - width * 0.5, center[1] - height * 0.5)
    return _warp(image, _inverse_affine(about, angle, (float(translate[0]), float(translate[1])),
                                        shear), fill)


def rotate(image: torch.Tensor, angle: float, fill: list[float] | None = None) -> torch.Tensor:
    """Counter-clockwise by ``angle`` degrees about the centre, the size kept (nearest)."""
    angle %= 360
    if angle == 0:
        return image.clone()
    if angle == 180:
        return torch.rot90(image, 2, (-2, -1))
    if image.shape[-1] == image.shape[-2] and angle in (90, 270):
        return torch.rot90(image, 1 if angle == 90 else 3, (-2, -1))
    return _warp(image, _inverse_affine((0.0, 0.0), -angle, (0.0, 0.0), (0.0, 0.0)), fill)


# --- the transforms -----------------------------------------------------------------------------

def _factor_range(name: str, value: float | list[float], centre: float,
                  bounds: tuple[float, float]) -> tuple[float, float] | None:
    """torchvision's ColorJitter ranges: a number v is [centre - v, centre + v] (v >= 0;
    factors' low end at least 0); a pair is itself, within ``bounds``.
    None: the identity range, skipped."""
    if isinstance(value, (int, float)):
        if not value >= 0:  # NaN too
            raise ValueError(f"{name} must be non-negative, got {value}")
        low, high = centre - value, centre + value
        if bounds[0] == 0:  # factors: [max(0, 1 - v), 1 + v]
            low = max(low, 0.0)
    elif len(value) == 2:
        low, high = float(value[0]), float(value[1])
    else:
        raise ValueError(f"{name} must be a number or [min, max], got {value}")
    if not bounds[0] <= low <= high <= bounds[1]:
        raise ValueError(f"{name} values must satisfy {bounds[0]:g} <= min <= max <= "
                         f"{bounds[1]:g}, got [{low:g}, {high:g}]")
    return None if low == high == centre else (low, high)


@register("color_jitter")
def color_jitter(brightness: float | list[float] = 0.0, contrast: float | list[float] = 0.0,
                 saturation: float | list[float] = 0.0,
                 hue: float | list[float] = 0.0) -> SampleFn:
    """torchvision.transforms.v2.ColorJitter: the four adjustments, each with a factor drawn
    uniformly from its range, in a random order; factors at most ``_MAX_FACTOR``."""
    factors = (0.0, _MAX_FACTOR)
    ranges = [_factor_range("brightness", brightness, 1.0, factors),
              _factor_range("contrast", contrast, 1.0, factors),
              _factor_range("saturation", saturation, 1.0, factors),
              _factor_range("hue", hue, 0.0, (-0.5, 0.5))]
    kernels = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)

    def apply(sample: dict, rng: np.random.Generator) -> dict:
        order = rng.permutation(4)
        drawn = [None if r is None else float(rng.uniform(*r)) for r in ranges]
        image = torch.as_tensor(sample["image"])
        for i in order:
            if drawn[i] is not None:
                image = kernels[i](image, drawn[i])
        sample["image"] = image
        return sample

    return apply


def _linspace(low: float, high: float, bins: int) -> np.ndarray:
    return torch.linspace(low, high, bins).numpy()  # float32 steps, as torchvision's


# TrivialAugmentWide's operations: (name, magnitudes for ``bins`` bins or None, signed).
_WIDE_OPS = (
    ("Identity", lambda bins: None, False),
    ("ShearX", lambda bins: _linspace(0.0, 0.99, bins), True),
    ("ShearY", lambda bins: _linspace(0.0, 0.99, bins), True),
    ("TranslateX", lambda bins: _linspace(0.0, 32.0, bins), True),
    ("TranslateY", lambda bins: _linspace(0.0, 32.0, bins), True),
    ("Rotate", lambda bins: _linspace(0.0, 135.0, bins), True),
    ("Brightness", lambda bins: _linspace(0.0, 0.99, bins), True),
    ("Color", lambda bins: _linspace(0.0, 0.99, bins), True),
    ("Contrast", lambda bins: _linspace(0.0, 0.99, bins), True),
    ("Sharpness", lambda bins: _linspace(0.0, 0.99, bins), True),
    ("Posterize", lambda bins: (8 - (torch.arange(bins) / ((bins - 1) / 6))).round().int()
     .numpy(), False),
    ("Solarize", lambda bins: _linspace(1.0, 0.0, bins), False),
    ("AutoContrast", lambda bins: None, False),
    ("Equalize", lambda bins: None, False),
)
def apply_wide_op(image: torch.Tensor, op: str, magnitude: float,
                  fill: list[float] | None = None) -> torch.Tensor:
    """One of TrivialAugmentWide's operations at ``magnitude``, as torchvision applies it."""
    if op == "Identity":
        return image
    if op in ("ShearX", "ShearY"):
        degrees = math.degrees(math.atan(magnitude))
        shear = (degrees, 0.0) if op == "ShearX" else (0.0, degrees)
        return affine(image, shear=shear, center=(0.0, 0.0), fill=fill)
    if op == "TranslateX":
        return affine(image, translate=(int(magnitude), 0), fill=fill)
    if op == "TranslateY":
        return affine(image, translate=(0, int(magnitude)), fill=fill)
    if op == "Rotate":
        return rotate(image, magnitude, fill=fill)
    colour = {"Brightness": adjust_brightness, "Color": adjust_saturation,
              "Contrast": adjust_contrast, "Sharpness": adjust_sharpness}.get(op)
    if colour is not None:
        return colour(image, 1.0 + magnitude)
    if op == "Posterize":
        return posterize(image, int(magnitude))
    if op == "Solarize":
        return solarize(image, 255.0 * magnitude)
    if op == "AutoContrast":
        return autocontrast(image)
    if op == "Equalize":
        return equalize(image)
    raise ValueError(f"no operation {op!r}")


def _pixel_values(name: str, value: float | Sequence[float], counts: tuple[int, ...]
                  ) -> list[float]:
    """``value``, one number or a list of ``counts`` numbers, each in [0, 255] (uint8
    pixels); ValueError naming ``name`` otherwise (the length checked first)."""
    number = isinstance(value, (int, float))
    values = [value] if number else value
    # The length before the items (a list may be long); NaN and infinities fail the range.
    if not (number or len(values) in counts) or not all(0 <= v <= 255 for v in values):
        shown = value if len(values) <= 8 else f"a list of {len(values)}"
        raise ValueError(f"{name} must be a number or a list of {' or '.join(map(str, counts))} "
                         f"numbers in [0, 255] (uint8 pixels), got {shown}")
    return [float(v) for v in values]


def _fill(fill: float | list[float] | None) -> list[float] | None:
    if fill is None:
        return None
    values = _pixel_values("fill", fill, (3,))
    return values * 3 if len(values) == 1 else values


@register("trivial_augment_wide", moves_image=True)
def trivial_augment_wide(num_magnitude_bins: int = 31,
                         fill: float | list[float] | None = None) -> SampleFn:
    """torchvision.transforms.v2.TrivialAugmentWide: one operation drawn uniformly, at a
    magnitude drawn uniformly from its bins, negated half the time for signed ones."""
    if not 2 <= num_magnitude_bins <= _MAX_BINS:
        raise ValueError(f"num_magnitude_bins must be in 2..{_MAX_BINS} (a uint8 image tells "
                         f"no more magnitudes apart), got {num_magnitude_bins}")
    pixels = _fill(fill)
    table = [(name, magnitudes(num_magnitude_bins), signed) for name, magnitudes, signed
             in _WIDE_OPS]

    def apply(sample: dict, rng: np.random.Generator) -> dict:
        op, magnitudes, signed = table[int(rng.integers(len(table)))]
        magnitude = 0.0
        if magnitudes is not None:
            magnitude = float(magnitudes[int(rng.integers(num_magnitude_bins))])
            if signed and rng.random() <= 0.5:
                magnitude = -magnitude
        sample["image"] = apply_wide_op(torch.as_tensor(sample["image"]), op, magnitude, pixels)
        return sample

    return apply


def erasing_box(rng: np.random.Generator, height: int, width: int, scale: tuple[float, float],
                ratio: tuple[float, float]) -> tuple[int, int, int, int] | None:
    """(top, left, h, w) of RandomErasing's box: ten tries at an area fraction in ``scale``
    and a log-uniform aspect (h / w) in ``ratio`` that fits inside; None if none did."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        erase_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        h = int(round(math.sqrt(erase_area * aspect)))
        w = int(round(math.sqrt(erase_area / aspect)))
        if h < height and w < width:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    return None


@register("random_erasing")
def random_erasing(p: float = 0.5, scale: Sequence[float] = (0.02, 0.33),
                   ratio: Sequence[float] = (0.3, 3.3),
                   value: float | Sequence[float] = 0) -> SampleFn:
    """torchvision.transforms.v2.RandomErasing: with probability ``p``, a box of random area
    and aspect is set to ``value`` (one number, or one per channel)."""
    if not 0 <= p <= 1:
        raise ValueError(f"p must be in [0, 1], got {p}")
    if len(scale) != 2 or not 0 <= scale[0] <= scale[1] <= 1:
        raise ValueError(f"scale must be [min, max] with 0 <= min <= max <= 1, got {list(scale)}")
    low, high = _RATIO_RANGE
    if len(ratio) != 2 or not low <= ratio[0] <= ratio[1] <= high:
        raise ValueError(f"ratio must be [min, max] with {low:g} <= min <= max <= {high:g}, "
                         f"got {list(ratio)}")
    values = _pixel_values("value", value, (1, 3))
    fill = torch.tensor(values, dtype=torch.float64).to(torch.uint8).view(-1, 1, 1)
    box_scale, box_ratio = (float(scale[0]), float(scale[1])), (float(ratio[0]), float(ratio[1]))

    def apply(sample: dict, rng: np.random.Generator) -> dict:
        if rng.random() >= p:
            return sample
        image = torch.as_tensor(sample["image"])  # the row itself, erased in place
        box = erasing_box(rng, image.shape[-2], image.shape[-1], box_scale, box_ratio)
        if box is not None:
            top, left, h, w = box
            image[..., top:top + h, left:left + w] = fill
        sample["image"] = image
        return sample

    return apply
