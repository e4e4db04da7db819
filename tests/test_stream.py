"""End to end: a real server subprocess, the client library, both transports."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support import MIN_PSNR_DB, psnr, reference_decode, shm_prefix, stream_segments, wait_until

TRANSPORTS = ["inline", "shm"]


def _drain(loader) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in batch.items()} for batch in loader]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_sample_once_labels_aligned_pixels_match(feed, data_dir, image_names, transport):
    labels = [(i * 7) % 10 for i in range(len(image_names))]
    loader = feed.loader(files=image_names, labels=labels, batch_size=32, size=(96, 128),
                         transport=transport)
    batches = _drain(loader)

    assert loader.transport == transport
    assert loader.failures == []
    index = torch.cat([b["index"] for b in batches]).tolist()
    assert sorted(index) == list(range(len(image_names)))
    assert [len(b["index"]) for b in batches] == [32] * 9 + [12]
    for batch in batches:
        image = batch["image"]
        assert image.dtype == torch.uint8 and image.shape[1:] == (3, 96, 128)
        assert image.is_contiguous()
        assert batch["label"].tolist() == [labels[i] for i in batch["index"].tolist()]
        for row, i in enumerate(batch["index"].tolist()):
            ref = reference_decode(data_dir / image_names[i], 96, 128)
            assert psnr(image[row].numpy(), ref) >= MIN_PSNR_DB, image_names[i]


def test_list_file_with_prefix(feed, image_names, data_dir):
    (data_dir / "sub.flist").write_text("\n".join(n.removeprefix("img") for n in image_names[:10]))
    loader = feed.loader(files="sub.flist", prefix="img", batch_size=4, size=(32, 32))
    index = [i for b in loader for i in b["index"].tolist()]
    assert index == list(range(10))


def test_shuffle_is_a_function_of_seed_and_epoch(feed, image_names):
    def order(epoch: int, seed: int = 5) -> list[int]:
        loader = feed.loader(files=image_names, batch_size=50, size=(16, 16), shuffle=True,
                             seed=seed, epoch=epoch, transport="shm")
        return [i for b in loader for i in b["index"].tolist()]

    first = order(0)
    assert sorted(first) == list(range(len(image_names)))
    assert first != list(range(len(image_names)))
    assert order(0) == first
    assert order(1) != first and sorted(order(1)) == sorted(first)
    assert order(0, seed=6) != first


def test_each_new_pass_is_the_next_epoch_unless_set_epoch_chose_one(feed, image_names):
    """A loop that never calls set_epoch gets a new order each pass; ``loader.epoch`` is
    the epoch of the pass in progress, or of the next one; a pass left early is
    continued by the next (docs/guide/loader.md, "Epochs and passes")."""
    def order(loader) -> list[int]:
        return [i for b in loader for i in b["index"].tolist()]

    options = dict(files=image_names[:40], batch_size=8, size=(16, 16), shuffle=True)
    loader = feed.loader(**options)
    assert loader.epoch == 0
    epoch0 = order(loader)
    assert loader.epoch == 1  # epoch 0 is done: the next pass is epoch 1
    epoch1 = order(loader)  # no set_epoch: the next epoch
    assert loader.epoch == 2
    assert epoch1 != epoch0 and sorted(epoch1) == sorted(epoch0)
    assert epoch1 == order(feed.loader(epoch=1, **options))
    loader.set_epoch(0)  # chosen: that epoch, from its start
    assert order(loader) == epoch0
    loader.set_epoch(5)
    loader.set_epoch(5)  # the same choice twice is one pass of epoch 5
    assert order(loader) == order(feed.loader(epoch=5, **options))
    for k, _ in enumerate(loader):  # a pass of epoch 6 left early, after 2 batches...
        if k == 1:
            break
    assert loader.epoch == 6
    assert order(loader) == order(feed.loader(epoch=6, **options))[16:]  # ...is continued


def test_world_size_splits_into_disjoint_shards(feed, image_names):
    shards = []
    for rank in range(3):
        loader = feed.loader(files=image_names, batch_size=16, size=(16, 16), shuffle=True,
                             seed=1, rank=rank, world_size=3)
        shards.append([i for b in loader for i in b["index"].tolist()])
    assert all(i % 3 == rank for rank, shard in enumerate(shards) for i in shard)
    union = sorted(i for shard in shards for i in shard)
    assert union == list(range(len(image_names)))


def test_drop_last(feed, image_names):
    loader = feed.loader(files=image_names[:50], batch_size=16, size=(16, 16), drop_last=True)
    assert [len(b["index"]) for b in loader] == [16, 16, 16]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_full_size_batches(feed, data_dir, image_names, transport):
    """256 x 3 x 224 x 224 uint8 is 38.5 MB a batch: beyond gRPC's default 4 MiB message."""
    loader = feed.loader(files=image_names[:256], batch_size=256, size=(224, 224),
                         transport=transport, prefetch=1)
    (batch,) = list(loader)
    assert batch["image"].shape == (256, 3, 224, 224)
    assert batch["index"].tolist() == list(range(256))
    for row in (0, 129, 255):
        ref = reference_decode(data_dir / image_names[row], 224, 224)
        assert psnr(batch["image"][row].numpy(), ref) >= MIN_PSNR_DB


def test_bad_samples_fail_alone(feed, data_dir, image_names):
    (data_dir / "not-an-image.jpg").write_bytes(b"this is text, not a JPEG\n" * 20)
    (data_dir / "empty.jpg").write_bytes(b"")
    files = image_names[:10] + ["not-an-image.jpg", "missing.jpg", "empty.jpg"] + image_names[10:20]
    loader = feed.loader(files=files, batch_size=8, size=(32, 32), labels=list(range(len(files))))
    batches = _drain(loader)
    index = [i for b in batches for i in b["index"].tolist()]
    assert index == [i for i in range(len(files)) if i not in (10, 11, 12)]
    assert all(b["label"].tolist() == b["index"].tolist() for b in batches)
    failures = dict(loader.failures)
    assert sorted(failures) == [10, 11, 12]
    assert failures[11] == "missing.jpg: file not found"
    assert "empty" in failures[12]


def test_held_shm_batches_stay_intact(feed, data_dir, image_names):
    """A slot is never rewritten while the trainer still holds a view of it."""
    loader = feed.loader(files=image_names[:64], batch_size=8, size=(48, 48), transport="shm",
                         prefetch=4)
    held = []
    for k, batch in enumerate(loader):
        if k < 3:
            held.append(batch)  # batches 3..7 must cycle through the two other slots
    for batch in held:
        for row, i in enumerate(batch["index"].tolist()):
            ref = reference_decode(data_dir / image_names[i], 48, 48)
            assert psnr(batch["image"][row].numpy(), ref) >= MIN_PSNR_DB


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_kept_batches_equal_copies(feed, image_names, transport):
    """A trainer that keeps its batches (list(loader), an eval loop collecting labels)
    gets what copy=True gives: a tensor it still references never changes. With
    prefetch=2 the ring has 3 slots for 15 batches."""
    options = dict(files=image_names[:120], labels=[(i * 7) % 10 for i in range(120)],
                   batch_size=8, size=(16, 16), shuffle=True, seed=2, transport=transport,
                   prefetch=2)
    expected = list(feed.loader(copy=True, **options))
    kept = list(feed.loader(**options))
    assert len(kept) == len(expected) == 15
    for got, want in zip(kept, expected):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
    labels, index = [], []
    for batch in feed.loader(**options):  # an eval loop: keeps a view of each batch
        labels.append(batch["label"])
        index.append(batch["index"])
    assert torch.equal(torch.cat(labels), torch.cat([b["label"] for b in expected]))
    assert sorted(torch.cat(index).tolist()) == list(range(120))


def test_copy_gives_owned_tensors(feed, data_dir, image_names):
    loader = feed.loader(files=image_names[:40], batch_size=8, size=(24, 24), transport="shm",
                         prefetch=1, copy=True)
    held = list(loader)  # holding all five batches needs no warning: they are copies
    assert [i for b in held for i in b["index"].tolist()] == list(range(40))
    ref = reference_decode(data_dir / image_names[0], 24, 24)
    assert psnr(held[0]["image"][0].numpy(), ref) >= MIN_PSNR_DB


def test_no_segment_left_after_a_pass(feed, server, image_names):
    prefix = shm_prefix(server.address)
    loader = feed.loader(files=image_names[:20], batch_size=4, size=(16, 16), transport="shm")
    for k, _ in enumerate(loader):
        if k == 0:  # mid-stream: the name goes as soon as the server hears the client mapped it
            assert wait_until(lambda: not stream_segments(prefix))
    assert stream_segments(prefix) == set()


def test_auto_picks_shm_on_the_same_host(feed, image_names):
    loader = feed.loader(files=image_names[:4], batch_size=4, size=(16, 16))
    list(loader)
    assert loader.transport == "shm"


def test_resume_from_state_dict(feed, image_names):
    loader = feed.loader(files=image_names[:60], batch_size=8, size=(16, 16), shuffle=True,
                         seed=3, epoch=2)
    full = [b["index"].tolist() for b in loader]
    partial = feed.loader(files=image_names[:60], batch_size=8, size=(16, 16), shuffle=True,
                          seed=3, epoch=2)
    for k, _ in enumerate(partial):
        if k == 2:
            break
    state = partial.state_dict()
    assert state["epoch"] == 2 and state["samples_consumed"] == 24
    resumed = feed.loader(files=image_names[:60], batch_size=8, size=(16, 16), shuffle=True, seed=3)
    resumed.load_state_dict(state)
    assert [b["index"].tolist() for b in resumed] == full[3:]
    assert np.array_equal(sorted(i for b in full for i in b), np.arange(60))


def test_short_shm_streams_are_mapped_before_the_server_lets_go(feed, image_names):
    """A stream shorter than its ring is sent whole at once; its segment must outlive that."""
    for _ in range(20):
        loader = feed.loader(files=image_names[:3], batch_size=1, size=(8, 8), transport="shm")
        assert [i for b in loader for i in b["index"].tolist()] == [0, 1, 2]


def test_a_state_saved_at_the_end_of_an_epoch_resumes_at_the_next(feed, image_names):
    files = image_names[:24]
    loader = feed.loader(files=files, batch_size=8, size=(8, 8), shuffle=True, seed=1)
    assert len([b for b in loader]) == 3
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["samples_consumed"] == 0
    epoch1 = [i for b in loader for i in b["index"].tolist()]  # what this loader does next
    restored = feed.loader(files=files, batch_size=8, size=(8, 8), shuffle=True, seed=1)
    restored.load_state_dict(state)
    assert restored.epoch == 1
    assert [i for b in restored for i in b["index"].tolist()] == epoch1


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_rank_gets_as_many_batches_and_repeats_are_marked(feed, image_names, shuffle):
    """10 samples over 3 ranks: padded to 12 as DistributedSampler pads (repeating samples
    from the start), so no rank has a batch more for DDP to wait on at the epoch's end."""
    files = image_names[:10]
    ranks = [_drain(feed.loader(files=files, batch_size=3, size=(8, 8), rank=rank,
                                world_size=3, shuffle=shuffle, seed=1))
             for rank in range(3)]
    assert [len(batches) for batches in ranks] == [2, 2, 2]
    index = torch.cat([b["index"] for batches in ranks for b in batches])
    padded = torch.cat([b["padded"] for batches in ranks for b in batches])
    assert padded.dtype == torch.bool
    assert sorted(index[~padded].tolist()) == list(range(10))  # every sample once
    assert sorted(index[padded].tolist()) == [0, 1]  # and the repeats, marked


def test_padded_is_there_for_every_split_and_only_then(feed, image_names):
    split = _drain(feed.loader(files=image_names[:12], batch_size=4, size=(8, 8), rank=1,
                               world_size=3))
    assert [b["padded"].tolist() for b in split] == [[False] * 4]
    whole = _drain(feed.loader(files=image_names[:12], batch_size=4, size=(8, 8)))
    assert all("padded" not in b for b in whole)
