"""VideoDecoder: clips of k frames at a stride, on videos generated here with PyAV.

Every frame shows its own number (tests/clips.py), and a small GOP makes most
clips start between keyframes, so seeking matters.
"""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from clips import encode_video, frame_number
from gpufeed.server.media.decode import DecodeError
from gpufeed.server.media.video import VideoDecoder, centred_start, random_start

FRAMES = 40
OUT_H, OUT_W = 24, 40  # squash to another aspect ratio

# (codec, container format): x264 with B-frames in MP4 (frame count in the
# header), MPEG-4 Part 2 in Matroska (no frame count: estimated from duration).
FORMATS = [("libx264", "mp4"), ("libx264", "matroska"), ("mpeg4", "matroska"), ("mpeg4", "mp4")]


def _reference(data: bytes) -> np.ndarray:
    """Every frame decoded from the start, without seeking, scaled the same way."""
    frames = []
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(video=0):
            gbr = frame.reformat(width=OUT_W, height=OUT_H, format="gbrp",
                                 interpolation="BILINEAR")
            g, b, r = (np.frombuffer(p, np.uint8).reshape(OUT_H, p.line_size)[:, :OUT_W]
                       for p in gbr.planes)
            frames.append(np.stack([r, g, b]))
    return np.stack(frames)


@pytest.fixture(scope="module", params=FORMATS, ids=lambda f: f"{f[0]}-{f[1]}")
def video(request):
    data = encode_video(FRAMES, *request.param)
    return data, _reference(data)


def _clip(data: bytes, k: int, stride: int, start, decoder: VideoDecoder | None = None):
    out = np.zeros((k, 3, OUT_H, OUT_W), np.uint8)
    (decoder or VideoDecoder()).decode_clip_into(io.BytesIO(data), out, stride=stride,
                                                 start=start)
    return out


def test_reference_frames_read_back_in_order(video):
    _, reference = video
    assert len(reference) == FRAMES
    assert [frame_number(f) for f in reference] == list(range(FRAMES))


@pytest.mark.parametrize("k,stride", [(1, 1), (4, 1), (3, 2), (4, 3), (3, 7)])
def test_every_start_gives_k_frames_at_the_stride(video, k, stride):
    """All possible starts: between keyframes, on them, at 0 and at the very end."""
    data, reference = video
    decoder = VideoDecoder()
    span = (k - 1) * stride + 1
    for first in range(FRAMES - span + 1):
        seen = []
        out = _clip(data, k, stride,
                    lambda n, first=first, seen=seen: (seen.append(n), first)[1], decoder)
        assert seen == [FRAMES]
        wanted = list(range(first, first + span, stride))
        assert [frame_number(f) for f in out] == wanted
        np.testing.assert_array_equal(out, reference[wanted])


def test_centred_and_random_starts(video):
    data, reference = video
    k, stride = 5, 3
    out = _clip(data, k, stride, lambda n: centred_start(n, k, stride))
    first = (FRAMES - 13) // 2
    assert [frame_number(f) for f in out] == list(range(first, first + 13, stride))

    decoder = VideoDecoder()
    starts = set()
    for sample in range(20):
        rng = np.random.default_rng([0, 1, sample])  # seed, epoch, sample index
        out = _clip(data, k, stride, lambda n, rng=rng: random_start(n, k, stride, rng), decoder)
        numbers = [frame_number(f) for f in out]
        starts.add(numbers[0])
        assert numbers == list(range(numbers[0], numbers[0] + 13, stride))
        np.testing.assert_array_equal(out, reference[numbers])
    assert len(starts) > 5


def test_start_helpers():
    assert centred_start(40, 5, 3) == 13
    assert centred_start(13, 5, 3) == 0
    rng = np.random.default_rng(0)
    starts = {random_start(20, 4, 2, rng) for _ in range(500)}
    assert starts == set(range(0, 14))
    assert random_start(7, 4, 2, rng) == 0


def test_clip_near_the_end_is_found_by_seeking(monkeypatch):
    """The last clip comes from one seek, not from decoding the file from frame 0."""
    data = encode_video(FRAMES, "libx264", "mp4")
    calls = []
    fill = VideoDecoder._fill

    def spy(self, *args, seeked, **kwargs):
        done = fill(self, *args, seeked=seeked, **kwargs)
        calls.append((seeked, done))
        return done

    monkeypatch.setattr(VideoDecoder, "_fill", spy)
    out = _clip(data, 3, 2, lambda n: n - 5)
    assert [frame_number(f) for f in out] == [35, 37, 39]
    assert calls == [(True, True)]


def test_path_and_file_objects(tmp_path):
    data = encode_video(FRAMES, "libx264", "matroska")
    path = tmp_path / "clip.mkv"
    path.write_bytes(data)
    out = np.zeros((3, 3, OUT_H, OUT_W), np.uint8)
    VideoDecoder().decode_clip_into(str(path), out, stride=4, start=lambda n: 17)
    assert [frame_number(f) for f in out] == [17, 21, 25]
    with open(path, "rb") as f:
        VideoDecoder().decode_clip_into(f, out, stride=1, start=lambda n: 36)
    assert [frame_number(f) for f in out] == [36, 37, 38]


def test_too_short_video_is_a_decode_error():
    data = encode_video(12, "libx264", "mp4")
    with pytest.raises(DecodeError, match="clip needs 16 frames, video has 12"):
        _clip(data, 4, 5, lambda n: 0)
    called = []
    with pytest.raises(DecodeError, match="clip needs 13 frames, video has 12"):
        _clip(data, 13, 1, called.append)
    assert called == []  # start() is not asked for a clip that cannot fit


def test_no_video_stream_is_a_decode_error():
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16",
                                           layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with pytest.raises(DecodeError, match="no video stream"):
        _clip(buf.getvalue(), 2, 1, lambda n: 0)


@pytest.mark.parametrize("data", [b"", b"not a video at all" * 100])
def test_undecodable_file_is_a_decode_error(data):
    with pytest.raises(DecodeError, match="not a supported video format"):
        _clip(data, 2, 1, lambda n: 0)


def test_truncated_video_is_a_decode_error():
    data = encode_video(FRAMES, "libx264", "mp4")
    with pytest.raises(DecodeError):
        _clip(data[: len(data) // 2], 2, 1, lambda n: n - 2)


def test_start_outside_the_video_is_a_caller_error():
    data = encode_video(FRAMES, "libx264", "mp4")
    with pytest.raises(ValueError, match="no room"):
        _clip(data, 3, 2, lambda n: n - 4)


def test_frame_threading_gives_the_same_clips():
    data = encode_video(FRAMES, "libx264", "mp4")
    reference = _reference(data)
    decoder = VideoDecoder(threads=2)
    for first in (0, 3, 11, 33):
        out = _clip(data, 4, 2, lambda n, first=first: first, decoder)
        np.testing.assert_array_equal(out, reference[first:first + 7:2])
