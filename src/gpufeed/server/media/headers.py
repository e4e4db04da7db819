"""The size an image file declares, read from its header before anything is decoded.

A decompression bomb is a small file that declares a huge image: a decoder
allocates the whole frame before it finds out the data is not there. Reading
the declared size first lets the decoder refuse it without allocating. JPEG,
PNG, GIF, BMP and WebP are read here; for anything else the decoder checks the
size FFmpeg's probe reports before decoding a frame.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

__all__ = ["declared_size", "jpeg_markers"]

# Start-of-frame markers (not DHT C4, JPG C8, DAC CC), which carry the frame size.
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def declared_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) as the header states it, or None when the format is not known here."""
    try:
        if data.startswith(b"\xff\xd8"):
            return _jpeg(data)
        if data.startswith(b"\x89PNG\r\n\x1a\n"):
            return struct.unpack(">II", data[16:24])
        if data[:6] in (b"GIF87a", b"GIF89a"):
            return struct.unpack("<HH", data[6:10])
        if data.startswith(b"BM"):
            width, height = struct.unpack("<ii", data[18:26])
            return abs(width), abs(height)
        if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
            return _webp(data)
    except struct.error:  # too short for its own header: the decoder will say so
        return None
    return None


def jpeg_markers(data: bytes) -> Iterator[tuple[int, int]]:
    """(marker, offset) of each marker of a JPEG's header, from after its start-of-image
    marker to its first start of scan (0xDA) included, walked by the segments' lengths
    (so a thumbnail inside an APP segment is skipped whole). Stops early at anything
    that is not a marker; struct.error for a segment cut short."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        yield marker, i
        if marker == 0xDA:
            return
        if 0xD0 <= marker <= 0xD9 or marker == 0x01:  # markers without a length
            i += 2
            continue
        i += 2 + struct.unpack(">H", data[i + 2:i + 4])[0]


def _jpeg(data: bytes) -> tuple[int, int] | None:
    for marker, i in jpeg_markers(data):
        if marker in _SOF:
            height, width = struct.unpack(">HH", data[i + 5:i + 9])
            return width, height
    return None


def _webp(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8X":
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return width, height
    if chunk == b"VP8L":
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8 ":
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    return None
