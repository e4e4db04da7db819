"""Decode a video clip (k frames at a stride) straight into its row of a batch.

One ``VideoDecoder`` per decode thread, like ``ImageDecoder``: the clip's frames
are colour-converted and scaled (squash, bilinear) in one swscale pass each and
their planes copied into the ``uint8 [k, 3, H, W]`` row the caller hands in, so
there is no per-clip tensor and no collate copy. At the video's own size, a frame
whose width is not a multiple of 16 is first copied into a wider one, or
swscale would leave its right-most columns unwritten (``RgbScaler``, decode.py).

Only the frames the clip needs are decoded: the demuxer seeks to the nearest
keyframe at or before the clip's first frame and decoding runs forward from
there, stopping after the clip's last frame. A frame's index comes from its
timestamp (``(pts - start_time) * time_base * frame_rate``, rounded), not from
counting, because after a seek there is nothing to count from. If the seek lands
past the first wanted frame (a demuxer whose index is by decode time, say) or the
frames carry no timestamps, the clip is decoded again from the start of the file:
slower, still right.

Threading, measured on 2 cores (a quick measurement on a shared host, so the
throughput figures are noisy; CPU time per clip was steadier): 640x360 videos at
GOP 30 (H.264 from x264, and MPEG-4 Part 2), clips of 8 frames at stride 4 from
random starts, scaled to 112x112, 2 decode threads each decoding clips:

- FFmpeg frame threading (``thread_type="FRAME"``, 2 threads or auto) costs
  20-30% more CPU per clip (x264: 70 vs 57 ms, MPEG-4: 17.5 vs 13.2 ms) and
  gave fewer clips per second: 23 vs 36 (x264), 62 vs 106 (MPEG-4) on a quiet
  host. A seek-and-decode of a few dozen frames is too short to fill a frame
  pipeline, each clip opens a new codec and its threads, and the two decode
  threads already keep both cores busy. With one decode thread it did not win
  either (x264 16 vs 19.5 clips/s).
- Slice threading (PyAV's default, ``thread_count=0``) was within noise of one
  thread: x264 and most cameras write one slice per frame, so it has nothing to
  split and only starts threads.
- So the codec runs on the calling thread (``thread_count=1``), as swscale does
  (``threads=1``, one reformatter per decoder, as in decode.py); parallelism
  comes from the decode pool, one clip per thread, which scaled ~1.85x from one
  to two threads (FFmpeg releases the GIL). ``VideoDecoder(threads=N)`` turns
  frame threading on, for a host whose pool is smaller than its cores.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import BinaryIO

import av
import numpy as np
from av.error import FFmpegError

from ..config import DEFAULT_MAX_PIXELS
from .containers import HEAD_BYTES, VIDEO_FORMATS, open_container, video_format
from .decode import DecodeError, OverLimit, RgbScaler
from .draws import SampleDraws

__all__ = ["VideoDecoder", "centred_start", "random_start"]



def centred_start(n: int, k: int, stride: int) -> int:
    """The first frame of the clip centred in ``n`` frames (evaluation)."""
    return (n - _span(k, stride)) // 2


def random_start(n: int, k: int, stride: int, rng: SampleDraws | np.random.Generator) -> int:
    """A uniformly random first frame such that the clip fits in ``n`` frames (training).

    ``rng`` should be seeded from (seed, epoch, sample index) so that resume and
    any thread count pick the same clip.
    """
    return int(rng.integers(0, n - _span(k, stride) + 1))


class VideoDecoder:
    """Decodes clips into ``uint8 [k, 3, H, W]`` rows. Not thread-safe: one per thread.

    ``threads`` > 1 enables FFmpeg frame threading with that many threads; the
    default of 1 keeps decoding on the calling thread (see the module docstring).
    """

    def __init__(self, threads: int = 1, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        self._threads = threads
        self._max_pixels = max_pixels
        self._rgb = RgbScaler()

    def decode_clip_into(self, file: BinaryIO | str, out: np.ndarray, *, stride: int,
                         start: Callable[[int], int]) -> None:
        """Fill ``out`` [k, 3, H, W] with frames start, start+stride, ... of the first video stream.

        ``start(n)`` gets the number of frames in the video and returns the clip's
        first frame, which must leave room for the clip (``centred_start`` and
        ``random_start`` do; anything else is a ValueError, a caller's bug).
        Raises DecodeError when the file has no video stream, is too short for
        the clip, is not in an allowed container (containers.py), or cannot be
        decoded. ``file`` is a seekable binary file, read through Python
        callbacks, or a path, opened here.
        """
        if isinstance(file, str):  # read through Python too: FFmpeg may open nothing itself
            with open(file, "rb") as opened:
                return self.decode_clip_into(opened, out, stride=stride, start=start)
        k, channels, _, _ = out.shape
        if channels != 3 or out.dtype != np.uint8:
            raise ValueError(f"out must be uint8 [k, 3, H, W], not {out.dtype} {out.shape}")
        if k < 1 or stride < 1:
            raise ValueError(f"a clip needs k >= 1 and stride >= 1, not k={k}, stride={stride}")
        span = _span(k, stride)
        try:
            with _open(file) as container:
                if not container.streams.video:
                    raise DecodeError("no video stream")
                stream = container.streams.video[0]
                self._check_size(stream.codec_context)
                clock = _Clock(stream, container)
                if clock.frames < span:
                    raise DecodeError(f"clip needs {span} frames, video has {clock.frames}")
                first = int(start(clock.frames))
                if not 0 <= first <= clock.frames - span:
                    raise ValueError(f"start {first} leaves no room for a clip of {span} "
                                     f"frames in {clock.frames}")
                self._configure(stream.codec_context)
                wanted = range(first, first + span, stride)
                if first > 0:
                    container.seek(clock.pts_of(first), backward=True, any_frame=False,
                                   stream=stream)
                    if self._fill(container, stream, clock, wanted, out, seeked=True):
                        return
                    container.seek(clock.start_pts, backward=True, any_frame=False, stream=stream)
                self._fill(container, stream, clock, wanted, out, seeked=False)
        except FFmpegError as e:
            raise DecodeError(f"not a decodable video: {e}") from None

    def _check_size(self, codec) -> None:
        """Refuse a stream declaring frames over ``max_pixels``, before one is decoded."""
        if codec.width * codec.height > self._max_pixels:
            raise OverLimit(f"video declares {codec.width}x{codec.height} frames, over the "
                            f"limit of {self._max_pixels} pixels (gpufeed-server --max-pixels)")

    def _configure(self, codec) -> None:
        """Set the codec's threading before it opens (see the module docstring)."""
        codec.thread_count = self._threads
        if self._threads != 1:
            codec.thread_type = "FRAME"

    def _fill(self, container, stream, clock: _Clock, wanted: range, out: np.ndarray, *,
              seeked: bool) -> bool:
        """Decode forward into ``out``; False when a seek overshot (retry from the start).

        From the start of the file (``seeked`` False) frames without a timestamp
        are counted, and a frame missing from a variable-rate stream is filled
        with the next one.
        """
        pos, index = 0, -1
        for frame in container.decode(stream):
            if frame.pts is not None:
                index = clock.index_of(frame.pts)
            elif seeked:
                return False
            else:
                index += 1
            if seeked and pos == 0 and index > wanted[0]:
                return False
            if index < wanted[pos]:
                continue
            rgb = None
            while pos < len(wanted) and index >= wanted[pos]:
                rgb = self._put(frame, out[pos], rgb)
                pos += 1
            if pos == len(wanted):
                return True
        raise DecodeError(f"video ended at frame {index}, clip needs frame {wanted[-1]}")

    def _put(self, frame: av.VideoFrame, row: np.ndarray, rgb: av.VideoFrame | None):
        """Scale ``frame`` into ``row`` [3, H, W] (once per frame; ``rgb`` is the reuse)."""
        _, height, width = row.shape
        if rgb is None:
            rgb = self._rgb.scale(frame, width, height)
        self._rgb.copy(rgb, row)
        return rgb


class _Clock:
    """Maps a stream's timestamps to frame indices and back, and counts its frames."""

    def __init__(self, stream, container) -> None:
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        if not rate or stream.time_base is None:
            raise DecodeError("video has no frame rate")
        self.rate = Fraction(rate)
        self.time_base = Fraction(stream.time_base)
        self.start_pts = stream.start_time or 0
        self.frames = stream.frames or self._frames_from_duration(stream, container)

    def index_of(self, pts: int) -> int:
        return round((pts - self.start_pts) * self.time_base * self.rate)

    def pts_of(self, index: int) -> int:
        """The timestamp of frame ``index``, rounded down so a keyframe there is found."""
        return self.start_pts + int(index / (self.rate * self.time_base))

    def _frames_from_duration(self, stream, container) -> int:
        # Containers such as Matroska store no frame count; the duration times
        # the rate is exact for a constant rate and an estimate otherwise (a clip
        # that runs past the real end then fails with a clear reason).
        if stream.duration is not None:
            seconds = stream.duration * self.time_base
        elif container.duration is not None:
            seconds = Fraction(container.duration, av.time_base)
        else:
            return 0
        return int(seconds * self.rate + Fraction(1, 1000))


def _open(file: BinaryIO):
    """The video opened with the demuxer its first bytes call for, from the allow-list."""
    head = file.read(HEAD_BYTES)
    file.seek(0)
    demuxer = video_format(head)
    if demuxer is None:
        raise DecodeError(f"not a supported video format ({', '.join(VIDEO_FORMATS)})")
    return open_container(file, demuxer)


def _span(k: int, stride: int) -> int:
    """How many consecutive frames a clip of ``k`` frames at ``stride`` covers."""
    return (k - 1) * stride + 1
