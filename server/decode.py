"""Decode an encoded image straight into its row of a batch.

One ``ImageDecoder`` per decode thread: it owns a reusable ``mjpeg`` codec
context, so a JPEG goes from bytes to frame without a demuxer or a new context
per image. Other formats (PNG, WebP, BMP, TIFF, GIF) go through FFmpeg's
demuxer. FFmpeg releases the GIL while it decodes and scales, which is why
threads give parallelism here.

The frame is colour-converted and scaled in one swscale pass to planar RGB at
the output size, and the three planes are copied into the ``[3, H, W]`` row the
caller hands in: no per-image tensor, no collate copy.

Settings, each measured on the benchmark's JPEG set (bench/README.md):

- swscale runs on the calling thread (``threads=1``). PyAV's default (0, auto)
  makes every scaler context start a thread pool, and since images differ in
  size a new context is built per image: that alone cost ~0.3-0.6 ms of a
  ~1.3 ms image, and its threads fought the pool's decode threads for cores.
  Parallelism comes from the decode pool, one image per thread.
- One scaler per decoder, reused: swscale keeps its context when consecutive
  images share a size (common in real data sets), and no per-image Python
  reformatter object is made.
- BILINEAR scaling. FAST_BILINEAR saves ~0.08 ms per image but falls to ~23 dB
  PSNR against Pillow's bilinear resize; AREA saves ~0.05 ms at ~34 dB; BILINEAR
  gives ~36 dB.
- No FFmpeg ``lowres`` (DCT-domain downscaling): its reduced IDCTs have no SIMD
  code, so ``lowres=1`` was no faster than a full decode, and ``lowres=2`` saves
  ~27% only for sources four times the target, at ~31 dB mean and 27 dB worst.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import av
import numpy as np
from av.video.reformatter import Interpolation, VideoReformatter

from .headers import declared_size

__all__ = ["DecodeError", "ImageDecoder", "RgbScaler"]

_JPEG_MAGIC = b"\xff\xd8\xff"
# swscale's planar GBR: plane 0 is green, 1 blue, 2 red; these are their rows in RGB order.
_GBRP_TO_RGB_ROW = (1, 2, 0)
_GBRP = av.VideoFormat("gbrp")
_SCALER = Interpolation.BILINEAR


# (source height, source width) -> (scaled height, scaled width, window top, window left)
Place = Callable[[int, int], tuple[int, int, int, int]]


class DecodeError(Exception):
    """A sample that could not be decoded; the message says why, briefly."""


class RgbScaler:
    """Colour-converts and scales frames to planar RGB in one swscale pass, then copies a
    window of the result into a ``uint8 [3, H, W]`` row. One per thread (it keeps
    its swscale context, reused while consecutive frames share a size)."""

    def __init__(self) -> None:
        self._scaler = VideoReformatter()

    def scale(self, frame: av.VideoFrame, width: int, height: int) -> av.VideoFrame:
        return self._scaler.reformat(frame, width, height, _GBRP, interpolation=_SCALER,
                                     threads=1)

    @staticmethod
    def copy(rgb: av.VideoFrame, out: np.ndarray, top: int = 0, left: int = 0) -> None:
        """Copy the [3, H, W] window of ``rgb`` at (top, left) into ``out``, in RGB order."""
        _, height, width = out.shape
        for plane, row in zip(rgb.planes, _GBRP_TO_RGB_ROW):
            pixels = np.frombuffer(plane, np.uint8).reshape(rgb.height, plane.line_size)
            out[row] = pixels[top:top + height, left:left + width]


# Images over this many pixels are refused before decoding (gpufeed-server --max-pixels).
DEFAULT_MAX_PIXELS = 100_000_000


class ImageDecoder:
    """Decodes images into ``uint8 [3, H, W]`` rows. Not thread-safe: one per thread.

    What it does with unusual files: a JPEG that is truncated or damaged fails
    (FFmpeg's ``err_detect=explode``) rather than arriving with grey blocks;
    CMYK and grayscale JPEGs are converted to RGB; an alpha channel is dropped
    (not composited), as Pillow's ``convert("RGB")`` does; 16-bit and palette
    PNGs are converted; an animated GIF gives its first frame; the EXIF
    orientation tag is ignored, as by Pillow's and torchvision's decoders by
    default, so pixels arrive as stored. A file that declares more than
    ``max_pixels`` pixels is refused before anything is allocated.
    """

    def __init__(self, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        self._jpeg = av.CodecContext.create("mjpeg", "r")
        self._jpeg.thread_count = 1  # the pool's threads are the parallelism
        self._jpeg.options = {"err_detect": "explode"}
        self._rgb = RgbScaler()
        self._max_pixels = max_pixels

    def decode_into(self, data: bytes, out: np.ndarray, place: Place | None = None) -> None:
        """Decode ``data``, scale it (bilinear) and write it into ``out`` of shape [3, H, W].

        Without ``place`` the image is squashed to exactly H x W. With it,
        ``place(source height, source width)`` says what size to scale the
        whole image to and where the H x W window to keep starts: a crop costs
        no pass of its own.
        """
        if not data:
            raise DecodeError("empty file")
        _, height, width = out.shape
        declared = declared_size(data)
        if declared is not None:
            self._check_size(*declared)
        try:
            if data.startswith(_JPEG_MAGIC):
                frame = self._decode_jpeg(data)
            else:
                frame = _decode_other(data, self._check_size)
            scaled_h, scaled_w, top, left = (place(frame.height, frame.width) if place
                                             else (height, width, 0, 0))
            self._check_size(scaled_w, scaled_h, "scaling to")  # a crop of an extreme shape
            rgb = self._rgb.scale(frame, scaled_w, scaled_h)
        except av.FFmpegError as e:
            raise DecodeError(f"not a decodable image: {e}") from None
        self._rgb.copy(rgb, out, top, left)

    def _check_size(self, width: int, height: int, what: str = "image declares") -> None:
        if width * height > self._max_pixels:
            raise DecodeError(f"{what} {width}x{height} pixels, over the limit of "
                              f"{self._max_pixels} (gpufeed-server --max-pixels)")

    def _decode_jpeg(self, data: bytes) -> av.VideoFrame:
        frames = self._jpeg.decode(av.Packet(data))
        if not frames:
            raise DecodeError("JPEG decoder produced no image")
        return frames[0]


def _decode_other(data: bytes, check_size: Callable[[int, int], None]) -> av.VideoFrame:
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise DecodeError("no image in file")
        codec = container.streams.video[0].codec_context
        check_size(codec.width, codec.height)  # as probed, before a frame is decoded
        for frame in container.decode(video=0):
            return frame
    raise DecodeError("no image in file")
