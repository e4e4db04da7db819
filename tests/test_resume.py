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
    # Where there is a GPU the server assembles batches on it, so that it offers cuda_ipc
    # beside inline and shm.
    device = ["--device", "cuda:0"] if torch.cuda.is_available() else []
    with ServerProcess(["--data-root", str(root), "--threads", "2", *device]) as server, \
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


# The rule for passes left early and for peeking (docs/guide/resume.md): the loader is a
# position in its epochs; a pass left early only stops taking batches, so the next pass
# continues the epoch, and state_dict() says what the next pass will do.

_IMAGE = dict(_KINDS["image"], batch_size=BATCH, shuffle=True, seed=5, epoch=1,
              transport="inline")


def _position(loader) -> tuple[int, int]:
    state = loader.state_dict()
    return state["epoch"], state["samples_consumed"]


def test_a_pass_left_early_is_continued_by_the_live_loader_and_by_its_state(feed):
    whole = [_owned(b) for b in feed.loader(**_IMAGE)]
    loader = feed.loader(**_IMAGE)
    before = []
    for batch in loader:
        before.append(_owned(batch))
        if len(before) == STOP_AFTER:
            break
    assert loader.epoch == 1 and _position(loader) == (1, STOP_AFTER * BATCH)
    restored = feed.loader(**{**_IMAGE, "epoch": 0})
    restored.load_state_dict(loader.state_dict())

    live = [_owned(b) for b in loader]  # the next pass: the rest of epoch 1
    _same(before + live, whole)
    _same([_owned(b) for b in restored], live)

    # That pass delivered the epoch's last batch: the next pass is epoch 2, from its start.
    assert loader.epoch == 2 and _position(loader) == (2, 0)
    _same([_owned(b) for b in loader], [_owned(b) for b in feed.loader(**{**_IMAGE, "epoch": 2})])


def test_a_peek_takes_one_batch_and_says_so(feed):
    whole = [_owned(b) for b in feed.loader(**_IMAGE)]
    loader = feed.loader(**_IMAGE)
    peeked = _owned(next(iter(loader)))
    _same([peeked], whole[:1])
    assert loader.epoch == 1 and _position(loader) == (1, BATCH)  # not a whole epoch
    restored = feed.loader(**_IMAGE)
    restored.load_state_dict(loader.state_dict())
    _same([_owned(b) for b in restored], whole[1:])
    _same([_owned(b) for b in loader], whole[1:])

    # A peek, then set_epoch before each pass (the README's loop): the whole epoch.
    again = feed.loader(**_IMAGE)
    next(iter(again))
    again.set_epoch(1)
    assert _position(again) == (1, 0)
    _same([_owned(b) for b in again], whole)


def test_only_the_newest_pass_may_be_iterated(feed):
    whole = [_owned(b) for b in feed.loader(**_IMAGE)]
    loader = feed.loader(**_IMAGE)
    older = iter(loader)
    first = _owned(next(older))
    newer = iter(loader)
    _same([first, _owned(next(newer))], whole[:2])  # the newer pass continues the epoch
    with pytest.raises(RuntimeError, match="newer pass"):
        next(older)  # two passes over one position would each skip the other's batches
    _same([_owned(b) for b in newer], whole[2:])


_ARRAY = dict(_KINDS["array"], batch_size=BATCH, shuffle=True, seed=5, epoch=1,
              transport="inline")


def test_what_does_not_decide_the_samples_is_not_in_the_fingerprint(feed):
    """A lossless compression, the transport, prefetch and the rank: a state saved without
    them resumes a loader with them. Any rank's state stands for every rank's (ranks of
    synchronous training consume as many batches): rank 1 goes on in its own order."""
    whole = [_owned(b) for b in feed.loader(**_ARRAY)]
    loader = feed.loader(**_ARRAY)
    before = [_owned(b) for _, b in zip(range(STOP_AFTER), iter(loader))]
    state = json.loads(json.dumps(loader.state_dict()))
    other = feed.loader(**{**_ARRAY, "compression": "zstd", "prefetch": 1, "transport": "shm"})
    other.load_state_dict(state)
    _same(before + [_owned(b) for b in other], whole)
    assert set(state["fingerprint"]).isdisjoint({"rank", "world_size", "compression"})

    ranks = dict(_ARRAY, world_size=2)
    rank1 = [_owned(b) for b in feed.loader(**ranks, rank=1)]
    saved_by_0 = feed.loader(**ranks, rank=0)
    next(iter(saved_by_0))
    resumed_1 = feed.loader(**ranks, rank=1)
    resumed_1.load_state_dict(saved_by_0.state_dict())
    _same([_owned(b) for b in resumed_1], rank1[1:])


def test_a_state_saved_before_elastic_resume_still_loads(feed):
    """Older states: world_size, rank and compression in the fingerprint, no world_size
    or resumed_from of their own, and no entry for a request field added since."""
    whole = [_owned(b) for b in feed.loader(**_IMAGE)]
    loader = feed.loader(**_IMAGE)
    next(iter(loader))
    state = loader.state_dict()
    old = {"epoch": state["epoch"], "samples_consumed": state["samples_consumed"],
           "fingerprint": {**state["fingerprint"], "rank": 0, "world_size": 1,
                           "compression": "e3b0c44298fc1c14"}}
    del old["fingerprint"]["sample_transforms"]  # as if saved before the field existed
    resumed = feed.loader(**_IMAGE)
    resumed.load_state_dict(old)
    _same([_owned(b) for b in resumed], whole[1:])
    transformed = feed.loader(**_IMAGE, transforms=["trivial_augment_wide"])
    with pytest.raises(ValueError, match="sample_transforms differs"):
        transformed.load_state_dict(old)
