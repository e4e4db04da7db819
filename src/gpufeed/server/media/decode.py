"""Decode an encoded image straight into its row of a batch.

Crop, then scale: a sample's crop box (src/gpufeed/server/media/output.py) says which window
of the source becomes the output, and only that window is resized.

- JPEG (YCbCr, RGB, grayscale) goes through the fast path in src/gpufeed/server/media/jpeg.py
  when its C extension is built: only the MCUs under the box are decoded, at
  1/2-1/8 scale when the box is that much larger than the output, then resized
  into the row.
- Everything else (PNG, WebP, BMP, TIFF, GIF; CMYK or unterminated JPEGs; any
  JPEG without the extension) is decoded whole by FFmpeg through PyAV: JPEGs by
  a reusable ``mjpeg`` codec context (no demuxer, no new context per image),
  the rest through FFmpeg's demuxer for that format alone, picked from the
  file's first bytes (containers.py). A squash is colour-converted and scaled in
  one swscale pass to planar RGB at the output size. A crop is converted to
  packed RGB at source size and its box resized by the fast path's resize;
  without the extension, swscale scales the whole image so that the box comes
  out at H x W and the window is copied out.

At the image's own size (a squash to it, a crop box of the output's size, a
video frame) swscale does not scale: 8-bit 4:2:0 and 4:2:2 YUV (lossy WebP,
video, JPEGs on the PyAV path) goes through its YUV->RGB converter, but only
when the height is even. On an odd height its general scaler runs instead, which
spreads 4:2:0 chroma rows over the whole height (rows near the bottom take the
next row's colour) and is several times slower. And the converter's x86-64
planar RGB output (FFmpeg's ``yuv420_gbrp_ssse3``) rounds a row up to 8 pixels,
drops those 8 again under a bound meant for 3-byte pixels (a planar row has 1),
then writes 16 at a time: when ``width % 16`` is 1 to 8, that many right-most
columns are never written, and whatever the buffer held arrives (different each
run, nothing logged). So such a frame is first copied into one whose width is a
multiple of 16 and whose height is even, its last column and row repeated (~1.5
bytes a pixel), converted whole, and its top-left window copied out
(``_padded``); packed RGB, written whole by the same converter, needs only the
even height. Scaled conversions go through the general scaler and are right at
any size.

Both paths write into the ``[3, H, W]`` row the caller hands in (no per-image
tensor, no collate copy) and release the GIL while they decode and scale, which
is why threads give parallelism here.

Settings, each measured on the benchmark's JPEG set
(docs/decisions/0110-pyav-decoder-settings.md):

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
from functools import partial
from typing import NamedTuple

import av
import numpy as np
from av.error import FFmpegError
from av.video.plane import VideoPlane
from av.video.reformatter import Interpolation, VideoReformatter

from ..config import DEFAULT_MAX_PIXELS
from . import jpeg
from .containers import HEAD_BYTES, IMAGE_FORMATS, image_format, open_container
from .headers import declared_size
from .output import Box, CropRule

__all__ = ["DecodeError", "ImageDecoder", "OverLimit", "SourceWindow", "RgbScaler", "decode_frame",
           "plane_rows"]

_JPEG_MAGIC = b"\xff\xd8\xff"
# swscale's planar GBR: plane 0 is green, 1 blue, 2 red; these are their rows in RGB order.
_GBRP_TO_RGB_ROW = (1, 2, 0)
_GBRP = av.VideoFormat("gbrp")
_SCALER = Interpolation.BILINEAR
# The formats swscale converts to RGB at their own size with its YUV->RGB converter (when
# the height is even), and the blocks of pixels its x86 planar output writes whole (see
# the module docstring).
_CONVERTED_YUV = frozenset({"yuv420p", "yuvj420p", "yuva420p", "yuv422p", "yuvj422p"})
_BLOCK = 16


class DecodeError(Exception):
    """A sample that could not be decoded; the message says why, briefly."""


class OverLimit(DecodeError):
    """A sample refused for what it declares (pixels, uncompressed bytes): over a server
    limit, not broken; its failure's category says so (serving/failures.py)."""


class SourceWindow(NamedTuple):
    """The window of a source image a row was made from: the source's size and the box
    resized (what a sample's other fields follow)."""

    src_h: int
    src_w: int
    box: Box


class RgbScaler:
    """Colour-converts and scales frames to planar RGB in one swscale pass, then copies a
    window of the result into a ``uint8 [3, H, W]`` row. One per thread (it keeps
    its swscale context, reused while consecutive frames share a size)."""

    def __init__(self) -> None:
        self._scaler = VideoReformatter()

    def scale(self, frame: av.VideoFrame, width: int, height: int) -> av.VideoFrame:
        """``frame`` as planar RGB (gbrp) at ``width`` x ``height``. At the frame's own size
        the result may be wider and taller (see the module docstring): its top-left
        ``height`` x ``width`` is the frame, and ``copy`` takes only that."""
        if (width, height) == (frame.width, frame.height):
            frame = _padded(frame, _BLOCK)
            width, height = frame.width, frame.height
        # PyAV's stub types format as a str; it takes a VideoFormat too, made once here
        # to save a lookup per frame.
        return self._scaler.reformat(frame, width, height, _GBRP,  # pyright: ignore[reportArgumentType]
                                     interpolation=_SCALER,
                                     threads=1)

    def packed(self, frame: av.VideoFrame) -> np.ndarray:
        """``frame`` as packed RGB at its own size: a uint8 [h, w, 3] view (rows padded)."""
        # The packed converter writes every column; only an odd height needs a row more.
        rgb = self._scaler.reformat(_padded(frame, 1), format="rgb24", interpolation=_SCALER,
                                    threads=1)
        rows = plane_rows(rgb.planes[0], rgb.height)
        return rows[:frame.height, :frame.width * 3].reshape(frame.height, frame.width, 3)

    @staticmethod
    def copy(rgb: av.VideoFrame, out: np.ndarray, top: int = 0, left: int = 0,
             flip: bool = False) -> None:
        """Copy the [3, H, W] window of ``rgb`` at (top, left) into ``out``, in RGB order,
        mirrored left to right if ``flip``."""
        _, height, width = out.shape
        for plane, row in zip(rgb.planes, _GBRP_TO_RGB_ROW):
            pixels = plane_rows(plane, rgb.height)
            window = pixels[top:top + height, left:left + width]
            out[row] = window[:, ::-1] if flip else window


def plane_rows(plane: VideoPlane, height: int) -> np.ndarray:
    """A frame's plane as uint8 rows [height, line_size]: a view of its bytes."""
    # PyAV's stub gives VideoPlane no buffer protocol (no __buffer__); it has one.
    return np.frombuffer(plane, np.uint8).reshape(  # pyright: ignore[reportCallIssue,reportArgumentType]
        height, plane.line_size)


def _padded(frame: av.VideoFrame, columns: int) -> av.VideoFrame:
    """``frame`` itself, or, when swscale would convert it at its own size with its
    YUV->RGB converter, a copy whose width is a multiple of ``columns`` and whose height
    is even, its last column and row repeated (see the module docstring)."""
    width, height = frame.width, frame.height
    if (width % columns == 0 and height % 2 == 0) or frame.format.name not in _CONVERTED_YUV:
        return frame
    wide = av.VideoFrame(-(-width // columns) * columns, height + height % 2, frame.format.name)
    for source, target in zip(frame.planes, wide.planes):
        pixels = plane_rows(source, source.height)[:, :source.width]
        rows = plane_rows(target, target.height)
        rows[:source.height, :source.width] = pixels
        rows[:source.height, source.width:target.width] = pixels[:, -1:]
        rows[source.height:target.height, :target.width] = rows[source.height - 1, :target.width]
    wide.color_range = frame.color_range  # the range and matrix of a YUV frame say how it
    wide.colorspace = frame.colorspace    # converts: WebP and video frames carry theirs
    return wide



class ImageDecoder:
    """Decodes images into ``uint8 [3, H, W]`` rows. Not thread-safe: one per thread.

    What it does with unusual files: a JPEG that is truncated or damaged fails
    (FFmpeg's ``err_detect=explode``; on the fast path, any libjpeg warning about
    the rows it reads) rather than arriving with grey blocks;
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

    def decode_into(self, data: bytes, out: np.ndarray, crop: CropRule | None = None,
                    flip: bool = False) -> SourceWindow:
        """Decode ``data`` and write its window ``crop(source height, source width)``,
        resized (bilinear), into ``out`` of shape [3, H, W]; without ``crop``, the whole
        image (squashed to H x W). Mirrored left to right if ``flip``: every path
        flips while it writes the row, so a flip costs no pass of its own.

        Returns the source's size and the box it used, for a sample's other
        fields (fields.py) to follow the same crop."""
        if not data:
            raise DecodeError("empty file")
        declared = declared_size(data)
        if declared is not None:
            self.check_size(*declared)
        is_jpeg = data.startswith(_JPEG_MAGIC)
        if is_jpeg and declared is not None and jpeg.takes(data):
            src_w, src_h = declared
            box = crop(src_h, src_w) if crop else (0, 0, src_h, src_w)
            try:
                jpeg.decode_crop(data, out, box, flip)
                return SourceWindow(src_h, src_w, box)
            except jpeg.Unsupported:
                pass  # CMYK / YCCK: FFmpeg converts those
            except jpeg.JpegError as e:
                raise DecodeError(f"not a decodable image: {e}") from None
        try:
            frame = self._decode_jpeg(data) if is_jpeg else _decode_other(data, self.check_size)
            box = crop(frame.height, frame.width) if crop else None
            whole = (0, 0, frame.height, frame.width)
            window = SourceWindow(frame.height, frame.width, box or whole)
            if box is not None and jpeg.AVAILABLE:
                jpeg.resize_rgb(self._rgb.packed(frame), out, box, flip)
                return window
            _, height, width = out.shape
            scaled_h, scaled_w, top, left = (
                _scaled_window(box, frame.height, frame.width, height, width) if box is not None
                else (height, width, 0, 0))
            self.check_size(scaled_w, scaled_h, "scaling to")  # a crop of an extreme shape
            rgb = self._rgb.scale(frame, scaled_w, scaled_h)
        except FFmpegError as e:
            raise DecodeError(f"not a decodable image: {e}") from None
        self._rgb.copy(rgb, out, top, left, flip)
        return window

    def check_size(self, width: int, height: int, what: str = "image declares") -> None:
        """OverLimit past the decoder's --max-pixels."""
        _check_pixels(width, height, self._max_pixels, what)

    def _decode_jpeg(self, data: bytes) -> av.VideoFrame:
        frames = self._jpeg.decode(av.Packet(data))
        if not frames:
            raise DecodeError("JPEG decoder produced no image")
        return frames[0]


def _scaled_window(box: Box, src_h: int, src_w: int, out_h: int, out_w: int
               ) -> tuple[int, int, int, int]:
    """(scaled height, scaled width, top, left): scale the whole source so that ``box``
    comes out at out_h x out_w, and where that window starts (the path without the
    fast path's resize; the box's corner is rounded to a whole output pixel)."""
    top, left, h, w = box
    sy, sx = out_h / h, out_w / w
    scaled_h, scaled_w = max(out_h, round(src_h * sy)), max(out_w, round(src_w * sx))
    return (scaled_h, scaled_w, min(round(top * sy), scaled_h - out_h),
            min(round(left * sx), scaled_w - out_w))


def _check_pixels(width: int, height: int, max_pixels: int, what: str = "image declares"
                  ) -> None:
    if width * height > max_pixels:
        raise OverLimit(f"{what} {width}x{height} pixels, over the limit of "
                        f"{max_pixels} (gpufeed-server --max-pixels)")


def decode_frame(data: bytes, max_pixels: int) -> av.VideoFrame:
    """A JPEG-less image's first frame in its own pixel format (a mask's class ids stay
    indices), its declared size checked against ``max_pixels`` before decoding."""
    check_size = partial(_check_pixels, max_pixels=max_pixels)
    declared = declared_size(data)
    if declared is not None:
        check_size(*declared)
    try:
        return _decode_other(data, check_size)
    except FFmpegError as e:
        raise DecodeError(f"not a decodable image: {e}") from None


def _decode_other(data: bytes, check_size: Callable[[int, int], None]) -> av.VideoFrame:
    demuxer = image_format(data[:HEAD_BYTES])
    if demuxer is None:
        raise DecodeError(f"not a supported image format (JPEG, {', '.join(IMAGE_FORMATS)})")
    with open_container(io.BytesIO(data), demuxer) as container:
        if not container.streams.video:
            raise DecodeError("no image in file")
        codec = container.streams.video[0].codec_context
        check_size(codec.width, codec.height)  # as probed, before a frame is decoded
        for frame in container.decode(video=0):
            return frame
    raise DecodeError("no image in file")
