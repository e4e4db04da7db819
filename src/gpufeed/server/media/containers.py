"""Which FFmpeg demuxer may read a sample: chosen from its first bytes, never probed.

FFmpeg's probe accepts any container it recognises, and some containers are
scripts that name other files or URLs (``ffconcat``, HLS and DASH playlists,
``tee``, image sequences, QuickTime data references). A 50-byte "image" holding
a concat script would make the server read whatever file it names, wherever it
is. So the server never lets FFmpeg probe: the demuxer is picked from the
file's magic bytes out of a short allow-list, and the container is opened with

- ``format_whitelist`` set to that one demuxer, so nothing nested can switch
  to another;
- ``protocol_whitelist`` naming no protocol: the only input is the bytes the
  server already read (or the file descriptor it opened and checked under the
  data roots, read through Python), and any attempt to open another file or
  URL fails;
- QuickTime/MP4 data references off (``enable_drefs=0``, its default, stated
  so that it stays off).

A file whose first bytes match no allowed format fails that sample with
"not a supported image (video) format".
"""

from __future__ import annotations

from typing import BinaryIO

import av
from av.container import InputContainer

__all__ = [
    "HEAD_BYTES", "IMAGE_FORMATS", "VIDEO_FORMATS", "image_format", "open_container",
    "video_format",
]

# Magic bytes -> FFmpeg demuxer. JPEG is not here: it goes straight to the mjpeg
# decoder without any demuxer (decode.py).
IMAGE_FORMATS = {"PNG": "png_pipe", "GIF": "gif", "BMP": "bmp_pipe", "WebP": "webp_pipe",
                 "TIFF": "tiff_pipe"}
VIDEO_FORMATS = {"MP4/MOV": "mov", "Matroska/WebM": "matroska", "AVI": "avi"}
# Box types an MP4 or QuickTime file starts with.
_MOV_BOXES = {b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide"}
# Enough bytes to tell every allowed format apart.
HEAD_BYTES = 12

_NO_PROTOCOL = "none"  # names no FFmpeg protocol: every nested open is refused


def image_format(head: bytes) -> str | None:
    """The demuxer for an image starting with ``head``, or None when it is not allowed."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return IMAGE_FORMATS["PNG"]
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return IMAGE_FORMATS["GIF"]
    if head.startswith(b"BM"):
        return IMAGE_FORMATS["BMP"]
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return IMAGE_FORMATS["WebP"]
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return IMAGE_FORMATS["TIFF"]
    return None


def video_format(head: bytes) -> str | None:
    """The demuxer for a video starting with ``head``, or None when it is not allowed."""
    if head[4:8] in _MOV_BOXES:
        return VIDEO_FORMATS["MP4/MOV"]
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return VIDEO_FORMATS["Matroska/WebM"]
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return VIDEO_FORMATS["AVI"]
    return None


def open_container(file: BinaryIO, demuxer: str) -> InputContainer:
    """``file`` opened with ``demuxer`` alone and no protocol (see the module docstring)."""
    return av.open(file, mode="r", format=demuxer, container_options={
        "format_whitelist": demuxer,
        "protocol_whitelist": _NO_PROTOCOL,
        "enable_drefs": "0",
    })
