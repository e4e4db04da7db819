"""One resume test over every transport x sample kind, as torchdata runs one
save/load test over every node: stop a shuffled, randomly augmented pass
mid-way, save ``state_dict()``, resume in a new loader, and the batches before
and after the stop are, together, exactly an uninterrupted pass: every sample
once, in the same order, with identical content (bit for bit: the same
request, seed and epoch give the same crops, flips and clips)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from clips import encode_video
from gpufeed.client import FeedClient
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess
from shards import write_shards

IMAGES, VIDEOS, ARRAYS = 14, 8, 14
SHARD_COUNTS = [5, 4, 6]  # batches of 3 straddle the shards' ends
BATCH = 3
STOP_AFTER = 2  # batches taken before the state is saved

# What a loader of each kind asks for; every random choice (crop, flip, clip
# start) is on, so identical content shows the resumed pass made the same ones.
_KINDS = {
    "image": dict(files=[f"img/{i:02d}.jpg" for i in range(IMAGES)], size=(24, 32),
                  resize="random_resized_crop", flip=0.5),
    "video": dict(files=[f"vid/{i}.mp4" for i in range(VIDEOS)], size=(16, 24), clip=(3, 2),
                  random_clip=True, flip=0.5),
    "array": dict(files=[f"arr/{i:02d}.npy" for i in range(ARRAYS)]),
    "shard": dict(files=[f"shards/train-{s:04d}.tar" for s in range(len(SHARD_COUNTS))],
                  size=(24, 32), resize="random_resized_crop", flip=0.5),
}
_TRANSPORTS = ["inline", "shm", pytest.param("cuda_ipc", marks=pytest.mark.cuda)]


@pytest.fixture(scope="module")
def feed(tmp_path_factory):
    """A server over one root holding images, videos, arrays and tar shards."""
    root = tmp_path_factory.mktemp("kinds")
    rng = np.random.default_rng(21)
    (root / "img").mkdir()
    for i in range(IMAGES):
        photo = synthetic_photo(rng, int(rng.integers(40, 80)), int(rng.integers(40, 80)))
        (root / "img" / f"{i:02d}.jpg").write_bytes(encode_jpeg(photo))
    (root / "vid").mkdir()
    for i in range(VIDEOS):
        (root / "vid" / f"{i}.mp4").write_bytes(encode_video(12 + i, "libx264", "mp4"))
    (root / "arr").mkdir()
    for i in range(ARRAYS):
        np.save(root / "arr" / f"{i:02d}.npy", rng.standard_normal((2, 5)).astype(np.float32))
    write_shards(root / "shards", SHARD_COUNTS)
    with ServerProcess(["--data-root", str(root), "--threads", "2"]) as server, \
            FeedClient(server.address) as client:
        yield client


def _owned(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's tensors copied to the CPU: views of a slot go back to the server."""
    return {name: tensor.cpu().clone() for name, tensor in batch.items()}


def _same(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys(), k
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (k, name)


@pytest.mark.parametrize("kind", list(_KINDS))
@pytest.mark.parametrize("transport", _TRANSPORTS)
def test_a_pass_stopped_saved_and_resumed_is_the_uninterrupted_pass(feed, transport, kind):
    options = dict(_KINDS[kind], batch_size=BATCH, shuffle=True, seed=5, epoch=1,
                   transport=transport)
    whole = [_owned(b) for b in feed.loader(**options)]
    samples = sum(len(b["index"]) for b in whole)
    assert sorted(i for b in whole for i in b["index"].tolist()) == list(range(samples))

    first = feed.loader(**options)
    before = []
    for batch in first:
        before.append(_owned(batch))
        if len(before) == STOP_AFTER:
            break
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint file holds it
    first.close()
    assert state["epoch"] == 1 and state["samples_consumed"] == STOP_AFTER * BATCH

    resumed = feed.loader(**{**options, "epoch": 0})  # the state, not the argument, decides
    resumed.load_state_dict(state)
    after = [_owned(b) for b in resumed]

    _same(before + after, whole)  # every sample once, same order, same content
