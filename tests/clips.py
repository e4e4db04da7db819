"""Test videos whose every frame shows its own number, readable after decoding.

The number is drawn in binary as eight vertical bands, white for a 1 bit and
black for a 0: it survives compression and scaling to any size.
"""

from __future__ import annotations

import io

import av
import numpy as np

SRC_W, SRC_H = 64, 48
BITS = 8
GOP = 5  # small, so most clips start between keyframes and seeking matters


def frame_image(i: int) -> np.ndarray:
    img = np.zeros((SRC_H, SRC_W, 3), np.uint8)
    band = SRC_W // BITS
    for b in range(BITS):
        if (i >> b) & 1:
            img[:, b * band:(b + 1) * band] = 255
    return img


def encode_video(frames: int, codec: str, fmt: str, gop: int = GOP) -> bytes:
    """``frames`` numbered frames at 25 fps, encoded with ``codec`` into container ``fmt``."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=25)
        stream.width, stream.height, stream.pix_fmt = SRC_W, SRC_H, "yuv420p"
        stream.codec_context.gop_size = gop
        if codec == "libx264":
            stream.options = {"bf": "2", "keyint_min": str(gop), "sc_threshold": "0", "crf": "18"}
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_image(i), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def frame_number(frame: np.ndarray) -> int:
    """Read the number back from a decoded uint8 [3, H, W] frame of any size."""
    grey = frame.mean(axis=(0, 1))
    band = frame.shape[-1] / BITS
    bits = [grey[int((b + 0.5) * band)] > 127 for b in range(BITS)]
    return sum(1 << b for b, bit in enumerate(bits) if bit)
