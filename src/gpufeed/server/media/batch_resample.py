"""A batch's crop boxes resampled to the output with the CPU path's filter, on any device.

``--decoder nvimgcodec`` (batch_jpeg.py) decodes each box's enclosing region; this
module turns the regions into the output rows with the filter of the CPU path
(src/gpufeed/server/media/_jpeg.c): Pillow's bilinear triangle over each box's exact,
sub-pixel position, widened when shrinking, mirrored for a flip. ``crop_taps`` says
which source pixels each output pixel reads; then either gpufeed's CUDA kernel
(_resample.cu, one launch for the batch, where bench/gpu/prepare.sh built it with
nvcc: ``load_kernel``, ``kernel_crops``) or two batched matrix products
(``resample``, any device) make the pixels.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["Taps", "crop_taps", "cuda_kernel", "kernel_crops", "load_kernel", "resample",
           "resample_weights", "upload"]

_lock = threading.Lock()
# One crop for the resample kernel: _resample.cu's gpufeed_crop, field for field.
_CROP = np.dtype([("src", "<u8"), ("pitch", "<i8"), ("first_y", "<i4"), ("first_x", "<i4"),
                  ("rows", "<i4"), ("cols", "<i4"), ("size_y", "<i4"), ("size_x", "<i4"),
                  ("top", "<f8"), ("left", "<f8"), ("height", "<f8"), ("width", "<f8"),
                  ("flip", "<i4"), ("unused", "<i4")])
assert _CROP.itemsize == 80, "must match sizeof(gpufeed_crop)"
# The kernel's library: bench/gpu/prepare.sh builds it with nvcc into .gpu/ext/, and the
# device check's run.sh puts it here, beside this module.
_KERNEL = Path(__file__).with_name("_resample.so")
_kernel: Any = None  # the loaded library, or False where there is none


@dataclass
class Taps:
    """Where each output pixel of one axis of a batch's boxes reads its source pixels
    (_jpeg.c's ``axis_make``): output pixel j of box k takes source pixels
    [lo[k, j], hi[k, j]), weighted by a triangle about ``centre[k, j]`` that is
    ``widen[k]`` pixels wide either side. Box k reads [first[k], last[k]) in all."""

    centre: np.ndarray  # float64 [N, out]
    widen: np.ndarray  # float64 [N]
    lo: np.ndarray  # int64 [N, out]
    hi: np.ndarray  # int64 [N, out]
    first: np.ndarray  # int64 [N]: lo's least
    last: np.ndarray  # int64 [N]: hi's greatest

    def pick(self, boxes: np.ndarray) -> Taps:
        """The taps of the boxes ``boxes`` (indices) alone."""
        return Taps(self.centre[boxes], self.widen[boxes], self.lo[boxes], self.hi[boxes],
                    self.first[boxes], self.last[boxes])


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device``, queued on the current stream. On a GPU, through
    pinned memory (torch's host cache keeps it until the copy has run): a copy from
    pageable memory would make the thread wait, spinning, for all the stream's queued
    work first, the batch's decode included."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def crop_taps(starts: np.ndarray, lengths: np.ndarray, sizes: np.ndarray, out: int) -> Taps:
    """The taps that resample the windows [start, start + length) of axes of ``size``
    pixels to ``out`` pixels each, a batch at once (float64 / int64 [N] in). The CPU
    path's filter: a triangle one (widened when shrinking) pixel either side of each
    output pixel's centre, clipped to the image; an output pixel whose taps all fall
    outside takes the nearest pixel."""
    starts, lengths = np.asarray(starts, np.float64), np.asarray(lengths, np.float64)
    sizes = np.asarray(sizes, np.int64)[:, None]
    scale = lengths / out
    widen = np.maximum(scale, 1.0)
    centre = starts[:, None] + (np.arange(out) + 0.5) * scale[:, None]
    lo = np.maximum(np.floor(centre - widen[:, None] + 0.5).astype(np.int64), 0)
    hi = np.minimum(np.floor(centre + widen[:, None] + 0.5).astype(np.int64), sizes)
    hi = np.minimum(hi, lo + np.ceil(widen).astype(np.int64)[:, None] * 2 + 2)
    edge = hi <= lo
    lo = np.where(edge, np.where(centre < 0.5, 0, sizes - 1), lo)
    hi = np.where(edge, lo + 1, hi)
    return Taps(centre, widen, lo, hi, lo.min(axis=1), hi.max(axis=1))


def resample_weights(taps: Taps, span: int, device: torch.device) -> torch.Tensor:
    """The taps' weights on ``device``: float32 [N, out, span], row j of box k weighing
    source pixels first[k] .. first[k] + span - 1 (``span`` at least the widest box's
    reach), each row summing to 1 and zero past the box's own last pixel. Computed on the device for
    the whole batch, in a few kernels: one copy of the taps goes there, not the weights."""
    count, out = taps.lo.shape
    first = taps.first
    # One host-to-device copy: lo, hi and centre as offsets from the box's first pixel
    # (float32 holds them exactly: images are under 2^24 pixels a side), then widen.
    packed = np.empty((count, 3 * out + 1), np.float32)
    packed[:, :out] = taps.lo - first[:, None]
    packed[:, out:2 * out] = taps.hi - first[:, None]
    packed[:, 2 * out:3 * out] = taps.centre - first[:, None]
    packed[:, -1] = taps.widen
    on = upload(packed, device)
    lo, hi, centre = (on[:, k * out:(k + 1) * out, None] for k in range(3))
    widen = on[:, -1, None, None]
    x = torch.arange(span, device=device, dtype=torch.float32)
    inside = (x >= lo) & (x < hi)
    t = ((x + 0.5 - centre) / widen).abs_()
    weights = torch.where(inside & (t < 1.0), 1.0 - t, 0.0)
    sums = weights.sum(dim=2, keepdim=True)
    nearest = sums <= 0
    weights = torch.where(nearest, (x == lo).float(), weights / torch.where(nearest, 1.0, sums))
    return weights


def resample(padded: torch.Tensor, ys: Taps, xs: Taps, flips: np.ndarray) -> torch.Tensor:
    """Regions (uint8 [N, h, w, 3], each at the top left, zero-padded) resampled to the
    output by two batched matrix products, mirrored where ``flips``: uint8 [N, 3, H, W]
    where ``padded`` lies (any device)."""
    device = padded.device
    count, span_h, span_w, _ = padded.shape
    wy = resample_weights(ys, span_h, device)  # [N, H, h]
    wx = resample_weights(xs, span_w, device)  # [N, W, w]
    if flips.any():
        flipped = upload(flips, device)[:, None, None]
        wx = torch.where(flipped, wx.flip(1), wx)
    height, width = wy.shape[1], wx.shape[1]
    # Rows: [N, H, h] x [N, h, w * 3]; then columns: [N, W, w] x [N, w, H * 3].
    tall = torch.bmm(wy, padded.view(count, span_h, span_w * 3).float())
    tall = tall.view(count, height, span_w, 3).permute(0, 2, 1, 3).reshape(
        count, span_w, height * 3)
    wide = torch.bmm(wx, tall).view(count, width, height, 3)
    return wide.permute(0, 3, 2, 1).round_().clamp_(0, 255).to(torch.uint8).contiguous()


def load_kernel(path: Path | None = None) -> Any:
    """The resample kernel's library (_resample.cu, built with nvcc, beside this module),
    loaded once; None where it was not built (then the batch is resampled with torch).
    ``path``: another build of it, loaded afresh (the tests' host-only build)."""
    global _kernel
    if path is not None:
        return _open_kernel(path)
    with _lock:
        if _kernel is None:
            _kernel = _open_kernel(_KERNEL) if _KERNEL.exists() else False
        return _kernel or None


def cuda_kernel() -> Any:
    """The kernel's library where it was built with its CUDA entry (nvcc), else None."""
    lib = load_kernel()
    return lib if lib is not None and hasattr(lib, "gpufeed_resample_cuda") else None


def _open_kernel(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    pointer, number = ctypes.c_void_p, ctypes.c_int
    lib.gpufeed_resample_host.argtypes = [pointer, number, pointer, number, number]
    lib.gpufeed_resample_host.restype = number
    if hasattr(lib, "gpufeed_resample_cuda"):  # absent from a build without nvcc
        lib.gpufeed_resample_cuda.argtypes = [pointer, number, pointer, number, number, number,
                                              pointer]
        lib.gpufeed_resample_cuda.restype = number
    return lib


def kernel_crops(regions: list[torch.Tensor], ys: Taps, xs: Taps, boxes: np.ndarray,
                 sizes: np.ndarray, flips: np.ndarray) -> np.ndarray:
    """The resample kernel's crops (``_CROP``) for ``regions`` (uint8 [h, w, 3], rows
    of 3-byte pixels, where ``ys``/``xs`` say they begin in their images), the boxes
    (top, left, height, width), the images' (height, width) and the flips."""
    crops = np.zeros(len(regions), _CROP)
    crops["src"] = [region.data_ptr() for region in regions]
    crops["pitch"] = [region.stride(0) for region in regions]
    crops["first_y"], crops["first_x"] = ys.first, xs.first
    crops["rows"] = [region.shape[0] for region in regions]
    crops["cols"] = [region.shape[1] for region in regions]
    crops["size_y"], crops["size_x"] = sizes[:, 0], sizes[:, 1]
    for k, name in enumerate(("top", "left", "height", "width")):
        crops[name] = boxes[:, k]
    crops["flip"] = flips
    return crops
