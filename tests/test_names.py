"""Each sample's name in its batch (``loader(names=True)``, ``gpufeed.client.names``).

What a trainer relies on: a name per row, aligned with ``index`` and ``label``
whatever the pass does (a directory listed, tar shards, a shuffle, a resume,
padding over ranks, failed samples closed up), on every transport; a file's
path relative to the data root, ``shard/key`` for a tar sample; and nothing
sent when names are not asked for.
"""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

from gpufeed.client import FeedClient, names
from gpufeed.server.config import Limits
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.memory.cuda_ipc import _host_written_spans
from gpufeed.server.process import ServerProcess
from gpufeed.server.serving.planning.batchnames import MAX_NAME_BYTES
from gpufeed.server.serving.planning.plan import plan_stream
from gpufeed.server.serving.running.sources import JobRegistry
from gpufeed.server.storage.roots import Storage
from gpufeed.v1 import feed_pb2
from shards import label_of, write_shards

TRANSPORTS = ["inline", "shm"]
SIZE = (16, 16)
# ImageFolder's order of train/: the class folders sorted, each one's files sorted.
TRAIN = [f"train/cat/{i}.jpg" for i in range(5)] + [f"train/dog/{i}.jpg" for i in range(4)]
MIXED = [f"mixed/a/{i}.jpg" for i in range(6)]  # mixed/a/2.jpg is not an image
COUNTS = [5, 7, 4]
SHARDS = "shards/train-{0000..0002}.tar"
LONG_KEY = "k" * (MAX_NAME_BYTES + 10)


def _jpeg(rng) -> bytes:
    return encode_jpeg(synthetic_photo(rng, int(rng.integers(30, 60)), int(rng.integers(30, 60))))


def _long_key_shard(rng) -> bytes:
    """Three samples, the middle one's key longer than a name may be (a pax path)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for key in ("first", LONG_KEY, "last"):
            data = _jpeg(rng)
            info = tarfile.TarInfo(f"{key}.jpg")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("named")
    rng = np.random.default_rng(3)
    for name in TRAIN + MIXED:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(_jpeg(rng))
    (root / MIXED[2]).write_bytes(b"not a jpeg at all" * 10)
    write_shards(root / "shards", COUNTS)
    (root / "shards" / "long.tar").write_bytes(_long_key_shard(rng))
    return root


@pytest.fixture(scope="module")
def feed(root):
    with ServerProcess(["--data-root", str(root), "--threads", "1"]) as server, \
            FeedClient(server.address) as client:
        yield client


def _shard_name(index: int) -> str:
    """Sample ``index``'s name among SHARDS: its shard, then its key (its member's stem)."""
    shard = int(np.searchsorted(np.cumsum(COUNTS), index, side="right"))
    return f"shards/train-{shard:04d}.tar/{index:06d}"


def _rows(loader) -> list[tuple[int, str, bool]]:
    """(index, name, padded) of every row of a pass, each batch's names checked to be
    one per row."""
    rows = []
    for batch in loader:
        named = names(batch)
        index = batch["index"].tolist()
        assert len(named) == len(index)
        padded = batch["padded"].tolist() if "padded" in batch else [False] * len(index)
        rows += zip(index, named, padded)
    return rows


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_loose_files_are_named_by_their_path_under_the_data_root(feed, root, transport):
    """Whatever the request's spelling (a prefix, an absolute path, ``..``), a name is
    the file's path relative to the data root."""
    files = ["train/cat/0.jpg", str(root / "train/dog/1.jpg"), "train/./cat/../dog/2.jpg"]
    loader = feed.loader(files, batch_size=2, size=SIZE, names=True, transport=transport)
    assert _rows(loader) == [(0, "train/cat/0.jpg", False), (1, "train/dog/1.jpg", False),
                             (2, "train/dog/2.jpg", False)]
    prefixed = feed.loader(["cat/3.jpg", "dog/3.jpg"], prefix="train/", batch_size=4,
                           size=SIZE, names=True, transport=transport)
    assert _rows(prefixed) == [(0, "train/cat/3.jpg", False), (1, "train/dog/3.jpg", False)]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_listed_directory_names_each_file_it_stands_for(feed, transport):
    """``files="train/"`` (ImageFolder): each row's name is its listed file, in the
    listing's order, agreeing with its folder label."""
    loader = feed.loader("train/", labels="folder", batch_size=4, size=SIZE, names=True,
                         transport=transport)
    rows, labels = [], []
    for batch in loader:
        rows += zip(batch["index"].tolist(), names(batch))
        labels += batch["label"].tolist()
    assert rows == list(enumerate(TRAIN))
    assert [name.split("/")[1] for _, name in rows] == [loader.classes[c] for c in labels]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tar_samples_are_named_shard_then_key(feed, transport):
    loader = feed.loader([SHARDS], batch_size=5, size=SIZE, names=True, transport=transport)
    rows, labels = [], []
    for batch in loader:
        rows += zip(batch["index"].tolist(), names(batch))
        labels += batch["label"].tolist()
    assert rows[:6] == [(i, f"shards/train-0000.tar/{i:06d}") for i in range(5)] + [
        (5, "shards/train-0001.tar/000005")]
    assert rows == [(i, _shard_name(i)) for i in range(sum(COUNTS))]
    assert labels == [label_of(i) for i in range(sum(COUNTS))]


def test_names_follow_a_shuffled_pass_and_its_resume(feed):
    options = dict(batch_size=3, size=SIZE, names=True, shuffle=True, seed=9)
    loader = feed.loader("train/", **options)
    full = _rows(loader)
    assert [index for index, _, _ in full] != list(range(len(TRAIN)))  # shuffled
    assert sorted(full) == [(i, name, False) for i, name in enumerate(TRAIN)]
    partway = feed.loader("train/", **options)
    taken = iter(partway)
    first = _rows([next(taken)])
    resumed = feed.loader("train/", **options)
    resumed.load_state_dict(partway.state_dict())
    assert first + _rows(resumed) == full

    shards = dict(options, batch_size=4)
    pass_ = _rows(feed.loader([SHARDS], **shards))
    partway = feed.loader([SHARDS], **shards)
    taken = iter(partway)
    first = _rows([next(taken), next(taken)])  # mid-shard, whichever shard comes first
    resumed = feed.loader([SHARDS], **shards)
    resumed.load_state_dict(partway.state_dict())
    assert first + _rows(resumed) == pass_
    assert sorted(pass_) == [(i, _shard_name(i), False) for i in range(sum(COUNTS))]


def test_a_state_saved_without_names_resumes_a_loader_that_asks_for_them(feed):
    """Names change neither order nor content: a position saved by a training loader
    resumes an identical loader that also asks for names, and the other way round."""
    options = dict(batch_size=3, size=SIZE, shuffle=True, seed=4)
    full = [i for b in feed.loader("train/", **options) for i in b["index"].tolist()]
    partway = feed.loader("train/", **options)
    next(iter(partway))
    resumed = feed.loader("train/", names=True, **options)
    resumed.load_state_dict(partway.state_dict())
    assert [index for index, _, _ in _rows(resumed)] == full[3:]
    back = feed.loader("train/", **options)
    back.load_state_dict(resumed.state_dict())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_padding_row_carries_its_samples_name(feed, transport):
    """9 files over 2 ranks: rank 1 repeats a sample to keep the ranks even; the repeat
    is named as the sample it repeats."""
    for rank in (0, 1):
        rows = _rows(feed.loader("train/", batch_size=2, size=SIZE, names=True, rank=rank,
                                 world_size=2, transport=transport))
        assert all(name == TRAIN[index] for index, name, _ in rows)
        assert len(rows) == 5
        assert [padded for _, _, padded in rows].count(True) == rank


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_failed_sample_leaves_the_names_aligned_with_index(feed, transport):
    """mixed/a/2.jpg fails: its row is closed up with every other array, the names too."""
    loader = feed.loader("mixed/", batch_size=4, size=SIZE, names=True, transport=transport)
    rows = _rows(loader)
    assert rows == [(i, MIXED[i], False) for i in range(len(MIXED)) if i != 2]
    (failure,) = loader.failures
    assert failure.index == 2 and failure.reason.startswith("mixed/a/2.jpg: ")


def test_a_row_refilled_for_an_all_failed_batch_is_named_as_its_sample(feed):
    """With world_size 2 a batch whose every sample failed goes out with a padding row, the
    first sample after it that decodes: its name is that sample's."""
    files = ["mixed/a/2.jpg", "mixed/a/2.jpg", "mixed/a/4.jpg", "mixed/a/5.jpg"]
    loader = feed.loader(files, batch_size=1, size=SIZE, names=True, rank=0, world_size=2)
    assert _rows(loader) == [(2, "mixed/a/4.jpg", True), (2, "mixed/a/4.jpg", False)]


def test_an_evaluation_reports_every_file_once_by_name(feed):
    """An eval loop over a directory on 2 ranks keeps (name, prediction) pairs, drops the
    padding, and has each file's prediction exactly once."""
    predictions: list[tuple[str, float]] = []
    for rank in (0, 1):
        loader = feed.loader("train/", batch_size=4, size=SIZE, names=True, rank=rank,
                             world_size=2)
        for batch in loader:
            scores = batch["image"].float().mean(dim=(1, 2, 3)).tolist()
            keep = (~batch["padded"]).tolist()
            predictions += [(name, score) for name, score, kept
                            in zip(names(batch), scores, keep) if kept]
    assert sorted(name for name, _ in predictions) == sorted(TRAIN)
    alone = dict(zip(TRAIN, (s for b in feed.loader(TRAIN, batch_size=9, size=SIZE)
                             for s in b["image"].float().mean(dim=(1, 2, 3)).tolist())))
    assert dict(predictions) == pytest.approx(alone)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_without_names_no_names_are_sent(feed, transport):
    batch = next(iter(feed.loader("train/", batch_size=4, size=SIZE, transport=transport)))
    assert "names" not in batch and "names_offsets" not in batch
    with pytest.raises(KeyError, match=r"names=True"):
        names(batch)


def test_a_name_over_its_bound_fails_its_sample_alone(feed):
    """A tar key longer than a name may be fails its sample as too_large (a cut name
    could name another sample); the samples around it are named."""
    loader = feed.loader(["shards/long.tar"], batch_size=3, size=SIZE, names=True)
    assert _rows(loader) == [(0, "shards/long.tar/first", False),
                             (2, "shards/long.tar/last", False)]
    (failure,) = loader.failures
    assert failure.index == 1 and failure.category == "too_large", failure
    assert f"over the {MAX_NAME_BYTES} bytes" in failure.reason
    # Without names the same sample is served: the bound is the names' alone.
    plain = feed.loader(["shards/long.tar"], batch_size=3, size=SIZE)
    assert [i for b in plain for i in b["index"].tolist()] == [0, 1, 2]


def _plan(root, paths: list[str], names: bool = True, **output) -> object:
    request = feed_pb2.StreamRequest(
        files=feed_pb2.FileList(paths=paths), batch_size=4, names=names,
        output=feed_pb2.OutputSpec(height=8, width=8, **output))
    return plan_stream(request, Storage([str(root)]), Limits(), (feed_pb2.TRANSPORT_INLINE,))


def test_a_rows_room_for_its_name_is_the_longest_name_of_the_plan(root):
    """A slot is a fixed layout: each row has room for the plan's longest name, worked out
    from the plan (not a fixed PATH_MAX per row), and none without names."""
    plan = _plan(root, ["train/cat/0.jpg", "train/./cat/../dog/2.jpg"])
    assert plan.names.room == len("train/./cat/../dog/2.jpg")  # the request's longest
    shards = _plan(root, [SHARDS])
    assert shards.names.room == len("shards/train-0000.tar/000000")
    listed = _plan(root, ["train/"])
    assert len("train/cat/0.jpg") <= listed.names.room <= len(str(root / "train/cat/0.jpg"))
    plain = _plan(root, ["train/cat/0.jpg"], names=False)
    assert plain.names is None
    assert not {p.name for p in plain.layout.places} & {"names", "names_offsets"}
    assert plan.layout.slot_bytes > plain.layout.slot_bytes


def test_the_device_copy_carries_the_names(root):
    """cuda_ipc copies only the spans the host writes: the names and their offsets are
    among them (a float batch's image region, made on the GPU, is not)."""
    plan = _plan(root, [SHARDS], dtype="float32")
    copied = np.zeros(plan.layout.slot_bytes, bool)
    for begin, end in _host_written_spans(plan.layout):
        copied[begin:end] = True
    places = {p.name: p for p in plan.layout.places}
    for name, rows in (("names", 4), ("names_offsets", 5), ("names_count", 4)):
        place = places[name]
        size = rows * place.dtype.itemsize * int(np.prod(place.sample_shape))
        assert copied[place.offset:place.offset + size].all(), name
    assert not copied[places["image"].offset]


def test_consumers_of_a_shared_job_may_differ_in_names():
    """Names are each consumer's own delivery, as its transport is: they join one job."""
    def request(names: bool) -> feed_pb2.StreamRequest:
        return feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=["a.jpg"]), batch_size=1,
                                      output=feed_pb2.OutputSpec(height=8, width=8),
                                      job="eval", names=names)

    class _Plan:
        batches = range(1)

    jobs = JobRegistry()
    assert jobs.join(request(True), _Plan()) is jobs.join(request(False), _Plan())
