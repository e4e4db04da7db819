"""JPEGs decoded a batch at a time by nvImageCodec: ``gpufeed-server --decoder nvimgcodec``.

nvImageCodec (NVIDIA's codec library, the one DALI uses) decodes a list of
images in one call: on a GPU with its hardware JPEG decoder where the chip has
one and nvJPEG's CUDA decoder where not; without a GPU, with its libjpeg-turbo
CPU backend (so this path is exercised, and tested, on any machine).

With the flag, a stream's JPEG rows are not decoded by the decode threads: each
thread reads its sample's bytes and draws its crop box from the size the header
declares (``defer``), and the thread that finishes the batch decodes every row's
region (the box's enclosing pixels, as a region of interest: only they are decoded)
in one call (``BatchJpegDecoder.decode``). The regions are then resampled to the
output on the decoder's device with the CPU path's filter over each box's exact,
sub-pixel position (batch_resample.py: Pillow's bilinear triangle, widened when
shrinking, as src/gpufeed/server/media/_jpeg.c computes it), mirrored for a flip,
into the batch's rows: by one launch of gpufeed's CUDA kernel (_resample.cu) where
bench/gpu/prepare.sh built it, else by two batched matrix products (on any device).
Either is within a level or two of Pillow cropping and resizing the same box, and
within one of the other. It agrees as closely with the CPU path where that decodes at
full scale; where the box is twice the output or more, the CPU path lets libjpeg
shrink it in the IDCT (a coarser filter, ~30 dB against Pillow), and this path,
decoding the region at full scale, is the closer of the two. What this
path does not take (another format, a CMYK or YCCK JPEG, a file cut short) or cannot
decode (a broken file) is decoded by the CPU path from the same bytes, so it comes
out, or fails, exactly as without the flag.

Where the pixels go: a cuda_ipc batch whose every row is such a JPEG is written
straight into the slot on the GPU that the trainer reads (no trip through host
memory); any other batch goes to the slot's host rows, where the rows decoded on the
CPU join it and the gaps that failed rows leave are closed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import struct
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .batch_resample import Taps, crop_taps, cuda_kernel, kernel_crops, resample, upload
from .headers import jpeg_markers
from .output import Box

__all__ = ["CONCURRENT", "BatchDecoders", "BatchJpegDecoder", "Deferred", "describe", "load",
           "takes"]

_log = logging.getLogger(__name__)
_lock = threading.Lock()
# The module once load() has imported it: Any, as its names come from a C extension
# that ships no stubs.
_nvimgcodec: Any = None
_JPEG_MAGIC = b"\xff\xd8\xff"
# How many batches decode at once on one device (BatchDecoders). The server's batch decode
# made, on 1, 2, 4 and 16 threads: 4360, 4606, 4375 and 3849 images/s on an H100; 4620,
# 5089, 4219 and 4206 on an H200 (bench/RESULTS.md, "On a GPU"): beyond two, the
# decoders contend for the chip.
CONCURRENT = 2
# The most a decoder keeps pinned for a batch's files (_staged): page-locked memory is
# the host's to lose, and a batch of photos needs a few MB.
_STAGING_LIMIT = 64 << 20


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
    """One line for the start-up log: the decoder, its backend and the resampling."""
    nvimgcodec = load()
    where = (f"the GPU ({torch.cuda.get_device_name(device)}: hardware JPEG decoder where "
             f"the chip has one, else nvJPEG's CUDA decoder)" if device.type == "cuda"
             else "its libjpeg-turbo CPU backend (no GPU)")
    resampled = ("gpufeed's resample kernel" if device.type == "cuda" and cuda_kernel()
                 else "two batched matrix products")
    return (f"JPEG decoder: nvImageCodec {nvimgcodec.__version__}, a batch at a time, on "
            f"{where}, resampled by {resampled}; other formats on the decode threads")


@dataclass
class Deferred:
    """A row whose decode waits for the batch's end: its bytes, box and flip."""

    row: int
    data: bytes
    box: Box  # (top, left, height, width) in source pixels
    flip: bool
    size: tuple[int, int]  # the source's (height, width), as its header declares


def _check_device_rows(jobs: list[Deferred], out: np.ndarray, device_out: torch.Tensor,
                       device: torch.device) -> None:
    """ValueError unless ``device_out`` is the rows of ``jobs`` (sorted by row), on
    ``device``: uint8, shaped as ``out``'s rows, one for each job, in the jobs' order."""
    want = (len(jobs), *out.shape[1:])
    if device_out.device != device or device_out.dtype != torch.uint8 \
            or tuple(device_out.shape) != want:
        raise ValueError(f"device_out: {device_out.dtype} {tuple(device_out.shape)} on "
                         f"{device_out.device}; the decoder writes uint8 {want} on {device}")
    if [job.row for job in jobs] != list(range(len(jobs))):
        raise ValueError("device_out: the jobs are not its rows 0 .. n - 1, each once")


def _whole(data: bytes) -> bool:
    """Whether a JPEG's compressed data ends: an end-of-image marker after its first scan.

    libjpeg-turbo (the CPU path, and nvImageCodec's CPU backend) fails a file cut short;
    nvJPEG on a GPU fills the missing part and reports success, so a cut file is handed
    back to the CPU path, which fails it as it would without the flag. The marker
    segments before the scan are walked by their lengths (a thumbnail in an APP segment
    has an end marker of its own); inside the scan a 0xFF byte is followed by 0x00 or a
    restart marker, so an FF D9 after it is the end (looked for from the file's end,
    where it is, rather than through the compressed data)."""
    try:
        for marker, at in jpeg_markers(data):
            if marker == 0xD9:  # an end before any scan: no image
                return False
            if marker == 0xDA:  # start of scan
                return data.rfind(b"\xff\xd9", at + 2) != -1
    except struct.error:  # a header segment cut short
        pass
    return False


class BatchDecoders:
    """The server's batched decoders on one device, shared by its ``threads`` decode
    threads: a thread that finishes a batch takes a free one for the batch's decode, or
    waits for one (the wait is part of the ``batch_decode`` stage's time). Made when the
    server starts, so that the first batches do not each pay for a decoder
    (nvImageCodec's set-up on a GPU takes a good part of a second). On a GPU there are
    ``CONCURRENT`` of them, as more decode no faster; on the CPU backend, where each
    decodes on one core, one per decode thread."""

    def __init__(self, device: torch.device, threads: int):
        self.device = device
        count = min(CONCURRENT, threads) if device.type == "cuda" else threads
        self._free: queue.SimpleQueue[BatchJpegDecoder] = queue.SimpleQueue()
        for _ in range(max(count, 1)):
            self._free.put(BatchJpegDecoder(device))

    def decode(self, jobs: list[Deferred], out: np.ndarray,
               device_out: torch.Tensor | None = None) -> list[Deferred]:
        """``BatchJpegDecoder.decode`` on the first decoder free."""
        decoder = self._free.get()
        try:
            return decoder.decode(jobs, out, device_out)
        finally:
            self._free.put(decoder)


class BatchJpegDecoder:
    """One nvImageCodec decoder on ``device`` (a GPU, or the CPU backend), with its own
    CUDA stream so that decoders decode at once; one thread at a time uses it."""

    def __init__(self, device: torch.device, kernel: bool = True):
        """``kernel``: resample with gpufeed's CUDA kernel where it was built (on a GPU),
        else with torch."""
        nvimgcodec = load()
        self.device = device
        # The kernel's library, or None: resampled with torch.
        self._library = cuda_kernel() if kernel and device.type == "cuda" else None
        if device.type == "cuda":
            # One CPU thread per decoder: the server runs several decoders at once
            # (BatchDecoders), and nvImageCodec's default (a thread per core each)
            # measured slower.
            self._decoder = nvimgcodec.Decoder(device_id=device.index or 0, max_num_cpu_threads=1)
            self._stream = torch.cuda.Stream(device)
        else:
            self._decoder = nvimgcodec.Decoder(
                device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)])
            self._stream = None
        self._staging: torch.Tensor | None = None  # pinned, for the files (_staged)
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                               color_spec=nvimgcodec.ColorSpec.SRGB)
        self._nvimgcodec = nvimgcodec

    @property
    def uses_kernel(self) -> bool:
        """Whether batches are resampled by gpufeed's CUDA kernel (else by torch)."""
        return self._library is not None

    def decode(self, jobs: list[Deferred], out: np.ndarray,
               device_out: torch.Tensor | None = None) -> list[Deferred]:
        """Write each job's row of ``out`` (uint8 [N, 3, H, W], host memory); returns the
        jobs nvImageCodec could not decode, for the CPU path.

        ``device_out``: the rows where the batch is read on this decoder's device (cuda_ipc's
        device slot), offered when the jobs are every one of them: uint8 [n, 3, H, W] for
        the jobs' rows 0 .. n - 1. Where every job decodes here, the pixels are written
        there alone (nothing returned: the batch needs no trip through host memory);
        where one is handed back, they all go to ``out``, as without it. ValueError for
        rows that are not the jobs'.

        On a GPU this returns once the device's work for the batch is done (``_wait``),
        so whoever reads ``device_out`` next needs no event from this decoder's stream."""
        if not jobs:
            return []
        jobs = sorted(jobs, key=lambda job: job.row)  # decode threads defer in any order
        if device_out is not None:
            _check_device_rows(jobs, out, device_out, self.device)
        if self._stream is None:
            return self._decode(jobs, out, device_out)
        with torch.cuda.stream(self._stream):
            try:
                left = self._decode(jobs, out, device_out)
            except BaseException:
                # nvImageCodec may have queued work on streams of its own before it raised:
                # all of the device's work done before the next batch refills the staged
                # files (a GPU that broke may raise again here: the first error is the one).
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(self.device)
                raise
            self._wait()  # nothing queued still reads the staged files (_staged)
            return left

    def _decode(self, jobs: list[Deferred], out: np.ndarray,
                device_out: torch.Tensor | None) -> list[Deferred]:
        nvimgcodec = self._nvimgcodec
        whole = [_whole(job.data) for job in jobs]  # nvJPEG decodes a cut file without a
        failed = [job for job, ok in zip(jobs, whole) if not ok]  # word: handed back
        jobs = [job for job, ok in zip(jobs, whole) if ok]
        if not jobs:
            return failed
        height, width = out.shape[2:]
        boxes = np.array([job.box for job in jobs], np.float64)  # (top, left, height, width)
        sizes = np.array([job.size for job in jobs], np.int64)
        ys = crop_taps(boxes[:, 0], boxes[:, 2], sizes[:, 0], height)
        xs = crop_taps(boxes[:, 1], boxes[:, 3], sizes[:, 1], width)
        encoded = self._staged([job.data for job in jobs])
        streams, taken = [], []
        for k, job in enumerate(jobs):
            try:
                code = nvimgcodec.CodeStream(encoded[k])
                # A header that disagrees with the one read, or CMYK / YCCK (4 channels),
                # which the CPU path converts as it always has: handed back.
                if (code.height, code.width) != job.size or code.num_channels not in (1, 3):
                    raise ValueError("not for this path")
                streams.append(code.get_sub_code_stream(region=nvimgcodec.Region(
                    ys.first[k], xs.first[k], ys.last[k], xs.last[k])))
            except (RuntimeError, ValueError):  # not a stream nvImageCodec reads
                failed.append(job)
                continue
            taken.append(k)
        if not taken:
            return failed
        stream = self._stream.cuda_stream if self._stream is not None else 0
        decoded = self._decoder.decode(streams, params=self._params, cuda_stream=stream)
        spans = (ys.last - ys.first)[taken], (xs.last - xs.first)[taken]
        regions, kept = [], []
        for k, (image, h, w) in enumerate(zip(decoded, *spans)):
            region = self._tensor(image) if image is not None else None
            if region is None or tuple(region.shape) != (h, w, 3) or region.dtype != torch.uint8:
                failed.append(jobs[taken[k]])
                continue
            regions.append(region)
            kept.append(k)
        if not kept:
            return failed
        pick = np.array(taken)[kept]
        rows = [jobs[i].row for i in pick]
        ys, xs = ys.pick(pick), xs.pick(pick)
        flips = np.array([jobs[i].flip for i in pick])
        into = device_out if not failed else None  # else all to the host, with the rest
        pixels = None
        if self._library is not None:
            pixels = self._resample_kernel(regions, ys, xs, boxes[pick], sizes[pick], flips,
                                           (height, width), into)
        if pixels is None:  # every region into one zero-padded batch, two batched products
            padded = torch.zeros((len(regions), int(spans[0].max()), int(spans[1].max()), 3),
                                 dtype=torch.uint8, device=self.device)
            for k, region in enumerate(regions):
                padded[k, :region.shape[0], :region.shape[1]] = region
            pixels = resample(padded, ys, xs, flips)
        if into is None:
            self._copy_out(pixels, rows, out)
        elif pixels is not into:  # else the kernel wrote them there
            into.copy_(pixels)
        return failed

    def _copy_out(self, pixels: torch.Tensor, rows: list[int], out: np.ndarray) -> None:
        """The batch's pixels into their rows of ``out``. On a GPU the thread sleeps until
        the copy is done (an event with blocking sync): a plain copy would have it spin
        on a core for as long as the decode and resampling queued before it take."""
        whole = rows == list(range(out.shape[0]))
        if self.device.type != "cuda":  # on the host already
            if whole:
                torch.from_numpy(out).copy_(pixels)
            else:
                torch.from_numpy(out)[rows] = pixels
            return
        target = torch.from_numpy(out)
        # Straight into ``out`` where it is pinned (cuda_ipc's host ring); else through
        # pinned memory, as a copy into pageable memory would wait, spinning.
        direct = whole and target.is_pinned()
        host = target if direct else torch.empty(tuple(pixels.shape), dtype=torch.uint8,
                                                 pin_memory=True)
        host.copy_(pixels, non_blocking=True)
        self._wait()
        if not direct:
            target[rows] = host

    def _wait(self) -> None:
        """Sleep until what is queued on the decoder's stream is done (an event with
        blocking sync: a plain synchronize spins a core for as long)."""
        done = torch.cuda.Event(blocking=True)
        done.record(self._stream)
        done.synchronize()

    def _staged(self, files: list[bytes]) -> list[np.ndarray]:
        """The batch's files copied into one host buffer, as numpy views of it, which
        nvImageCodec reads in place. On a GPU the buffer is pinned: nvImageCodec copies
        each file to the GPU, and from pageable memory each copy waited on the CPU (about
        50 us an image, a third of the batch decode's CPU in torch.profiler on an H100);
        from pinned memory it is queued. The buffer is this decoder's, refilled per
        batch: ``decode`` returns only once its stream has nothing queued. (The CPU
        backend gains nothing from it, and takes the same path.)"""
        total = sum(len(data) for data in files)
        if total > _STAGING_LIMIT:  # a batch of huge files: read where they lie, unpinned
            return [np.frombuffer(data, np.uint8) for data in files]
        staging = self._staging
        if staging is None or staging.numel() < total:
            have = 0 if staging is None else staging.numel()
            staging = self._staging = torch.empty(max(total, 2 * have), dtype=torch.uint8,
                                                  pin_memory=self.device.type == "cuda")
        buffer = staging.numpy()
        views, at = [], 0
        for data in files:
            view = buffer[at:at + len(data)]
            view[:] = np.frombuffer(data, np.uint8)
            views.append(view)
            at += len(data)
        return views

    def _resample_kernel(self, regions: list[torch.Tensor], ys: Taps, xs: Taps,
                         boxes: np.ndarray, sizes: np.ndarray, flips: np.ndarray,
                         out_size: tuple[int, int], into: torch.Tensor | None
                         ) -> torch.Tensor | None:
        """The regions, where nvImageCodec left them, resampled by one kernel launch:
        uint8 [N, 3, H, W] on the device, in ``into`` where that is given and contiguous.
        ``sizes``: the source images' (height, width).
        The regions stay referenced by the caller until the batch has been copied out, so
        their memory outlives the kernel. None if the kernel does not launch (a driver
        older than its CUDA runtime, a chip it was not built for): it is then left off for
        this decoder, said once, and torch resamples."""
        library = self._library
        assert library is not None, "resampled by the kernel only where it was loaded"
        # A copy freed before the kernel runs is safe: torch reuses memory in stream order.
        regions = [r if r.stride()[1:] == (3, 1) else r.contiguous() for r in regions]
        crops = kernel_crops(regions, ys, xs, boxes, sizes, flips)
        on_device = upload(crops.view(np.uint8), self.device)
        if into is not None and into.is_contiguous():
            pixels = into
        else:
            pixels = torch.empty((len(regions), 3, *out_size), dtype=torch.uint8,
                                 device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        code = library.gpufeed_resample_cuda(on_device.data_ptr(), len(regions),
                                             pixels.data_ptr(), out_size[0], out_size[1],
                                             self.device.index or 0, stream)
        if code:
            _log.warning("gpufeed's resample kernel did not launch (code %d); this decode "
                         "thread resamples with torch from now on", code)
            self._library = None
            return None
        return pixels

    def _tensor(self, image) -> torch.Tensor:
        """A decoded region as a uint8 [h, w, 3] tensor where it lies (no copy on a GPU)."""
        if self.device.type == "cuda":
            try:  # DLPack: torch's stream waits for the decoder's, as the protocol says
                return torch.from_dlpack(image)
            except (TypeError, BufferError):  # an exporter without the stream argument
                torch.cuda.current_stream(self.device).synchronize()
                return torch.as_tensor(image, device=self.device)
        return torch.from_numpy(np.asarray(image.cpu()))
