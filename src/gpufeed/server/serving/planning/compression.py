"""The compressors an inline stream may ask for (``StreamRequest.compression``).

The plan checks the name and keeps the compressor (checks.py); the wire
(edge/wire.py) writes what it returns in place of the one copy of the rows.
Each codec is imported only when a stream asks for it: the ``compression``
extra is optional on both sides.
"""

from __future__ import annotations

__all__ = ["COMPRESSORS"]


def _zstd():
    import zstandard

    # Level 1: about as fast as a link of a few Gbit/s moves the bytes; higher
    # levels cost several times the CPU for a few percent more on array data.
    compressor = zstandard.ZstdCompressor(level=1)

    def compress(chunks: list[memoryview]) -> list[bytes]:
        stream = compressor.compressobj(size=sum(len(c) for c in chunks))  # size in the frame
        return [*(stream.compress(c) for c in chunks), stream.flush()]

    return compress


def _lz4():
    import lz4.frame

    def compress(chunks: list[memoryview]) -> list[bytes]:
        stream = lz4.frame.LZ4FrameCompressor()
        return [stream.begin(sum(len(c) for c in chunks)), *(stream.compress(c) for c in chunks),
                stream.flush()]

    return compress


# StreamRequest.compression -> a factory of functions (views -> compressed pieces).
COMPRESSORS = {"zstd": _zstd, "lz4": _lz4}
