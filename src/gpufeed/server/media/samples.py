"""What a sample is, by its file name, and how one is read into its row of a batch.

A stream serves one kind: images (decoded and scaled into ``image``), video
clips (k frames at a stride into ``image`` [k, 3, H, W]) or pre-computed arrays
(each key of the file into an array of that name). A request that mixes kinds
is refused. The readers run on decode threads; each thread has its own
``Decoders``. Every reader, these and the shards' (storage/shards.py), is a
``RowReader``: the stream calls the same three methods whatever it serves.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from ..config import DEFAULT_MAX_PIXELS
from ..storage.readahead import StreamReads
from ..storage.s3 import is_s3
from . import batch_jpeg
from .arrays import array_layout, check, read_arrays
from .batch_jpeg import BatchDecoders, Deferred
from .decode import ImageDecoder
from .draws import CLIP, sample_draws
from .fields import SampleFields
from .headers import declared_size
from .output import OutputTransform
from .video import VideoDecoder, centred_start, random_start

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

    from ..storage.paths import SamplePaths
    from ..storage.roots import Storage

__all__ = [
    "ArrayRows", "BatchDecoded", "Decoders", "ImageRows", "RowReader", "VideoRows",
    "is_sample_file", "sample_kind", "timed_read",
]

IMAGE, VIDEO, ARRAYS = "image", "video", "arrays"
# What a directory listing picks up as images: ImageFolder's extensions, and GIF.
# A file named in a list is an image whatever its suffix, unless video or arrays.
_IMAGES = {".jpg", ".jpeg", ".png", ".ppm", ".pgm", ".bmp", ".tif", ".tiff", ".webp", ".gif"}
_VIDEO = {".mp4", ".m4v", ".mkv", ".webm", ".avi", ".mov"}
_ARRAYS = {".npy", ".npz", ".pt", ".pth"}
_LISTED = _IMAGES | _VIDEO | _ARRAYS


def is_sample_file(name: str) -> bool:
    """Whether a directory listing serves this file: an image, video or array suffix."""
    return posixpath.splitext(name)[1].lower() in _LISTED


def kind_of(name: str) -> str:
    suffix = posixpath.splitext(name)[1].lower()
    return VIDEO if suffix in _VIDEO else ARRAYS if suffix in _ARRAYS else IMAGE


def sample_kind(names: Sequence[str]) -> str:
    """The one kind of every sample; ValueError naming two samples of different kinds."""
    first = kind_of(names[0])
    suffix = posixpath.splitext(names[0])[1]
    for name in names:
        # Ends in the first name's suffix after a character that is neither "/" nor ".":
        # the same suffix as splitext sees it. Only other names need kind_of.
        if suffix and name.endswith(suffix) and name[-len(suffix) - 1:-len(suffix)] not in "/.":
            continue
        if kind_of(name) != first:
            raise ValueError(f"samples: {names[0]!r} is {_kind_phrase(first)} but {name!r} "
                             f"is {_kind_phrase(kind_of(name))}; one stream serves one kind")
    return first


_Data = TypeVar("_Data")  # what a read returns: bytes, or a view of a chunk


def _kind_phrase(kind: str) -> str:
    return {IMAGE: "an image", VIDEO: "a video", ARRAYS: "an array file"}[kind]


def timed_read(stages: Mapping[str, Any], read: Callable[[], _Data]) -> tuple[_Data, float]:
    """``read()``'s bytes, its time observed in ``stages["read"]`` (also when it fails,
    so slow failures show in the histogram), and the ``perf_counter`` at its end, from
    which the caller times its decode into ``stages["decode"]``.

    Timed by hand: a Histogram's ``time()`` would make a Timer object per sample.
    """
    started = perf_counter()
    try:
        data = read()
    finally:
        ended = perf_counter()
        stages["read"].observe(ended - started)
    return data, ended


class Decoders:
    """One decode thread's decoders, its own, made when first needed; and ``batch``: the
    server's decoders that decode JPEGs a batch at a time (``--decoder nvimgcodec``:
    batch_jpeg.py), shared by every decode thread and made at start-up, or None (the
    decode threads decode them)."""

    def __init__(self, max_pixels: int = DEFAULT_MAX_PIXELS,
                 batch: BatchDecoders | None = None) -> None:
        self.image = ImageDecoder(max_pixels)
        self.max_pixels = max_pixels
        self.batch = batch
        self._video: VideoDecoder | None = None

    @property
    def video(self) -> VideoDecoder:
        if self._video is None:
            self._video = VideoDecoder(max_pixels=self.max_pixels)
        return self._video


class RowReader(Protocol):
    """How a stream's samples are read into their rows, one reader per stream.

    ``read_into`` runs on a decode thread, any number at once for different rows;
    it raises (OSError, DecodeError, ...) to fail that sample alone. ``stages``
    holds the metrics' stage timers by name ("read", "decode"). ``read_ahead``
    and ``forget`` are the I/O stage: readers whose storage can read ahead (S3
    shards and loose objects) issue a batch's reads when the batch is claimed and drop the ones
    never used when the stream ends; the defaults here do nothing.
    """

    def read_into(self, storage: Storage, path: str, index: int, arrays: dict[str, np.ndarray],
                  row: int, decoders: Decoders, stages: Mapping[str, Any]) -> None: ...

    def read_ahead(self, storage: Storage, samples: np.ndarray, paths: SamplePaths) -> None:
        """Issue the reads of a claimed batch's ``samples`` (``paths[i]``: sample i's located
        path) now (default: nothing)."""

    def forget(self, storage: Storage) -> None:
        """The stream ended: drop reads issued ahead for rows never decoded (default: nothing)."""

    def name(self, storage: Storage, paths: SamplePaths, index: int) -> str:
        """Sample ``index``'s name in its batch (``loader(names=True)``): by default its
        file as failures name it, relative to its data root (an S3 URL in full)."""
        return storage.shown(paths[index])

    def read_deferring(self, storage: Storage, path: str, index: int,
                       arrays: dict[str, np.ndarray], row: int, decoders: Decoders,
                       stages: Mapping[str, Any], deferred: list[Deferred]) -> None:
        """``read_into``, or, where the thread's decoders decode a batch at a time
        (batch_jpeg.py), the read alone, the decode left for ``decode_deferred`` at the
        batch's end (appended to ``deferred``). By default: ``read_into``."""
        self.read_into(storage, path, index, arrays, row, decoders, stages)

    def decode_deferred(self, deferred: list[Deferred], arrays: dict[str, np.ndarray],
                        decoders: Decoders, stages: Mapping[str, Any],
                        device_pixels: torch.Tensor | None = None) -> BatchDecoded:
        """Decode the rows ``read_deferring`` left, at the batch's end. ``device_pixels``:
        the batch's pixel rows where the trainer reads them on the GPU (cuda_ipc), offered
        when every row was left. By default none is left."""
        return BatchDecoded([])


@dataclass
class BatchDecoded:
    """What the decode of a batch's deferred rows came to: (row, error) of each that
    failed, and whether the pixels went to the ``device_pixels`` offered, not to the
    batch's host rows."""

    failed: list[tuple[int, BaseException]]
    on_device: bool = False


class ImageRows(RowReader):
    """Images, and the fields declared beside them (fields.py), into their rows."""

    def __init__(self, transform: OutputTransform, fields: SampleFields | None = None):
        self.transform = transform
        self.fields = fields
        self._ahead = StreamReads()  # S3 objects' reads issued ahead (storage/readahead.py)

    def read_ahead(self, storage: Storage, samples: np.ndarray, paths: SamplePaths) -> None:
        """Issue the reads of a batch's S3 objects now, when the storage reads ahead (it
        has no I/O stage without S3 roots)."""
        stage = storage.read_ahead
        if stage is None:
            return
        for sample in samples.tolist():
            path = paths[int(sample)]
            if is_s3(path):  # located and confined when the stream was planned
                self._ahead.issue(stage, sample, None, partial(storage.read, path),
                                  partial(storage.open_object, path))

    def forget(self, storage: Storage) -> None:
        """The stream ended: reads issued for rows nobody will decode give their bytes back."""
        self._ahead.forget(storage.read_ahead)

    def read_into(self, storage: Storage, path: str, index: int, arrays: dict[str, np.ndarray],
                  row: int, decoders: Decoders, stages: Mapping[str, Any]) -> None:
        data, read = self._read(storage, path, index, stages)
        self._decode(storage, path, index, data, arrays, row, decoders, stages, read)

    def read_deferring(self, storage: Storage, path: str, index: int,
                       arrays: dict[str, np.ndarray], row: int, decoders: Decoders,
                       stages: Mapping[str, Any], deferred: list[Deferred]) -> None:
        """A JPEG whose header declares its size is left for the batch's end (the crop box
        drawn from that size now); anything else, or fields beside the image (they need
        the pixels' window first), is decoded now."""
        data, read = self._read(storage, path, index, stages)
        size = declared_size(data) if self.fields is None and decoders.batch is not None \
            and batch_jpeg.takes(data) else None
        if size is None:
            self._decode(storage, path, index, data, arrays, row, decoders, stages, read)
            return
        width, height = size
        decoders.image.check_size(width, height)  # --max-pixels, as the CPU path checks it
        crop, flip = self.transform.choose(index)
        box = crop(height, width) if crop else (0, 0, height, width)
        deferred.append(Deferred(row, bytes(data), box, flip, (height, width)))

    def decode_deferred(self, deferred: list[Deferred], arrays: dict[str, np.ndarray],
                        decoders: Decoders, stages: Mapping[str, Any],
                        device_pixels: torch.Tensor | None = None) -> BatchDecoded:
        """One batched decode (batch_jpeg.py), into ``device_pixels`` where offered on the
        decoders' device and every JPEG decodes there; what it cannot decode, the CPU path
        decodes from the same bytes into the host rows, or fails as it would (the batch's
        pixels are then all on the host)."""
        started = perf_counter()
        image = arrays.get("decoded", arrays["image"])
        batch = decoders.batch
        assert batch is not None, "JPEGs are deferred only when a batched decoder is set"
        try:
            left = batch.decode(deferred, image, device_pixels)
        except Exception:  # the batched decode itself broke (a GPU error): the CPU path's turn
            _log.exception("nvImageCodec's batched decode failed; decoding the batch's %d "
                           "JPEGs on the decode thread", len(deferred))
            left = deferred
        finally:  # per batch: its own stage, not a sample's "decode"
            stages["batch_decode"].observe(perf_counter() - started)
        failed: list[tuple[int, BaseException]] = []
        for job in left:
            crop = lambda h, w, box=job.box: box  # noqa: E731 (the box already drawn)
            try:
                decoders.image.decode_into(job.data, image[job.row], crop, job.flip)
            except Exception as e:  # that sample fails, as on the CPU path
                failed.append((job.row, e))
        return BatchDecoded(failed, on_device=device_pixels is not None and not left)

    def _read(self, storage: Storage, path: str, index: int, stages: Mapping[str, Any]
              ) -> tuple[Any, float]:
        stage = storage.read_ahead
        if stage is None:  # local roots: nothing was issued ahead
            return timed_read(stages, partial(storage.read, path))
        return timed_read(stages, partial(self._ahead.take, stage, index,
                                          partial(storage.read, path)))

    def _decode(self, storage: Storage, path: str, index: int, data, arrays, row: int,
                decoders: Decoders, stages: Mapping[str, Any], read: float) -> None:
        crop, flip = self.transform.choose(index)
        image = arrays.get("decoded", arrays["image"])[row]
        try:  # the decoder flips; the batch pass does not
            window = decoders.image.decode_into(data, image, crop, flip)
            if self.fields is not None:
                # The sample after crop and flip: where a per-sample transform would run.
                sample = self.fields.read(storage, path, image, window, flip, decoders.max_pixels)
                self.fields.write(sample, arrays, row)
        finally:
            stages["decode"].observe(perf_counter() - read)


class VideoRows(RowReader):
    """k frames at ``stride``: from a random start in training, centred otherwise."""

    def __init__(self, transform: OutputTransform, clip_frames: int, stride: int,
                 random_start: bool):
        self.transform = transform
        self.frames, self.stride, self.random_start = clip_frames, stride, random_start

    def read_into(self, storage: Storage, path: str, index: int, arrays: dict[str, np.ndarray],
                  row: int, decoders: Decoders, stages: Mapping[str, Any]) -> None:
        _, arrays["flip"][row] = self.transform.choose(index)
        k, stride = self.frames, self.stride
        if self.random_start:
            rng = sample_draws(self.transform.seed, self.transform.epoch, index, CLIP)
            start = lambda n: random_start(n, k, stride, rng)  # noqa: E731
        else:
            start = lambda n: centred_start(n, k, stride)  # noqa: E731
        with stages["decode"].time(), os.fdopen(storage.open_checked(path), "rb") as file:
            decoders.video.decode_clip_into(file, arrays.get("decoded", arrays["image"])[row],
                                            stride=stride, start=start)


class ArrayRows(RowReader):
    """Each key of a sample's .npy/.npz/.pt into the batch array of that name."""

    def __init__(self, first: dict[str, np.ndarray]):
        self.layout = array_layout(first)

    def read_into(self, storage: Storage, path: str, index: int, arrays: dict[str, np.ndarray],
                  row: int, decoders: Decoders, stages: Mapping[str, Any]) -> None:
        with stages["decode"].time(), os.fdopen(storage.open_checked(path), "rb") as file:
            sample = read_arrays(file, posixpath.splitext(path)[1], storage.max_file_bytes)
            check(sample, self.layout)
            for key, array in sample.items():
                arrays[key][row] = array
