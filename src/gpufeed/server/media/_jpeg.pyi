"""The C extension ``_jpeg.c`` (libjpeg-turbo's decoder, with the crop and resize of a
sample's box), as the type checker sees it. Buffers are any object that exports
the buffer protocol (numpy arrays, bytes, memoryviews)."""

from typing import Any

# (top, left, height, width) in source pixels
Box = tuple[float, float, float, float]

LIBJPEG_VERSION: int
RESIZE_SIMD: str

class Error(Exception): ...
class Unsupported(Exception): ...

def decode_crop(data: Any, out: Any, box: Box, flip: bool = ...) -> int: ...
def resize_rgb(image: Any, out: Any, box: Box, flip: bool = ...) -> None: ...
def use_wide(flag: bool) -> bool: ...
