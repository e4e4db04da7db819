"""What trainers bring from DataLoader: len, batch_size, errors when the loader is made,
paths as pathlib.Path, a square size as one int, a refused resume of another request."""

from __future__ import annotations

import gc
import shutil
import socket
from pathlib import Path

import grpc
import pytest
import torch

from gpufeed.client import FeedClient, FeedError


def _indices(loader) -> list[int]:
    return [i for b in loader for i in b["index"].tolist()]


@pytest.mark.parametrize("rank, world_size, drop_last, batches", [
    (0, 1, False, 7),  # 50 samples: 6 of 8, then 2
    (0, 1, True, 6),
    (1, 3, False, 3),  # 17 samples: 8, 8, 1
    (2, 3, True, 2),  # 16 samples
])
def test_len_is_the_batches_of_this_ranks_pass(feed, image_names, rank, world_size, drop_last,
                                               batches):
    loader = feed.loader(files=image_names[:50], batch_size=8, size=(8, 8), rank=rank,
                         world_size=world_size, drop_last=drop_last)
    assert loader.batch_size == 8
    assert len(loader) == batches
    assert len(list(loader)) == batches
    assert len(loader) == batches  # every pass


def test_a_refused_request_fails_when_the_loader_is_made(feed, image_names):
    with pytest.raises(FeedError) as info:
        feed.loader(files=image_names[:4], batch_size=4)  # images need a size
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "size" in str(info.value)
    with pytest.raises(FeedError) as info:
        feed.loader(files="no-such.flist", batch_size=4, size=8)
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_refusals_name_the_loaders_arguments(feed, image_names):
    """A trainer reads the message against its own call: a missing size says it is
    required, and a missing directory named as files= says files."""
    with pytest.raises(FeedError) as info:
        feed.loader(files=image_names[:4], batch_size=4)
    assert "size is required for images" in str(info.value)
    with pytest.raises(FeedError) as info:
        feed.loader(files="no-such-dir/", batch_size=4, size=8)
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert str(info.value).startswith("NOT_FOUND: files (list_file): 'no-such-dir/'")
    assert "no such list file or directory" in str(info.value)


def test_classes_are_known_before_the_first_batch(feed, data_dir, image_names):
    root = data_dir / "pets"
    for k, name in enumerate(["cat", "dog", "cat"]):
        (root / name).mkdir(parents=True, exist_ok=True)
        shutil.copy(data_dir / image_names[k], root / name / f"{k}.jpg")
    loader = feed.loader(files=["pets/cat/0.jpg", "pets/dog/1.jpg", "pets/cat/2.jpg"],
                         labels="folder", batch_size=3, size=8)
    assert loader.classes == ["cat", "dog"]  # no batch fetched yet
    (batch,) = list(loader)
    assert batch["label"].tolist() == [0, 1, 0]


def test_a_square_size_is_one_int(feed, image_names):
    square = list(feed.loader(files=image_names[:4], batch_size=4, size=24))
    pair = list(feed.loader(files=image_names[:4], batch_size=4, size=(24, 24), copy=True))
    assert square[0]["image"].shape == (4, 3, 24, 24)
    assert torch.equal(square[0]["image"], pair[0]["image"])


def test_paths_work_wherever_strings_do(feed, data_dir, image_names):
    (data_dir / "flat").mkdir(exist_ok=True)
    for name in image_names[:6]:
        shutil.copy(data_dir / name, data_dir / "flat" / name)
    (data_dir / "six.flist").write_text("\n".join(image_names[:6]) + "\n")
    expected = list(range(6))
    assert _indices(feed.loader(files=[Path(n) for n in image_names[:6]], batch_size=4,
                                size=8)) == expected
    assert _indices(feed.loader(files=Path("six.flist"), batch_size=4, size=8)) == expected
    assert _indices(feed.loader(files=Path("six.flist"), prefix=Path("flat"), batch_size=4,
                                size=8)) == expected  # a Path prefix is a directory
    assert _indices(feed.loader(files=image_names[:6], prefix=Path("flat/"), batch_size=4,
                                size=8)) == expected


@pytest.mark.parametrize("transport", ["auto", "inline"])
def test_a_server_that_is_down_fails_at_once_saying_so(image_names, transport):
    """With the default timeouts: the connect timeout (5 s), not the reconnect timeout
    that is meant for a server that has answered before (30 s)."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with FeedClient(address) as feed:
        with pytest.raises(FeedError) as info:
            feed.loader(files=image_names[:4], batch_size=4, size=8, transport=transport)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    message = str(info.value)
    assert f"no gpufeed server answered at {address} within 5 s" in message
    assert "is gpufeed-server running" in message


_OPTIONS = dict(batch_size=16, size=(16, 16), shuffle=True, seed=3, epoch=1)


@pytest.mark.parametrize("change, field", [
    ({"batch_size": 32}, "batch_size"),
    ({"seed": 4}, "seed"),
    ({"shuffle": False}, "shuffle"),
    ({"drop_last": True}, "drop_last"),
    ({"flip": 0.5}, "transforms"),
    ({"size": (16, 24)}, "transforms"),
    ({"files": "other"}, "files"),
    ({"labels": list(range(64))}, "labels"),
])
def test_a_state_from_another_request_is_refused_naming_the_field(feed, image_names, change,
                                                                  field):
    files = image_names[:64]
    saved = feed.loader(files=files, **_OPTIONS)
    for k, _ in enumerate(saved):
        if k == 1:
            break
    state = saved.state_dict()
    other = {"files": files, **_OPTIONS, **change}
    if other["files"] == "other":
        other["files"] = image_names[64:128]
    loader = feed.loader(**other)
    with pytest.raises(ValueError) as info:
        loader.load_state_dict(state)
    assert f"{field} differs" in str(info.value)
    same = feed.loader(files=files, **_OPTIONS, transport="inline", prefetch=1)
    same.load_state_dict(state)  # transport and prefetch do not decide the content
    assert len(_indices(same)) == 64 - 32


def test_a_dropped_loader_ends_the_stream_it_opened_ahead(data_dir, image_names):
    """loader(...) opens a stream on the server; a loader never iterated, then dropped
    (or closed), must not hold it: with --max-streams 1, loaders made one after another
    are all served."""
    from gpufeed.server.process import ServerProcess
    from support import wait_until

    def served(closing: bool) -> bool:
        try:
            loader = feed.loader(files=image_names, batch_size=2, size=8, prefetch=1)
        except FeedError as e:
            assert "--max-streams" in str(e), e  # the previous one may still be closing
            return False
        if closing:
            loader.close()
        return True

    with ServerProcess(["--data-root", str(data_dir), "--max-streams", "1"]) as server, \
            FeedClient(server.address) as feed:
        gc.disable()  # dropping must be enough, without waiting for a collection
        try:
            for closing in (False, True, False, True):
                assert wait_until(lambda closing=closing: served(closing))
        finally:
            gc.enable()
