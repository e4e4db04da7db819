"""What the client sends back for each batch of a stream.

One Release per batch, carrying how long the trainer waited for it; the
batch's slot rides on it when the transport's reader gave it back at once
(inline, copies), and goes back in a Release of its own once the trainer drops
a view (shm). The server's side of the call is played by a stand-in that
replays its messages, so that every message the client sends can be read.
"""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

from gpufeed.client.stream import OpenStream
from gpufeed.v1 import feed_pb2

_SLOT_BYTES = 4096


class _Call:
    """The client's end of a Stream call whose server sends ``replies``."""

    def __init__(self, replies: list[feed_pb2.ServerMessage]):
        self._replies = iter(replies)

    def __iter__(self):
        return self

    def __next__(self) -> feed_pb2.ServerMessage:
        return next(self._replies)

    def cancel(self) -> None:
        pass


class _Server:
    """A Connection's stand-in: its stub's Stream replays ``replies`` and keeps the
    iterator of the client's messages."""

    metadata = ()
    answered = False

    def __init__(self, replies: list[feed_pb2.ServerMessage]):
        self.stub = self
        self._replies = replies
        self.requests = iter(())

    def Stream(self, requests, metadata=()):  # noqa: N802 (the stub's name)
        self.requests = requests
        return _Call(self._replies)


def _batch(seq: int, num_slots: int, data: bool, failed: bool = False) -> feed_pb2.ServerMessage:
    batch = feed_pb2.Batch(seq=seq, slot=seq % num_slots)
    if failed:  # every sample failed: no tensors
        batch.failures.add(index=seq, reason="x.jpg: file not found")
        return feed_pb2.ServerMessage(batch=batch)
    batch.tensors.add(name="index", dtype="int64", shape=[2], offset=0)
    if data:
        batch.data = np.array([2 * seq, 2 * seq + 1], np.int64).tobytes()
    return feed_pb2.ServerMessage(batch=batch)


def _sent(server: _Server, stream: OpenStream) -> list[tuple[str, list[int], bool]]:
    """The client's messages after ``open``: (kind, released seqs, a wait reported)."""
    stream.close()  # ends the iterator of the client's messages
    messages = list(server.requests)
    assert messages[0].WhichOneof("kind") == "open"
    return [(m.WhichOneof("kind"), list(m.release.seqs), m.release.wait_seconds > 0)
            for m in messages[1:]]


def test_an_inline_batch_gives_its_slot_back_with_its_release():
    header = feed_pb2.StreamHeader(transport=feed_pb2.TRANSPORT_INLINE, num_slots=2,
                                   slot_bytes=_SLOT_BYTES)
    server = _Server([feed_pb2.ServerMessage(header=header), _batch(0, 2, True),
                      _batch(1, 2, False, failed=True), _batch(2, 2, True)])
    stream = OpenStream(server, feed_pb2.StreamRequest(), copy=False)
    got = [(seq, None if tensors is None else tensors["index"].tolist())
           for seq, _, tensors in stream.batches()]
    assert got == [(0, [0, 1]), (1, None), (2, [4, 5])]
    assert _sent(server, stream) == [("release", [0], True), ("release", [1], True),
                                     ("release", [2], True)]


@pytest.fixture
def segment():
    """A segment in /dev/shm as the server makes one: a name the client maps."""
    name = f"gpufeed-test-{secrets.token_hex(8)}"
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 3 * _SLOT_BYTES)
        yield name
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.parametrize("copy", [False, True])
def test_a_shm_view_gives_its_slot_back_once_dropped(segment, copy):
    header = feed_pb2.StreamHeader(transport=feed_pb2.TRANSPORT_SHM, shm_name=segment,
                                   num_slots=3, slot_bytes=_SLOT_BYTES)
    server = _Server([feed_pb2.ServerMessage(header=header),
                      *(_batch(seq, 3, False) for seq in range(3))])
    stream = OpenStream(server, feed_pb2.StreamRequest(), copy=copy)
    batches = stream.batches()
    for _, _, tensors in batches:
        assert tensors["index"].shape == (2,)
        del tensors  # the trainer drops each batch before it asks for the next
    batches.close()
    if copy:  # owned tensors: each slot went back with its batch's Release
        expected = [("release", [seq], True) for seq in range(3)]
    else:  # views: a Release with the wait, then the slot's own once dropped
        expected = [("release", [], True), ("release", [0], False), ("release", [], True),
                    ("release", [1], False), ("release", [], True), ("release", [2], False)]
    assert _sent(server, stream) == [("attached", [], False), *expected]
