"""Decode an encoded image straight into its row of a batch.

One ``ImageDecoder`` per decode thread: it owns a reusable ``mjpeg`` codec
context, so a JPEG goes from bytes to frame without a demuxer or a new context
per image. Other formats (PNG, WebP, BMP, TIFF, GIF) go through FFmpeg's
demuxer. FFmpeg releases the GIL while it decodes and scales, which is why
threads give parallelism here.

The frame is colour-converted and scaled in one swscale pass to planar RGB at
the output size, and the three planes are copied into the ``[3, H, W]`` row the
caller hands in: no per-image tensor, no collate copy.
"""

from __future__ import annotations

import io

import av
import numpy as np

__all__ = ["DecodeError", "ImageDecoder"]

_JPEG_MAGIC = b"\xff\xd8\xff"
# swscale's planar GBR: plane 0 is green, 1 blue, 2 red; these are their rows in RGB order.
_GBRP_TO_RGB_ROW = (1, 2, 0)


class DecodeError(Exception):
    """A sample that could not be decoded; the message says why, briefly."""


class ImageDecoder:
    """Decodes images into ``uint8 [3, H, W]`` rows. Not thread-safe: one per thread."""

    def __init__(self) -> None:
        self._jpeg = av.CodecContext.create("mjpeg", "r")

    def decode_into(self, data: bytes, out: np.ndarray) -> None:
        """Decode ``data`` and scale it (squash, bilinear) into ``out`` of shape [3, H, W]."""
        if not data:
            raise DecodeError("empty file")
        try:
            frame = self._decode_jpeg(data) if data.startswith(_JPEG_MAGIC) else _decode_other(data)
            _, height, width = out.shape
            rgb = frame.reformat(width=width, height=height, format="gbrp",
                                 interpolation="BILINEAR")
        except av.FFmpegError as e:
            raise DecodeError(f"not a decodable image: {e}") from None
        for plane, row in zip(rgb.planes, _GBRP_TO_RGB_ROW):
            pixels = np.frombuffer(plane, np.uint8).reshape(height, plane.line_size)
            out[row] = pixels[:, :width]

    def _decode_jpeg(self, data: bytes) -> av.VideoFrame:
        frames = self._jpeg.decode(av.Packet(data))
        if not frames:
            raise DecodeError("JPEG decoder produced no image")
        return frames[0]


def _decode_other(data: bytes) -> av.VideoFrame:
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise DecodeError("no image in file")
        for frame in container.decode(video=0):
            return frame
    raise DecodeError("no image in file")
