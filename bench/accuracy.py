"""How close gpufeed's decoder is to a Pillow reference, in PSNR, on the benchmark's files.

The reference is what the tests hold the server to: Pillow opens the file,
converts it to RGB and resizes it (bilinear) to the output size; for a crop,
Pillow resizes the same box (crop, then bilinear resize), the box the server
picks for that sample from (seed, epoch, index). A speed setting is worth
keeping only while this stays at or above 30 dB on average, 25 dB at worst.
"""

from __future__ import annotations

import numpy as np

__all__ = ["crop_psnr", "decoder_psnr"]


def decoder_psnr(paths: list[str], size: tuple[int, int]) -> dict:
    """Mean and worst PSNR (dB) of ``ImageDecoder`` against the reference over ``paths``."""
    from PIL import Image

    from gpufeed.server.media.decode import ImageDecoder

    decoder = ImageDecoder()
    out = np.empty((3, *size), np.uint8)
    values = []
    for path in paths:
        with open(path, "rb") as f:
            decoder.decode_into(f.read(), out)
        with Image.open(path) as im:
            ref = np.asarray(im.convert("RGB").resize((size[1], size[0]), Image.BILINEAR))
        values.append(_psnr(out, ref.transpose(2, 0, 1)))
    return {"images": len(values), "mean_db": float(np.mean(values)),
            "min_db": float(np.min(values))}


def crop_psnr(paths: list[str], size: tuple[int, int], seed: int = 0, epoch: int = 0) -> dict:
    """Mean and worst PSNR (dB) of random-resized crops against Pillow on the same boxes."""
    from PIL import Image

    from gpufeed.server.media.decode import ImageDecoder
    from gpufeed.server.media.output import OutputTransform
    from gpufeed.v1 import feed_pb2

    spec = feed_pb2.OutputSpec(height=size[0], width=size[1],
                               resize=feed_pb2.RESIZE_RANDOM_RESIZED_CROP)
    transform = OutputTransform(spec, seed, epoch)
    decoder = ImageDecoder()
    out = np.empty((3, *size), np.uint8)
    values = []
    for index, path in enumerate(paths):
        crop, _ = transform.choose(index)
        with open(path, "rb") as f:
            decoder.decode_into(f.read(), out, crop)
        with Image.open(path) as im:
            top, left, h, w = transform.box(index, im.height, im.width)
            ref = np.asarray(im.convert("RGB").resize((size[1], size[0]), Image.BILINEAR,
                                                      box=(left, top, left + w, top + h)))
        values.append(_psnr(out, ref.transpose(2, 0, 1)))
    return {"images": len(values), "mean_db": float(np.mean(values)),
            "min_db": float(np.min(values))}


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB; identical images count as 100 dB, so that a mean stays finite."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 100.0 if mse == 0 else min(100.0, 10 * np.log10(255.0 ** 2 / mse))
