"""``Output``: what each sample becomes, as one value a trainer can name and reuse.

The output options (size, resize, crops, flips, dtype, normalisation, layout,
video clips) are twelve of ``FeedClient.loader()``'s keywords; grouped, a
training and an evaluation loader read as the two outputs they differ by:

    train = Output(size=224, resize="random_resized_crop", flip=0.5)
    val = Output(size=224, resize="center_crop")
    feed.loader("train.flist", batch_size=256, output=train, shuffle=True)

The same fields are accepted as flat keywords of ``loader()`` (``size=224``),
which is what scripts written before ``Output`` use; giving both is an error.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from gpufeed.v1 import feed_pb2

__all__ = ["Output"]

_Enum = TypeVar("_Enum")  # a feed_pb2 enum type

_RESIZES = {"squash": feed_pb2.RESIZE_SQUASH, "center_crop": feed_pb2.RESIZE_SHORTER_CENTER_CROP,
            "random_resized_crop": feed_pb2.RESIZE_RANDOM_RESIZED_CROP}
_LAYOUTS = {"NCHW": feed_pb2.LAYOUT_NCHW, "NHWC": feed_pb2.LAYOUT_NHWC}


@dataclass(frozen=True)
class Output:
    """What each sample becomes; the defaults are the server's (squash, uint8, NCHW).

    Args:
        size: (height, width), or one int for a square; None for array files,
            which keep their own shapes.
        resize: "squash" (to exactly ``size``), "center_crop" (evaluation: the
            shorter side to ``shorter_side``, then the centre) or
            "random_resized_crop" (training, within ``scale`` and ``ratio``, as
            torchvision's RandomResizedCrop).
        shorter_side: center_crop's shorter side; 0 is floor(size / 0.875).
        scale: random_resized_crop's range of the crop's area, as a fraction.
        ratio: random_resized_crop's range of the crop's aspect ratio.
        flip: the probability of a horizontal flip.
        dtype: "uint8", or "float32"/"float16"/"bfloat16" for x / 255, then
            (x - mean) / std when ``mean`` and ``std`` are given. uint8 is 2-4x
            less to move: over inline (remote) transports prefer it and
            normalise on the trainer's GPU.
        mean: per-channel means, with ``std`` (a float dtype only), in units of
            x / 255: ImageNet's are (0.485, 0.456, 0.406). A value over 1 (the
            0-255 habit of DALI and mmcv) is a ValueError saying so.
        std: per-channel standard deviations, in the same units (ImageNet's:
            (0.229, 0.224, 0.225)).
        layout: "NCHW" or "NHWC".
        clip: (frames, stride) for video files, which need it: each sample is
            ``image`` [frames, 3, H, W].
        random_clip: start each clip at a random frame (training); else centred.

    Random choices depend on (seed, epoch, sample) only, never on timing.
    """

    size: int | tuple[int, int] | None = None
    resize: str = "squash"
    shorter_side: int = 0
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.0
    dtype: str = "uint8"
    mean: Sequence[float] | None = None
    std: Sequence[float] | None = None
    layout: str = "NCHW"
    clip: tuple[int, int] | None = None
    random_clip: bool = False

    @classmethod
    def from_keywords(cls, output: Output | None, keywords: Mapping[str, Any]) -> Output:
        """``output``, or one made of ``loader()``'s flat output keywords; TypeError
        naming a keyword that is not an output field, ValueError if both are given."""
        unknown = sorted(set(keywords) - _FIELDS)
        if unknown:
            raise TypeError(f"loader() got unexpected keyword arguments: {', '.join(unknown)}")
        if output is None:
            return cls(**keywords)
        if keywords:
            raise ValueError(f"give output=Output(...) or the keywords {', '.join(keywords)}, "
                             f"not both")
        return output

    def spec(self) -> feed_pb2.OutputSpec:
        """The request's OutputSpec; ValueError naming a field the client can check."""
        height, width = _size(self.size)
        return feed_pb2.OutputSpec(
            height=height, width=width, resize=choice("resize", self.resize, _RESIZES),
            shorter_side=self.shorter_side, scale_min=self.scale[0], scale_max=self.scale[1],
            ratio_min=self.ratio[0], ratio_max=self.ratio[1], flip_probability=self.flip,
            dtype=self.dtype, mean=_normalisation("mean", self.mean),
            std=_normalisation("std", self.std), layout=choice("layout", self.layout, _LAYOUTS))

    def clip_spec(self) -> feed_pb2.ClipSpec | None:
        if not self.clip:
            return None
        return feed_pb2.ClipSpec(frames=self.clip[0], stride=self.clip[1],
                                 random_start=self.random_clip)


_FIELDS = {f.name for f in fields(Output)}


def _floats(values) -> list[float]:
    """A list of floats from None, a sequence, a numpy array or a tensor."""
    return [] if values is None else [float(v) for v in values]


def _normalisation(name: str, values) -> list[float]:
    """``mean`` or ``std`` as floats; ValueError for a value over 1. The server normalises
    x / 255 (every float dtype, both layouts, video frames alike), so a mean in 0-255
    units would put every output near -2 without an error anywhere."""
    floats = _floats(values)
    if any(v > 1 for v in floats):
        scaled = ", ".join(f"{v / 255:.4g}" for v in floats)
        raise ValueError(f"{name}={tuple(floats)}: mean and std are in units of x/255: for "
                         f"0-255 values divide by 255 ({name}=({scaled}))")
    return floats


def _size(size: int | tuple[int, int] | None) -> tuple[int, int]:
    """(height, width) from an int (a square), a pair, or None (arrays: no size)."""
    if size is None:
        return 0, 0
    if isinstance(size, (int, numbers.Integral)):
        return int(size), int(size)
    if len(size) != 2:
        raise ValueError(f"size must be an int or (height, width), got {size!r}")
    return int(size[0]), int(size[1])


def choice(name: str, value: str, choices: dict[str, _Enum]) -> _Enum:
    """``choices[value]``; ValueError naming ``name`` and the choices otherwise."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return choices[value]

