"""Tar shards on a local data root: every sample once with its label, the shuffle rule,
exact resume mid-shard, and bad shards failing only their samples."""

from __future__ import annotations

import io
import os
import time

import grpc
import numpy as np
import pytest
from PIL import Image

from gpufeed.client import FeedClient, FeedError
from gpufeed.server.process import ServerProcess
from gpufeed.server.serving.planning.order import SHUFFLE_BUFFER, buffer_shuffle
from gpufeed.server.storage.shardnames import expand_braces
from shards import corrupt_shard, cut_shard, label_of, write_shards
from support import MIN_PSNR_DB, psnr

COUNTS = [7, 5, 9, 6]  # samples per shard: batches of 4 straddle shard ends
PATTERN = "train-{0000..0003}.tar"
SIZE = (32, 40)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    names, jpegs = write_shards(folder / "train", COUNTS)
    (folder / "train.shards").write_text("\n".join(f"train/{n}" for n in names) + "\n")
    (folder / "bad").mkdir()
    (folder / "bad" / "cut.tar").write_bytes(cut_shard())
    (folder / "bad" / "corrupt.tar").write_bytes(corrupt_shard())
    return folder, names, jpegs


@pytest.fixture(scope="module")
def feed(shard_dir):
    with ServerProcess(["--data-root", str(shard_dir[0]), "--threads", "2"]) as server, \
            FeedClient(server.address) as client:
        yield client


def _pass(loader) -> list[list[int]]:
    return [batch["index"].tolist() for batch in loader]


def test_brace_patterns_expand_with_padding():
    assert expand_braces("a-{08..11}.tar") == ["a-08.tar", "a-09.tar", "a-10.tar", "a-11.tar"]
    assert expand_braces("{x,y}/s-{0..1}.tar") == ["x/s-0.tar", "x/s-1.tar", "y/s-0.tar",
                                                    "y/s-1.tar"]


@pytest.mark.parametrize("files", [[PATTERN], "train.shards"], ids=["pattern", "list_file"])
def test_every_sample_once_with_its_label_and_pixels(feed, shard_dir, files):
    _, _, jpegs = shard_dir
    loader = feed.loader(files, prefix="train/" if files == [PATTERN] else "",
                         batch_size=4, size=SIZE)
    seen = []
    for batch in loader:
        for index, label, image in zip(batch["index"].tolist(), batch["label"].tolist(),
                                       batch["image"].numpy()):
            assert label == label_of(index)
            with Image.open(io.BytesIO(jpegs[index])) as im:
                ref = np.asarray(im.convert("RGB").resize(SIZE[::-1], Image.BILINEAR))
            assert psnr(image, ref.transpose(2, 0, 1)) >= MIN_PSNR_DB
            seen.append(index)
    assert seen == list(range(sum(COUNTS)))  # unshuffled: shard after shard, in order
    assert loader.failures == []


def test_shuffle_is_deterministic_by_seed_and_epoch_and_splits_shards_by_rank(feed):
    def order(**kw):
        return sum(_pass(feed.loader([PATTERN], prefix="train/", batch_size=4, size=SIZE,
                                     shuffle=True, **kw)), [])

    first = order(seed=3, epoch=1)
    assert first == order(seed=3, epoch=1)
    assert sorted(first) == list(range(sum(COUNTS)))
    assert first != order(seed=3, epoch=2) and first != list(range(sum(COUNTS)))
    ranks = []
    for r in range(2):
        batches = list(feed.loader([PATTERN], prefix="train/", batch_size=4, size=SIZE,
                                   shuffle=True, seed=3, epoch=1, rank=r, world_size=2))
        ranks.append([(i, p) for b in batches
                      for i, p in zip(b["index"].tolist(), b["padded"].tolist())])
    # Every rank as long as the longest; the shorter repeats its own samples, flagged padded.
    assert len(ranks[0]) == len(ranks[1])
    real = [[i for i, padded in rank if not padded] for rank in ranks]
    assert sorted(real[0] + real[1]) == list(range(sum(COUNTS)))
    for rank, own in zip(ranks, real):
        assert {i for i, padded in rank if padded} <= set(own)
    bounds = np.cumsum([0] + COUNTS)
    shard_of = lambda i: int(np.searchsorted(bounds, i, side="right")) - 1  # noqa: E731
    # Each rank reads whole shards: no shard is split between ranks.
    assert not {shard_of(i) for i in real[0]} & {shard_of(i) for i in real[1]}
    assert sum(COUNTS) < SHUFFLE_BUFFER  # (a buffer larger than the pass: a full permutation)


def test_resume_mid_shard_gives_exactly_the_rest(feed):
    kw = dict(batch_size=4, size=SIZE, shuffle=True, seed=5, prefix="train/")
    full = _pass(feed.loader([PATTERN], **kw))
    loader = feed.loader([PATTERN], **kw)
    it = iter(loader)
    for _ in range(2):  # 8 samples: one past the first shard's 7
        next(it)
    state = loader.state_dict()
    assert state["samples_consumed"] == 8
    resumed = feed.loader([PATTERN], **kw)
    resumed.load_state_dict(state)
    assert _pass(resumed) == full[2:]


def test_truncated_shard_and_bad_member_fail_their_samples_and_the_pass_goes_on(feed):
    loader = feed.loader(["bad/cut.tar", "bad/missing.tar", "bad/corrupt.tar"], batch_size=3,
                         size=SIZE, failure_budget=10)
    seen = sum(_pass(loader), [])
    failures = dict(loader.failures)
    # cut.tar: samples 0, 1 whole, 2 cut in its image, 3 gone (not indexed);
    # missing.tar: one failed placeholder (index 3); corrupt.tar: 4, 5, 6, its 5 corrupt.
    assert "truncated shard" in failures[2]
    assert "shard not found" in failures[3]
    categories = {f.index: f.category for f in loader.failures}
    assert categories[2] == "undecodable" and categories[3] == "not_found"
    assert 5 in failures
    assert seen == [0, 1, 4, 6]


def test_shards_outside_the_data_roots_and_missing_everywhere_are_refused(feed):
    with pytest.raises(FeedError) as refused:
        feed.loader(["../elsewhere-{0..1}.tar"], batch_size=2, size=SIZE)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(FeedError) as missing:
        feed.loader(["nowhere-{0..1}.tar"], batch_size=2, size=SIZE)
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(FeedError) as mixed:
        feed.loader(["train/train-0000.tar", "img.jpg"], batch_size=2, size=SIZE)
    assert mixed.value.code == grpc.StatusCode.INVALID_ARGUMENT and "samples" in str(mixed.value)


def test_shuffle_buffer_delivers_each_sample_within_its_bound():
    """The stated memory bound: delivery position p takes a sample among stream's first p + B."""
    stream = np.arange(500)
    out = buffer_shuffle(stream, np.random.default_rng([1, 2, 0]), 16)
    assert sorted(out.tolist()) == stream.tolist()
    assert all(sample < p + 16 for p, sample in enumerate(out.tolist()))
    assert out.tolist() != stream.tolist()


def test_many_shards_read_every_sample_once_and_leave_no_shard_open(tmp_path):
    """A stream keeps a few local shards open at a time (not one per sample, not all of
    them); every sample is still read once, and none stays open once the stream ends."""
    counts = [3] * 13  # more shards than a stream keeps open
    write_shards(tmp_path / "many", counts, name="m-{:04d}.tar")
    with ServerProcess(["--data-root", str(tmp_path), "--threads", "2"]) as server, \
            FeedClient(server.address) as client:
        for shuffle in (False, True):
            loader = client.loader(["many/m-{0000..0012}.tar"], batch_size=4, size=SIZE,
                                   shuffle=shuffle, seed=3)
            seen = [(i, label) for batch in loader
                    for i, label in zip(batch["index"].tolist(), batch["label"].tolist())]
            assert sorted(seen) == [(i, label_of(i)) for i in range(sum(counts))]
            assert loader.failures == []
        open_shards = _open_shards(server.proc.pid, tmp_path)
        deadline = time.monotonic() + 10  # the server closes a stream just after its end
        while open_shards and time.monotonic() < deadline:
            time.sleep(0.05)
            open_shards = _open_shards(server.proc.pid, tmp_path)
        assert open_shards == []


def _open_shards(pid: int, folder) -> list[str]:
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            pass
    return [link for link in links if link.startswith(os.path.realpath(folder))]
