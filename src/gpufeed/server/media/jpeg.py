"""The JPEG fast path: decode only the crop window, at reduced scale when it pays.

``_jpeg`` is a small C extension (src/gpufeed/server/media/_jpeg.c) over libjpeg-turbo's classic
API, the calls TensorFlow's ``decode_and_crop_jpeg`` uses. For one sample it:

- decodes only the rows the crop box needs (rows below it are never read,
  rows above are entropy-decoded and skipped) and only the iMCU columns that
  cover it (``jpeg_crop_scanline``);
- asks libjpeg for 1/2, 1/4 or 1/8 scale, done in the IDCT, when the box is at
  least 2, 4 or 8 times the output in both dimensions;
- resizes the decoded window to H x W with Pillow's bilinear filter (a
  triangle widened by the shrink factor) over the box's exact, sub-pixel
  position, writing the ``uint8 [3, H, W]`` row directly (mirrored for a flip:
  the output columns' weights are taken in reverse order, so it costs nothing),
  with AVX2 where the CPU has it, SSE2 otherwise, to the same integers;

all with the GIL released. Against Pillow (crop, then bilinear resize) it is
within one level per pixel without DCT scaling; bench/RESULTS.md ("Decoder
accuracy") gives the PSNR over the bench set's training crops.

The extension is optional: it is built when libjpeg-turbo's headers are there
(Debian: ``libjpeg62-turbo-dev``). Without it ``AVAILABLE`` is false and
src/gpufeed/server/media/decode.py decodes JPEGs with PyAV, as it says at start-up. CMYK and
YCCK JPEGs, and files that do not end with an end-of-image marker (truncated,
or with data appended), take the PyAV path too: PyAV's ``err_detect=explode``
is what judges a damaged file. Corrupt data that the fast path does meet
(Huffman errors, a missing marker) fails the sample, as there.
"""

from __future__ import annotations

import numpy as np

try:
    from . import _jpeg
except ImportError as e:  # built without libjpeg-turbo's headers
    _jpeg = None
    _MISSING = str(e)

__all__ = ["AVAILABLE", "JpegError", "Unsupported", "decode_crop", "describe", "resize_rgb",
           "takes"]

AVAILABLE = _jpeg is not None
JpegError = _jpeg.Error if _jpeg is not None else RuntimeError
Unsupported = _jpeg.Unsupported if _jpeg is not None else RuntimeError

_EOI = b"\xff\xd9"


def _built():
    """The extension; callers check ``AVAILABLE`` (or ``takes``) first."""
    if _jpeg is None:
        raise RuntimeError("the libjpeg-turbo fast path was not built; check jpeg.AVAILABLE first")
    return _jpeg


def describe() -> str:
    """One line for the start-up log: which JPEG decoder this server uses, and why."""
    if _jpeg is not None:
        return (f"JPEG decoder: libjpeg-turbo crop + DCT-scaled decode (libjpeg API "
                f"{_jpeg.LIBJPEG_VERSION}), {_jpeg.RESIZE_SIMD} resize")
    return (f"JPEG decoder: PyAV (FFmpeg mjpeg), whole image; the libjpeg-turbo fast path "
            f"was not built ({_MISSING}; install libjpeg-turbo's headers and reinstall)")


def takes(data: bytes) -> bool:
    """Whether the fast path should try ``data`` (a JPEG): built, and the file is whole."""
    return AVAILABLE and data.endswith(_EOI)


def decode_crop(data: bytes, out: np.ndarray, box: tuple[float, float, float, float],
                flip: bool = False) -> int:
    """Decode ``box`` (top, left, height, width) of the JPEG into ``out`` [3, H, W],
    mirrored if ``flip``; returns the DCT scale denominator used. Raises JpegError,
    Unsupported."""
    return _built().decode_crop(data, out, box, flip)


def resize_rgb(image: np.ndarray, out: np.ndarray, box: tuple[float, float, float, float],
               flip: bool = False) -> None:
    """Resize ``box`` of a packed uint8 [h, w, 3] image into ``out`` [3, H, W], as
    decode_crop does."""
    _built().resize_rgb(image, out, box, flip)
