"""The lane: a shared-memory stream's batches and releases over a Unix socket beside its call.

A loader on the server's host reads shm batches on the lane (the server's log
says so) and leaves nothing in /dev/shm; a client that says it reads the call
gets every batch there; a batch whose message is too large for the lane comes
on the call, whole. A client that lies about the lane (says it connected and
did not, sends the wrong token, sends something other than a Release there)
ends its own stream with INVALID_ARGUMENT naming what it got wrong, and the
server serves the next trainer. Lies from the server's side: test_hostile_server.py.
"""

from __future__ import annotations

import os
import queue
import socket
import stat

import grpc
import pytest

from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from gpufeed.v1.vocabulary import SHM_DIR
from support import shm_prefix, stream_segments, wait_until


class _RawStream:
    """A shm Stream call driven by hand: open, the header, then what the test sends."""

    def __init__(self, address: str, names: list[str]):
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.send(open=feed_pb2.StreamRequest(
            files=feed_pb2.FileList(paths=names), batch_size=4,
            output=feed_pb2.OutputSpec(height=16, width=16), transport=feed_pb2.TRANSPORT_SHM))
        self._channel = grpc.insecure_channel(address)
        self.call = feed_pb2_grpc.FeedStub(self._channel).Stream(iter(self._outbox.get, None),
                                                                  timeout=60)
        self.header = next(self.call).header

    def send(self, **kind) -> None:
        self._outbox.put(feed_pb2.ClientMessage(**kind))

    def connect_lane(self) -> socket.socket:
        lane = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        lane.connect(os.path.join(SHM_DIR, self.header.lane_name))
        return lane

    def close(self) -> None:
        self._outbox.put(None)
        self._channel.close()


def _stream_ends(server, since: int) -> list[str]:
    return [line for line in server.log[since:] if "stream end:" in line]


def _serves(feed, names: list[str]) -> list[int]:
    loader = feed.loader(names, batch_size=4, size=(16, 16), transport="shm")
    return [i for batch in loader for i in batch["index"].tolist()]


def test_a_loader_reads_shm_batches_on_the_lane_and_leaves_nothing_behind(server, feed,
                                                                         image_names):
    since = len(server.log)
    assert _serves(feed, image_names[:10]) == list(range(10))
    assert wait_until(lambda: _stream_ends(server, since))
    (ended,) = _stream_ends(server, since)
    assert "transport=shm lane=yes samples=10 batches=3" in ended and "status=OK" in ended
    assert not stream_segments(shm_prefix(server.address))  # the lane's name went too


def test_a_client_that_reads_the_call_gets_every_batch_there(server, image_names):
    since = len(server.log)
    stream = _RawStream(server.address, image_names[:10])
    try:
        lane = os.stat(os.path.join(SHM_DIR, stream.header.lane_name))
        assert stat.S_ISSOCK(lane.st_mode) and stat.S_IMODE(lane.st_mode) == 0o600  # offered
        stream.send(attached=feed_pb2.Attached(lane=False))
        seqs = []
        for message in stream.call:
            seqs.append(message.batch.seq)
            stream.send(release=feed_pb2.Release(seqs=[message.batch.seq]))
    finally:
        stream.close()
    assert seqs == [0, 1, 2]
    assert wait_until(lambda: _stream_ends(server, since))
    assert "transport=shm lane=no samples=10" in _stream_ends(server, since)[0]
    assert not stream_segments(shm_prefix(server.address))


def _never_connects(stream: _RawStream) -> None:
    stream.send(attached=feed_pb2.Attached(lane=True))


def _wrong_token(stream: _RawStream) -> None:
    lane = stream.connect_lane()
    lane.send(bytes(16))
    stream.send(attached=feed_pb2.Attached(lane=True))
    stream.lane = lane


def _on_the_lane(data: bytes):
    def lie(stream: _RawStream) -> None:
        lane = stream.connect_lane()
        lane.send(stream.header.lane_token)
        stream.send(attached=feed_pb2.Attached(lane=True))
        lane.send(data)
        stream.lane = lane
    return lie


_REQUEST = feed_pb2.ClientMessage(open=feed_pb2.StreamRequest()).SerializeToString()
_UNSENT = feed_pb2.ClientMessage(release=feed_pb2.Release(seqs=[999])).SerializeToString()


@pytest.mark.parametrize("lie, named", [
    (_never_connects, "attached: lane is true, but the client did not connect to the header's "
                      "lane_name"),
    (_wrong_token, "attached: the lane's first message was not the header's lane_token"),
    (_on_the_lane(_REQUEST), "lane: only `release` messages travel on the lane; this one was "
                             "open"),
    (_on_the_lane(b"\x12\x80"), "lane: a message that is not a ClientMessage"),
    (_on_the_lane(_UNSENT), "release: batch 999 is not one this stream sent"),
], ids=["never-connects", "wrong-token", "not-a-release", "unparsable", "release-unsent"])
def test_a_lie_about_the_lane_ends_that_stream_invalid_argument(server, feed, image_names, lie,
                                                                named):
    stream = _RawStream(server.address, image_names[:40])
    try:
        lie(stream)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in stream.call:  # nothing comes on the call: the batches went on the lane
                pass
    finally:
        stream.close()
        if hasattr(stream, "lane"):
            stream.lane.close()
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ended.value
    assert named in ended.value.details()
    assert _serves(feed, image_names[:6]) == list(range(6))  # the server serves on
    assert wait_until(lambda: not stream_segments(shm_prefix(server.address)))


def test_a_batch_too_large_for_the_lane_comes_on_the_call(server, feed, image_names):
    """A batch of 31 missing files with ~2 KB names: its failures pass the lane's 64 KiB."""
    missing = [f"{'no-such-folder/' * 140}{i}.jpg" for i in range(31)]
    since = len(server.log)
    loader = feed.loader([image_names[0], *missing], batch_size=32, size=(16, 16),
                         transport="shm", failure_budget=31)
    assert [batch["index"].tolist() for batch in loader] == [[0]]
    assert sorted(index for index, _ in loader.failures) == list(range(1, 32))
    assert wait_until(lambda: _stream_ends(server, since))
    assert "lane=yes samples=1 batches=1 failures=31" in _stream_ends(server, since)[0]
