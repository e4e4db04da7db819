"""A lane's end, without a process: the trainer reads every batch sent before it, then the
end of file, however many Releases it sent after the stream was over.

A Unix socket closed with unread messages resets its peer, and a reset can come
before the messages the peer has not read yet: the server must read the lane to
the trainer's end of file before it closes it.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from types import SimpleNamespace

from gpufeed.server.serving.edge.lane import StreamLane
from gpufeed.server.serving.edge.readers import read_lane
from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import SHM_DIR


class _EndedStream(SimpleNamespace):
    """A stream whose ring has gone: every Release is of a batch it no longer holds."""

    cancelled = True

    def release(self, seqs) -> None:
        raise KeyError(seqs[0])

    def cancel(self, ending=None) -> None:
        raise AssertionError(f"an ended stream was cancelled again: {ending}")


def test_releases_after_the_streams_end_are_read_so_the_batches_sent_arrive():
    lane = StreamLane(f"gpufeed-{secrets.token_hex(8)}-{secrets.token_hex(8)}")
    trainer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        trainer.connect(os.path.join(SHM_DIR, lane.name))
        trainer.send(lane.token)
        lane.accept(timeout=5)
        assert not os.path.exists(os.path.join(SHM_DIR, lane.name))  # the name went
        lane.reader = threading.Thread(target=read_lane, args=(lane, _EndedStream()))
        lane.reader.start()
        batches = [feed_pb2.ServerMessage(batch=feed_pb2.Batch(seq=seq)).SerializeToString()
                   for seq in range(3)]
        for data in batches:
            lane.send(data)
        for seq in range(3):  # Releases of batches the stream has already let go of
            trainer.send(feed_pb2.ClientMessage(release=feed_pb2.Release(seqs=[seq]))
                         .SerializeToString())
        trainer.shutdown(socket.SHUT_WR)  # the reader stops at this end of file, or before
        lane.reader.join(10)
        lane.finish(10)  # closes the lane: a reset now if a Release was left unread
        received = [trainer.recv(1 << 16) for _ in range(4)]  # a reset raises here
        assert received == [*batches, b""]  # every batch, then the end of file
    finally:
        trainer.close()
        lane.close()
    assert not lane.reader.is_alive()
