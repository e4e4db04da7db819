"""Video clips and pre-computed arrays through the whole service."""

from __future__ import annotations

import pickle

import grpc
import numpy as np
import pytest
import torch

from clips import encode_video, frame_number
from gpufeed.client import FeedError

FRAMES = 40


@pytest.fixture(scope="module")
def videos(data_dir):
    names = []
    for i, (codec, fmt, ext) in enumerate([("libx264", "mp4", "mp4"),
                                          ("mpeg4", "matroska", "mkv")] * 3):
        name = f"clip{i}.{ext}"
        (data_dir / name).write_bytes(encode_video(FRAMES, codec, fmt))
        names.append(name)
    return names


def _numbers(clip: torch.Tensor) -> list[int]:
    return [frame_number(frame.numpy()) for frame in clip]


def test_centred_clips_have_k_frames_at_the_stride(feed, videos):
    loader = feed.loader(files=videos, batch_size=4, size=(24, 40), clip=(5, 3),
                         labels=list(range(len(videos))))
    batches = [{k: v.clone() for k, v in b.items()} for b in loader]
    assert [b["image"].shape for b in batches] == [(4, 5, 3, 24, 40), (2, 5, 3, 24, 40)]
    start = (FRAMES - (4 * 3 + 1)) // 2
    for batch in batches:
        for clip in batch["image"]:
            assert _numbers(clip) == list(range(start, start + 13, 3))


def test_random_clips_follow_seed_and_epoch(feed, videos):
    def starts(epoch):
        loader = feed.loader(files=videos, batch_size=3, size=(24, 40), clip=(4, 2),
                             random_clip=True, seed=1, epoch=epoch)
        found = []
        for batch in loader:
            for clip in batch["image"]:
                numbers = _numbers(clip)
                assert numbers == list(range(numbers[0], numbers[0] + 8, 2))
                found.append(numbers[0])
        return found

    first = starts(0)
    assert starts(0) == first and starts(1) != first


def test_video_normalised_channels_last(feed, videos):
    plain = next(iter(feed.loader(files=videos[:2], batch_size=2, size=(24, 40), clip=(3, 1))))
    plain = plain["image"].clone()
    out = next(iter(feed.loader(files=videos[:2], batch_size=2, size=(24, 40), clip=(3, 1),
                                dtype="float32", layout="NHWC")))["image"]
    assert out.shape == (2, 3, 24, 40, 3)
    assert torch.allclose(out, plain.float().movedim(-3, -1) / 255)


def test_arrays_arrive_bit_for_bit(feed, data_dir):
    rng = np.random.default_rng(0)
    sources = []
    for i in range(10):
        arrays = {"feature": rng.standard_normal((3, 5)).astype(np.float32),
                  "mask": rng.integers(0, 2, (7,), dtype=np.uint8)}
        np.savez(data_dir / f"s{i}.npz", **arrays)
        np.save(data_dir / f"s{i}.npy", arrays["feature"])
        sources.append(arrays)
    for transport in ("inline", "shm"):
        loader = feed.loader(files=[f"s{i}.npz" for i in range(10)], batch_size=4,
                             transport=transport)
        got = {int(i): (b["feature"][r].clone(), b["mask"][r].clone()) for b in loader
               for r, i in enumerate(b["index"])}
        assert sorted(got) == list(range(10))
        for i, (feature, mask) in got.items():
            assert np.array_equal(feature.numpy(), sources[i]["feature"])
            assert np.array_equal(mask.numpy(), sources[i]["mask"])
    loader = feed.loader(files=[f"s{i}.npy" for i in range(10)], batch_size=10)
    (batch,) = list(loader)
    assert np.array_equal(batch["array"].numpy(), np.stack([s["feature"] for s in sources]))


@pytest.mark.parametrize("first", ["big", "little"])
def test_arrays_of_either_byte_order_arrive_with_their_values(feed, data_dir, first):
    """The wire names a dtype without a byte order: big-endian files (as some tools
    write) must be converted, whether or not the first file, which sets the batch's
    layout, is one of them."""
    values = np.array([[0, 1, -2], [70000, 2**30, -(2**31)]])
    for order, mark in (("big", ">"), ("little", "<")):
        np.save(data_dir / f"i4_{order}.npy", values.astype(f"{mark}i4"))
        np.save(data_dir / f"f8_{order}.npy", (values / 7).astype(f"{mark}f8"))
    second = "little" if first == "big" else "big"
    for kind, want in (("i4", values), ("f8", values / 7)):
        batch = next(iter(feed.loader(files=[f"{kind}_{first}.npy", f"{kind}_{second}.npy"],
                                      batch_size=2)))
        assert batch["array"].tolist() == [want.tolist()] * 2, kind


def test_pickled_and_mismatched_arrays_fail_alone(feed, data_dir):
    np.save(data_dir / "good0.npy", np.zeros((2, 2), np.float32))
    np.save(data_dir / "good1.npy", np.ones((2, 2), np.float32))
    np.save(data_dir / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    np.save(data_dir / "wider.npy", np.zeros((2, 3), np.float32))
    (data_dir / "pickle.npy").write_bytes(pickle.dumps({"evil": True}))
    files = ["good0.npy", "objects.npy", "wider.npy", "pickle.npy", "good1.npy"]
    loader = feed.loader(files=files, batch_size=5)
    (batch,) = list(loader)
    assert batch["index"].tolist() == [0, 4]
    reasons = dict(loader.failures)
    assert "pickle" in reasons[1] and "not a valid .npy file" in reasons[3]
    assert "[2, 3]" in reasons[2] and "[2, 2]" in reasons[2]

    with pytest.raises(FeedError) as info:  # the first sample sets the layout: it must be good
        list(feed.loader(files=["objects.npy", "good0.npy"], batch_size=2))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "pickle" in str(info.value)


def test_one_stream_serves_one_kind(feed, videos):
    with pytest.raises(FeedError) as info:
        list(feed.loader(files=["img0000.jpg", videos[0]], batch_size=2, size=(8, 8),
                         clip=(2, 1)))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "one stream serves one kind" in str(info.value)
    with pytest.raises(FeedError) as info:
        list(feed.loader(files=videos[:1], batch_size=1, size=(8, 8)))
    assert "clip" in str(info.value)
