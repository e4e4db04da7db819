"""A pass over several servers, dealt by pace: each server is handed the pass's next
batch when one it made has arrived, and the trainer still gets the pass's order.

The loader-level tests of several servers (an epoch spread over two, a server
killed mid-epoch, a position resumed on another number of servers) are in
test_scale.py and test_failover.py; here: the pace, and the protocol a dealt
stream keeps with a client that does not."""

from __future__ import annotations

import logging
import queue
import re
from concurrent import futures

import grpc
import numpy as np
import pytest

from gpufeed.client import FeedClient, FeedError
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from support import wait_until

# A plugin transform that only takes time: PACE_SECONDS per sample (the server's environment).
_PACE = '''
import os
import time

from gpufeed.server import transforms


@transforms.register("pace")
def pace():
    seconds = float(os.environ.get("PACE_SECONDS", "0"))

    def apply(sample, rng):
        time.sleep(seconds)
        return sample

    return apply
'''
_LEASE = 3  # the fast server's --lease-timeout, for the client that hands nothing


@pytest.fixture(scope="module")
def paced(data_dir, tmp_path_factory):
    """Two servers of data_dir with the 'pace' transform: the first sleeps 40 ms a
    sample (about 0.3 s a batch of 8), the second does not."""
    plugins = tmp_path_factory.mktemp("pace")
    (plugins / "pace_plugin.py").write_text(_PACE)
    servers = []
    for seconds, extra in (("0.04", []), ("0", ["--lease-timeout", str(_LEASE)])):
        servers.append(ServerProcess(
            ["--data-root", str(data_dir), "--threads", "1", "--plugins", "pace_plugin", *extra],
            env={"PYTHONPATH": str(plugins), "PACE_SECONDS": seconds}).start())
    yield servers
    for server in servers:
        server.stop()


def _indices(loader) -> list[int]:
    return [i for batch in loader for i in batch["index"].tolist()]


def _stream_ends(server: ServerProcess) -> list[int]:
    """The batch count of each stream the server has logged the end of."""
    return [int(m.group(1)) for line in list(server.log)
            if (m := re.search(r"stream end: .* batches=(\d+)", line))]


def _alone(server: ServerProcess, files: list[str], **options) -> list[int]:
    """The pass's sample order as ``server`` alone makes it, once the server has logged
    that stream's end: the line comes a moment after the last batch, and a test that
    then counts a later pass's streams must not take this one for it."""
    ended = len(_stream_ends(server))
    with FeedClient(server.address) as feed:
        indices = _indices(feed.loader(files, **options))
    assert wait_until(lambda: len(_stream_ends(server)) > ended)
    return indices


def test_the_faster_server_is_handed_more_of_the_pass(paced, image_names):
    """Dealt in turn, each server would make 10 of the 20 batches, and the pass would
    go at twice the slow one's pace; dealt by pace, the fast one makes most."""
    options = dict(batch_size=8, size=(16, 16), transforms=["pace"], prefetch=1, shuffle=True,
                   seed=3)
    files = image_names[:160]
    alone = _alone(paced[1], files, **options)
    before = [len(_stream_ends(server)) for server in paced]
    with FeedClient([server.address for server in paced]) as feed:
        dealt = _indices(feed.loader(files, **options))
    assert sorted(dealt) == list(range(160))  # every sample once
    assert dealt == alone  # in the pass's order, whichever server made each batch
    assert wait_until(lambda: all(len(_stream_ends(s)) > n for s, n in zip(paced, before)))
    slow, fast = (_stream_ends(server)[n] for server, n in zip(paced, before))
    assert slow + fast == 20
    assert fast > 10, (slow, fast)


def _open_dealt(address: str, files: list[str], **fields):
    """A raw dealt stream: (header, call, outbox); put ClientMessages on the outbox."""
    request = feed_pb2.StreamRequest(
        files=feed_pb2.FileList(paths=files), batch_size=4, prefetch=1,
        output=feed_pb2.OutputSpec(height=8, width=8), transport=feed_pb2.TRANSPORT_INLINE,
        dealt=True, **fields)
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox.put(feed_pb2.ClientMessage(open=request))
    channel = grpc.insecure_channel(address)
    call = feed_pb2_grpc.FeedStub(channel).Stream(iter(outbox.get, None), timeout=60)
    return next(call).header, call, outbox


def _deal(outbox, *batches: int, last: bool = False) -> None:
    outbox.put(feed_pb2.ClientMessage(deal=feed_pb2.Deal(batches=batches, last=last)))


def _rows(batch: feed_pb2.Batch) -> list[int]:
    (index,) = [t for t in batch.tensors if t.name == "index"]
    return np.frombuffer(batch.data, np.int64, count=index.shape[0], offset=index.offset).tolist()


def test_a_dealt_stream_makes_the_batches_it_is_handed_in_that_order(paced, image_names):
    header, call, outbox = _open_dealt(paced[1].address, image_names[:40])
    assert header.num_batches == 10 and header.start_batch == 0  # the whole pass's
    _deal(outbox, 7, 2)
    first, second = next(call).batch, next(call).batch
    outbox.put(feed_pb2.ClientMessage(release=feed_pb2.Release(seqs=[0, 1])))  # slots back
    _deal(outbox, 9, last=True)
    third = next(call).batch
    assert [b.seq for b in (first, second, third)] == [0, 1, 2]  # the stream's own count
    assert [_rows(b) for b in (first, second, third)] == [
        [28, 29, 30, 31], [8, 9, 10, 11], [36, 37, 38, 39]]  # the pass's batches 7, 2, 9
    assert next(call, None) is None  # `last`, and every batch handed sent: the stream ends
    assert call.code() == grpc.StatusCode.OK
    outbox.put(None)


@pytest.mark.parametrize("deals, words", [
    ([([10], False)], "deal.batches: 10 is not a batch of the pass (0..9)"),
    ([([-1], False)], "deal.batches: -1 is not a batch"),
    ([([0, 1, 2], False)], "over the stream's 2 slots"),
    # Batches 0 and 1 fill both slots, unreleased, so 2 waits and the stream cannot end
    # before it reads the Deal that follows `last`.
    ([([0, 1], False), ([2], True), ([3], False)], "a Deal came after one that said `last`"),
])
def test_a_deal_the_stream_cannot_take_is_invalid_argument_naming_it(paced, image_names, deals,
                                                                    words):
    _, call, outbox = _open_dealt(paced[1].address, image_names[:40])
    for batches, last in deals:
        _deal(outbox, *batches, last=last)
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    outbox.put(None)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()


@pytest.mark.parametrize("field, value", [
    ("start_batch", 2), ("job", "j")])
def test_fields_a_dealt_stream_has_no_use_for_are_refused_naming_them(paced, image_names,
                                                                     field, value):
    with pytest.raises(grpc.RpcError) as info:
        _open_dealt(paced[1].address, image_names[:40], **{field: value})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}: a dealt stream")


def test_a_deal_to_a_stream_that_is_not_dealt_is_invalid_argument(paced, image_names):
    request = feed_pb2.StreamRequest(
        files=feed_pb2.FileList(paths=image_names[:40]), batch_size=4, prefetch=1,
        output=feed_pb2.OutputSpec(height=8, width=8), transport=feed_pb2.TRANSPORT_INLINE)
    messages = [feed_pb2.ClientMessage(open=request),
                feed_pb2.ClientMessage(deal=feed_pb2.Deal(batches=[0]))]
    with grpc.insecure_channel(paced[1].address) as channel:
        call = feed_pb2_grpc.FeedStub(channel).Stream(iter(messages), timeout=60)
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "deal: this stream was not opened with `dealt`" in info.value.details()


def test_a_dealt_stream_never_handed_a_batch_ends_at_the_lease_timeout(paced, image_names):
    """Free slots and nothing handed: the server waits on its client, as long as the
    lease lets it, and then says so."""
    _, call, outbox = _open_dealt(paced[1].address, image_names[:40])
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    outbox.put(None)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"the client handed no batch for {_LEASE} s" in info.value.details()


class _OlderServer(feed_pb2_grpc.FeedServicer):
    """A server from before dealing: it answers a dealt request as any other, with a
    header that does not say `dealt`, and would then send its pass from batch 0."""

    def Info(self, request, context):  # noqa: N802 (the service's name)
        return feed_pb2.InfoResponse(version="older", transports=[feed_pb2.TRANSPORT_INLINE])

    def Stream(self, requests, context):  # noqa: N802
        next(requests)
        yield feed_pb2.ServerMessage(header=feed_pb2.StreamHeader(
            transport=feed_pb2.TRANSPORT_INLINE, num_slots=2, slot_bytes=192, num_batches=10))


def test_a_server_that_does_not_know_dealing_is_refused_not_believed(paced, image_names):
    older = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    feed_pb2_grpc.add_FeedServicer_to_server(_OlderServer(), older)
    port = older.add_insecure_port("127.0.0.1:0")
    older.start()
    try:
        with FeedClient([paced[1].address, f"127.0.0.1:{port}"]) as feed:
            with pytest.raises(FeedError) as info:
                feed.loader(image_names[:40], batch_size=4, size=(8, 8), transport="inline")
    finally:
        older.stop(None)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "does not know `dealt`" in str(info.value)


def test_a_local_server_over_shm_and_a_remote_one_inline_share_one_pass(paced, data_dir,
                                                                        image_names):
    """The trainer's local server first (it shares /dev/shm: shm), and one that does not
    share it (a /dev/shm of its own, as on another host: inline). Each stream uses its
    own transport, both make batches, and the pass is the one server's order."""
    private_shm = ["unshare", "--mount", "sh", "-c",
                   'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]
    remote = ServerProcess(["--data-root", str(data_dir), "--threads", "1"], prefix=private_shm)
    try:
        remote.start()
    except RuntimeError as e:
        if "mount" in str(e) or "unshare" in str(e):
            pytest.skip(f"cannot give a server a /dev/shm of its own here: {e}")
        raise
    options = dict(batch_size=8, size=(16, 16), shuffle=True, seed=5)
    files = image_names[:160]
    try:
        alone = _alone(paced[1], files, **options)
        servers = [paced[1], remote]
        before = [len(_stream_ends(server)) for server in servers]
        with FeedClient([server.address for server in servers]) as feed:
            both = _indices(feed.loader(files, **options))
        assert both == alone and sorted(both) == list(range(160))
        assert wait_until(lambda: all(len(_stream_ends(s)) > n for s, n in zip(servers, before)))
        made = [_stream_ends(server)[n] for server, n in zip(servers, before)]
        assert sum(made) == 20 and min(made) > 0, made  # both made batches of the pass
        ends = [[line for line in list(server.log) if "stream end" in line][n]
                for server, n in zip(servers, before)]
        assert "transport=shm" in ends[0] and "transport=inline" in ends[1], ends
    finally:
        remote.stop()


def test_a_dealt_loader_left_unread_past_the_lease_timeout_is_quiet_and_whole(
        paced, image_names, caplog):
    """An evaluation loader made before training opens a dealt stream on each server at
    once, and is handed nothing until the trainer gets to it. The fast server ends its
    stream at its lease timeout: routine, so the loader opens it again, without a warning,
    and the pass is whole and in order."""
    files = image_names[:80]
    with FeedClient(paced[1].address) as feed:
        alone = _indices(feed.loader(files, batch_size=8, size=(16, 16)))
    unhanded = f"the client handed no batch for {_LEASE} s"
    before = sum(unhanded in line for line in list(paced[1].log))
    with FeedClient([server.address for server in paced]) as feed:
        idle = feed.loader(files, batch_size=8, size=(16, 16))
        # Its own stream's end (the loader alone's may be logged after its pass too).
        assert wait_until(lambda: sum(unhanded in line for line in list(paced[1].log)) > before,
                          3 * _LEASE + 30)
        with caplog.at_level("INFO", logger="gpufeed"):
            got = _indices(idle)
    assert got == alone
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("opening another" in r.getMessage() for r in caplog.records)


def test_cuda_ipc_asked_of_several_servers_is_refused_naming_it(paced, image_names):
    with FeedClient([server.address for server in paced]) as feed:
        with pytest.raises(FeedError) as info:
            feed.loader(image_names[:16], batch_size=8, size=(16, 16), transport="cuda_ipc")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "cuda_ipc serves a loader of one server" in str(info.value)
