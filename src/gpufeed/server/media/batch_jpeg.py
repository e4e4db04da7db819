"""JPEGs decoded a batch at a time by nvImageCodec: ``gpufeed-server --decoder nvimgcodec``.

nvImageCodec (NVIDIA's codec library, the one DALI uses) decodes a list of
images in one call: on a GPU with its hardware JPEG decoder where the chip has
one and nvJPEG's CUDA decoder where not; without a GPU, with its libjpeg-turbo
CPU backend (so this path is exercised, and tested, on any machine).

With the flag, a stream's JPEG rows are not decoded by the decode threads:
each thread reads its sample's bytes and draws its crop box from the size the
header declares (``defer``), and the thread that finishes the batch decodes
every row's region (the box's enclosing pixels, as a region of interest: only
they are decoded) in one call (``BatchJpegDecoder.decode``). Each region is
then resampled to the output on the decoder's device by two matrix products
whose weights are the CPU path's filter over the box's exact, sub-pixel
position (``resample_weights``: Pillow's bilinear triangle, widened when
shrinking, as src/gpufeed/server/media/_jpeg.c computes it), mirrored for a flip, and
written into the batch's row: within a level or two of Pillow cropping and
resizing the same box. It agrees as closely with the CPU path where that decodes
at full scale; where the box is twice the output or more, the CPU path lets
libjpeg shrink it in the IDCT (a coarser filter, ~30 dB against Pillow), and this
path, decoding the region at full scale, is the closer of the two. What this path
does not take (another format, a CMYK or YCCK JPEG, a file cut short) or cannot
decode (a broken file) is decoded by the CPU path from the same bytes, so it comes
out, or fails, exactly as without the flag.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .output import Box

__all__ = ["BatchJpegDecoder", "Deferred", "describe", "load", "resample_weights", "takes"]

_log = logging.getLogger(__name__)
_lock = threading.Lock()
# The module once load() has imported it: Any, as its names come from a C extension
# that ships no stubs.
_nvimgcodec: Any = None
_JPEG_MAGIC = b"\xff\xd8\xff"


def takes(data: bytes) -> bool:
    """Whether ``data`` is a JPEG, to be decoded at the batch's end."""
    return data[:3] == _JPEG_MAGIC


def load() -> Any:
    """nvImageCodec's Python module, imported once. Its import prints, on the process's
    own stdout and stderr, a line for every extension whose library is missing (JPEG
    2000 and TIFF here, which gpufeed does not use): those lines go to the log at debug
    level instead. ImportError, saying what to install, when it is not installed."""
    global _nvimgcodec
    with _lock:
        if _nvimgcodec is not None:
            return _nvimgcodec
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            try:
                from nvidia import nvimgcodec
            except ImportError as e:
                raise ImportError(f"--decoder nvimgcodec: nvImageCodec is not installed ({e}); "
                                  f"pip install 'gpufeed[gpu]'") from None
            finally:
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
            sink.seek(0)
            said = sink.read().decode(errors="replace").strip()
        if said:
            _log.debug("nvImageCodec, as it loaded its extensions: %s", said)
        _nvimgcodec = nvimgcodec
        return nvimgcodec


def describe(device: torch.device) -> str:
    """One line for the start-up log: the decoder and its backend."""
    nvimgcodec = load()
    where = (f"the GPU ({torch.cuda.get_device_name(device)}: hardware JPEG decoder where "
             f"the chip has one, else nvJPEG's CUDA decoder)" if device.type == "cuda"
             else "its libjpeg-turbo CPU backend (no GPU)")
    return (f"JPEG decoder: nvImageCodec {nvimgcodec.__version__}, a batch at a time, on "
            f"{where}; other formats on the decode threads")


@dataclass
class Deferred:
    """A row whose decode waits for the batch's end: its bytes, box and flip."""

    row: int
    data: bytes
    box: Box  # (top, left, height, width) in source pixels
    flip: bool
    size: tuple[int, int]  # the source's (height, width), as its header declares


def resample_weights(start: float, length: float, size: int, out: int
                     ) -> tuple[np.ndarray, int, int]:
    """The weights that resample source pixels [first, last) of an axis of ``size`` to
    ``out`` pixels over the window [start, start + length): float32 [out, last - first],
    each row summing to 1. The CPU path's filter (_jpeg.c's ``axis_make``): a triangle
    one (widened) pixel either side of each output pixel's centre, clipped to the
    image; an output pixel whose taps all fall outside takes the nearest pixel."""
    scale = length / out
    widen = max(scale, 1.0)
    centre = start + (np.arange(out) + 0.5) * scale
    lo = np.maximum(np.floor(centre - widen + 0.5).astype(np.int64), 0)
    hi = np.minimum(np.floor(centre + widen + 0.5).astype(np.int64), size)
    hi = np.minimum(hi, lo + int(np.ceil(widen)) * 2 + 2)
    edge = hi <= lo
    lo = np.where(edge, np.where(centre < 0.5, 0, size - 1), lo)
    hi = np.where(edge, lo + 1, hi)
    first, last = int(lo.min()), int(hi.max())
    x = np.arange(first, last)
    t = np.abs((x[None, :] + 0.5 - centre[:, None]) / widen)
    inside = (x[None, :] >= lo[:, None]) & (x[None, :] < hi[:, None])
    weights = np.where(inside & (t < 1.0), 1.0 - t, 0.0)
    sums = weights.sum(axis=1)
    nearest = sums <= 0
    weights[nearest] = x[None, :] == lo[nearest, None]
    weights /= np.where(nearest, 1.0, sums)[:, None]
    return weights.astype(np.float32), first, last


def _whole(data: bytes) -> bool:
    """Whether a JPEG's compressed data ends: an end-of-image marker after its first scan.

    libjpeg-turbo (the CPU path, and nvImageCodec's CPU backend) fails a file cut short;
    nvJPEG on a GPU fills the missing part and reports success, so a cut file is handed
    back to the CPU path, which fails it as it would without the flag. The marker
    segments before the scan are walked by their lengths (a thumbnail in an APP segment
    has an end marker of its own); inside the scan a 0xFF byte is followed by 0x00 or a
    restart marker, so the first FF D9 after it is the end."""
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return False
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
        elif marker == 0xDA:  # start of scan
            return data.find(b"\xff\xd9", at + 2) != -1
        elif 0xD0 <= marker <= 0xD8 or marker == 0x01:  # markers without a length
            at += 2
        else:
            at += 2 + int.from_bytes(data[at + 2:at + 4], "big")
    return False


class BatchJpegDecoder:
    """One decode thread's nvImageCodec decoder, on ``device`` (a GPU, or the CPU
    backend), with its own CUDA stream so that threads decode at once."""

    def __init__(self, device: torch.device):
        nvimgcodec = load()
        self.device = device
        if device.type == "cuda":
            self._decoder = nvimgcodec.Decoder(device_id=device.index or 0)
            self._stream = torch.cuda.Stream(device)
        else:
            self._decoder = nvimgcodec.Decoder(
                device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)])
            self._stream = None
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                               color_spec=nvimgcodec.ColorSpec.SRGB)
        self._nvimgcodec = nvimgcodec

    def decode(self, jobs: list[Deferred], out: np.ndarray) -> list[Deferred]:
        """Write each job's row of ``out`` (uint8 [N, 3, H, W], host memory); returns the
        jobs nvImageCodec could not decode, for the CPU path."""
        if not jobs:
            return []
        if self._stream is None:
            return self._decode(jobs, out)
        with torch.cuda.stream(self._stream):
            return self._decode(jobs, out)

    def _decode(self, jobs: list[Deferred], out: np.ndarray) -> list[Deferred]:
        nvimgcodec = self._nvimgcodec
        height, width = out.shape[2:]
        regions, axes, taken, failed = [], [], [], []
        for job in jobs:
            top, left, box_h, box_w = job.box
            ys = resample_weights(top, box_h, job.size[0], height)
            xs = resample_weights(left, box_w, job.size[1], width)
            if not _whole(job.data):  # nvJPEG on a GPU decodes a cut file without a word
                failed.append(job)
                continue
            try:
                code = nvimgcodec.CodeStream(job.data)
                # A header that disagrees with the one read, or CMYK / YCCK (4 channels),
                # which the CPU path converts as it always has: handed back.
                if (code.height, code.width) != job.size or code.num_channels not in (1, 3):
                    raise ValueError("not for this path")
                regions.append(code.get_sub_code_stream(
                    region=nvimgcodec.Region(ys[1], xs[1], ys[2], xs[2])))
            except (RuntimeError, ValueError):  # not a stream nvImageCodec reads
                failed.append(job)
                continue
            axes.append((ys[0], xs[0][::-1].copy() if job.flip else xs[0]))
            taken.append(job)
        if not regions:
            return failed
        stream = self._stream.cuda_stream if self._stream is not None else 0
        decoded = self._decoder.decode(regions, params=self._params, cuda_stream=stream)
        rows, results = [], []
        for job, image, (wy, wx) in zip(taken, decoded, axes):
            if image is None:
                failed.append(job)
                continue
            region = self._tensor(image).permute(2, 0, 1).float()  # [3, h, w]
            if region.shape[1:] != (wy.shape[1], wx.shape[1]):
                failed.append(job)
                continue
            wy_t = torch.from_numpy(wy).to(self.device, non_blocking=True)
            wx_t = torch.from_numpy(wx).to(self.device, non_blocking=True)
            results.append(torch.matmul(torch.matmul(wy_t, region), wx_t.T))
            rows.append(job.row)
        if results:
            pixels = torch.stack(results).round_().clamp_(0, 255).to(torch.uint8)
            torch.from_numpy(out)[rows] = pixels.cpu()
        return failed

    def _tensor(self, image) -> torch.Tensor:
        """A decoded region as a uint8 [h, w, 3] tensor where it lies (no copy on a GPU)."""
        if self.device.type == "cuda":
            try:  # DLPack: torch's stream waits for the decoder's, as the protocol says
                return torch.from_dlpack(image)
            except (TypeError, BufferError):  # an exporter without the stream argument
                torch.cuda.current_stream(self.device).synchronize()
                return torch.as_tensor(image, device=self.device)
        return torch.from_numpy(np.asarray(image.cpu()))
