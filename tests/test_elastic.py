"""An elastic job: an epoch saved at one world size goes on at another.

Every rank of the old job takes as many batches (synchronous data parallelism),
any rank saves ``state_dict()``, and every rank of the new job, at another
world size, loads that same state (torchrun's elastic restarts hand every rank
the same checkpoint). Over a real server, shuffled, with random crops, for
loose files and tar shards: the old ranks' samples and the new ranks' are,
padding aside, every sample once; the new ranks yield as many batches each,
padded only as far as that takes; every sample keeps its epoch's crop; and the
next epoch is what a fresh run at the new world size gives. The server checks
the resumed phases it is sent, naming the field, and a client never takes an
epoch's rest from a server that does not know them.
"""

from __future__ import annotations

import hashlib
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from gpufeed.client import FeedClient, FeedError
from gpufeed.server.config import Limits
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess
from gpufeed.server.serving.errors import InvalidRequest
from gpufeed.server.serving.planning.order import EpochOrder, shard_order, tar_order
from gpufeed.server.serving.planning.plan import plan_stream
from gpufeed.server.storage.roots import Storage
from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from shards import write_shards

FILES = 23  # prime: every world size pads
SHARD_COUNTS = [5, 4, 6, 3, 7, 2]  # 27 samples in 6 shards of unequal sizes
BATCH = 2
TAKEN = 2  # batches each old rank takes before the job stops

_KINDS = {
    "files": dict(files=[f"img/{i:02d}.jpg" for i in range(FILES)]),
    "shards": dict(files=[f"shards/train-{s:04d}.tar" for s in range(len(SHARD_COUNTS))]),
}
_SIZES = {"files": FILES, "shards": sum(SHARD_COUNTS)}
_OPTIONS = dict(batch_size=BATCH, size=8, resize="random_resized_crop", flip=0.5, shuffle=True,
                seed=7, epoch=1, transport="inline")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    rng = np.random.default_rng(3)
    (root / "img").mkdir()
    for i in range(FILES):
        photo = synthetic_photo(rng, int(rng.integers(24, 48)), int(rng.integers(24, 48)))
        (root / "img" / f"{i:02d}.jpg").write_bytes(encode_jpeg(photo))
    write_shards(root / "shards", SHARD_COUNTS)
    return root


@pytest.fixture(scope="module")
def feed(root):
    with ServerProcess(["--data-root", str(root), "--threads", "2"]) as server, \
            FeedClient(server.address) as client:
        yield client


Row = tuple[int, bool, str]  # index, padded, a digest of the sample's pixels (its crop)


def _rows(batch: dict[str, torch.Tensor]) -> list[Row]:
    padded = batch.get("padded", torch.zeros(len(batch["index"]), dtype=torch.bool))
    return [(int(i), bool(p), hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest())
            for i, p, image in zip(batch["index"], padded, batch["image"])]


def _pass(loader) -> list[list[Row]]:
    return [_rows(batch) for batch in loader]


def _take(loader, batches: int) -> list[list[Row]]:
    taken = []
    for batch in loader:
        taken.append(_rows(batch))
        if len(taken) == batches:
            break
    return taken


def _stopped_job(feed, kind: str, world_size: int) -> tuple[list[Row], dict]:
    """Every rank takes TAKEN batches; the rows they took, and the state any rank saves."""
    rows, states = [], []
    for rank in range(world_size):
        loader = feed.loader(**_KINDS[kind], **_OPTIONS, rank=rank, world_size=world_size)
        rows += [row for batch in _take(loader, TAKEN) for row in batch]
        states.append(loader.state_dict())
    assert all(state == states[0] for state in states)  # any rank's state is every rank's
    assert states[0]["world_size"] == world_size and states[0]["resumed_from"] == []
    return rows, states[-1]


def _check_once(kind: str, old: list[Row], new_ranks: list[list[list[Row]]], new_size: int):
    """Old and new rows: every sample once, padding aside; as many batches per new rank;
    padding only to even the new ranks out; each sample's crop the epoch's own."""
    total = _SIZES[kind]
    assert len({len(batches) for batches in new_ranks}) == 1  # as many batches each
    new = [row for batches in new_ranks for batch in batches for row in batch]
    real = [index for index, padded, _ in old + new if not padded]
    assert sorted(real) == list(range(total))
    left = total - sum(1 for _, padded, _ in old if not padded)
    assert sum(padded for _, padded, _ in new) == -left % new_size
    crops: dict[int, set[str]] = {}
    for index, _, digest in old + new:
        crops.setdefault(index, set()).add(digest)
    assert all(len(digests) == 1 for digests in crops.values())  # repeats included


@pytest.mark.parametrize("kind", list(_KINDS))
@pytest.mark.parametrize("old_size, new_size", [(4, 2), (2, 3), (3, 1)])
def test_an_epoch_saved_at_one_world_size_goes_on_at_another(feed, kind, old_size, new_size):
    old, state = _stopped_job(feed, kind, old_size)
    loaders = [feed.loader(**_KINDS[kind], **{**_OPTIONS, "epoch": 0}, rank=rank,
                           world_size=new_size) for rank in range(new_size)]
    for loader in loaders:
        loader.load_state_dict(state)
        assert loader.epoch == 1
        assert loader.state_dict()["resumed_from"] == [[old_size, TAKEN]]
    resumed = [_pass(loader) for loader in loaders]
    _check_once(kind, old, resumed, new_size)

    for rank, loader in enumerate(loaders):  # the next epoch: the new world size's own
        assert loader.state_dict()["resumed_from"] == [] and loader.epoch == 2
        fresh = feed.loader(**_KINDS[kind], **{**_OPTIONS, "epoch": 2}, rank=rank,
                            world_size=new_size)
        assert _pass(loader) == _pass(fresh)


def test_a_resumed_epoch_saved_again_goes_on_at_a_third_world_size(feed):
    """4 ranks, then 2 (stopped again after a batch each), then 3: the state carries
    the epoch's phases, and the three together deliver every sample once."""
    old, state = _stopped_job(feed, "files", 4)
    middle, states = [], []
    for rank in range(2):
        loader = feed.loader(**_KINDS["files"], **_OPTIONS, rank=rank, world_size=2)
        loader.load_state_dict(state)
        middle += [row for batch in _take(loader, 1) for row in batch]
        states.append(loader.state_dict())
    assert states[0] == states[1]
    assert (states[0]["world_size"], states[0]["resumed_from"]) == (2, [[4, TAKEN]])
    assert states[0]["samples_consumed"] == BATCH
    last = []
    for rank in range(3):
        loader = feed.loader(**_KINDS["files"], **_OPTIONS, rank=rank, world_size=3)
        loader.load_state_dict(states[1])
        assert loader.state_dict()["resumed_from"] == [[4, TAKEN], [2, 1]]
        last.append(_pass(loader))
    _check_once("files", old + middle, last, 3)


def test_the_same_world_size_continues_the_phase_it_was_saved_in(feed):
    """2 -> 3, stopped again at 3, resumed at 3: the third rank count goes on where it
    stopped, as any resume at the saved world size does."""
    _, state = _stopped_job(feed, "shards", 2)
    whole, saved = [], []
    for rank in range(3):
        loader = feed.loader(**_KINDS["shards"], **_OPTIONS, rank=rank, world_size=3)
        loader.load_state_dict(state)
        whole.append(_pass(loader))
        partway = feed.loader(**_KINDS["shards"], **_OPTIONS, rank=rank, world_size=3)
        partway.load_state_dict(state)
        taken = _take(partway, 1)
        again = feed.loader(**_KINDS["shards"], **_OPTIONS, rank=rank, world_size=3)
        again.load_state_dict(partway.state_dict())
        saved.append(taken + _pass(again))
    assert saved == whole


def test_every_rank_at_once_is_each_rank_alone():
    """A resumed epoch's first phase is built for every old rank at once; each row must be
    that rank's own order, and a rank's order of loose files numpy's permutation of its
    positions, as it always was (a changed order would change every saved run's)."""
    first = np.cumsum([0, *SHARD_COUNTS])
    for shuffle in (False, True):
        for size in (1, 2, 4, 6):
            loose = EpochOrder(FILES, None, shuffle, 7, 1)
            tar = EpochOrder(int(first[-1]), first, shuffle, 7, 1)
            for rank, (loose_row, tar_row) in enumerate(zip(loose.every_rank(size),
                                                              tar.every_rank(size))):
                alone = np.arange(rank, -(-FILES // size) * size, size, dtype=np.int64)
                if shuffle:
                    alone = np.random.default_rng([7, 1]).permutation(alone)
                assert loose_row.tolist() == alone.tolist() == \
                    shard_order(FILES, rank=rank, world_size=size, shuffle=shuffle, seed=7,
                                epoch=1).tolist()
                assert tar_row.tolist() == tar_order(first, rank=rank, world_size=size,
                                                     shuffle=shuffle, seed=7, epoch=1).tolist()


# The server's checks of the phases it is sent.

def _request(root_kind: str, **fields) -> feed_pb2.StreamRequest:
    request = feed_pb2.StreamRequest(
        files=feed_pb2.FileList(paths=_KINDS[root_kind]["files"]), batch_size=BATCH,
        output=feed_pb2.OutputSpec(height=8, width=8), shuffle=True, world_size=2,
        transport=feed_pb2.TRANSPORT_INLINE)
    for name, value in fields.items():
        if name == "phases":
            for size, batches in value:
                request.resumed_from.add(world_size=size, batches=batches)
        else:
            setattr(request, name, value)
    return request


@pytest.mark.parametrize("kind, fields, words", [
    ("files", dict(phases=[(4, -1)]), "resumed_from[0].batches must be >= 0, got -1"),
    ("files", dict(phases=[(4, 1), (3, 9)]),  # 23 samples: 15 or 16 left, 3 batches a rank
     "resumed_from[1].batches: 9 batches, but each rank of that phase had 3"),
    ("files", dict(phases=[(4, 4)]), "resumed_from[0].batches: 4 batches, but each rank of "
                                     "that phase had 3"),
    ("files", dict(phases=[(0, 1)]), "resumed_from[0].world_size must be in 1..1048576, got 0"),
    ("files", dict(phases=[(3, 1), (1 << 21, 0)]), "resumed_from[1].world_size must be in"),
    ("files", dict(phases=[(2, 0)] * 65), "resumed_from: 65 phases, over the bound of 64"),
    ("files", dict(phases=[(2, 1)], world_size=1 << 21, rank=0), "world_size must be at most"),
    ("files", dict(phases=[(2, 1)], job="shared"), "resumed_from: a shared job"),
    ("shards", dict(phases=[(7, 1)]), "resumed_from[0].world_size: 7 ranks but 6 tar shards"),
])
def test_nonsense_phases_are_refused_naming_the_field(root, kind, fields, words):
    with pytest.raises(InvalidRequest) as info:
        plan_stream(_request(kind, **fields), Storage([str(root)]), Limits(),
                    (feed_pb2.TRANSPORT_INLINE,))
    assert words in str(info.value)


def test_a_refusal_reaches_the_trainer_as_invalid_argument(feed, root):
    request = _request("files", phases=[(4, 9)])
    with grpc.insecure_channel(feed.servers[0].address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            next(feed_pb2_grpc.FeedStub(channel).Stream(
                iter([feed_pb2.ClientMessage(open=request)]), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("resumed_from[0].batches")


class _OlderServer(feed_pb2_grpc.FeedServicer):
    """A server from before resumed_from, played by forwarding to a real one: the field
    is unknown to it (dropped), and its header never counts resumed phases."""

    def __init__(self, address: str):
        self._channel = grpc.insecure_channel(address)
        self._stub = feed_pb2_grpc.FeedStub(self._channel)

    def Info(self, request, context):  # noqa: N802 (the service's name)
        return self._stub.Info(request)

    def Stream(self, request_iterator, context):  # noqa: N802 (the service's name)
        def forwarded():
            try:
                for message in request_iterator:
                    if message.WhichOneof("kind") == "open":
                        message.open.ClearField("resumed_from")
                    yield message
            except grpc.RpcError:  # the trainer left: so does the forwarded call
                return
        call = self._stub.Stream(forwarded())
        context.add_callback(call.cancel)
        for message in call:
            if message.WhichOneof("kind") == "header":
                message.header.ClearField("resumed_phases")
            yield message


def test_a_server_that_ignores_the_phases_is_refused_not_believed(feed):
    _, state = _stopped_job(feed, "files", 4)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    older = _OlderServer(feed.servers[0].address)
    feed_pb2_grpc.add_FeedServicer_to_server(older, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with FeedClient(f"127.0.0.1:{port}") as client:
            loader = client.loader(**_KINDS["files"], **_OPTIONS, rank=0, world_size=2)
            loader.load_state_dict(state)
            with pytest.raises(FeedError) as info:
                next(iter(loader))
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "applied 0 of the 1 earlier phases" in str(info.value)
            same = client.loader(**_KINDS["files"], **_OPTIONS, rank=0, world_size=4)
            same.load_state_dict(state)  # at the saved world size nothing new is needed
            assert len(_pass(same)) == len(same) - TAKEN
    finally:
        server.stop(None)
        older._channel.close()
