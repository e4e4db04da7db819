"""What the server refuses from a hostile file or client, and that it serves on meanwhile.

Each test attacks a real server subprocess the way the adversarial review did
(README, "Security"), then checks that a well-behaved trainer still gets every
sample exactly once.
"""

from __future__ import annotations

import io
import os
import queue

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from clips import encode_video
from gpufeed.client import FeedClient
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2, feed_pb2_grpc

_RED = (250, 10, 10)


def _png(colour, size=(24, 32)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((*size, 3), colour, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kb / 1024


@pytest.fixture()
def hostile_root(tmp_path):
    """A data root of media files that name files outside it, and the server's cwd above it.

    The concat demuxer's safe mode refuses absolute paths and ``..``, but not a
    plain relative name, which FFmpeg opens relative to the server's working
    directory: here, the directory holding the root and the outside files.
    """
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside.png").write_bytes(_png(_RED))
    (tmp_path / "outside.mp4").write_bytes(encode_video(12, "mpeg4", "mp4"))
    (root / "good.png").write_bytes(_png((10, 200, 10)))
    (root / "concat.jpg").write_bytes(b"ffconcat version 1.0\nfile outside.png\n")
    (root / "self.png").write_bytes(b"ffconcat version 1.0\nfile root/self.png\n" * 2)
    (root / "playlist.jpg").write_bytes(b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\n"
                                        b"outside.png\n#EXT-X-ENDLIST\n")
    (root / "good.mp4").write_bytes(encode_video(12, "mpeg4", "mp4"))
    (root / "concat.mp4").write_bytes(b"ffconcat version 1.0\nfile outside.mp4\n")
    return tmp_path


def test_media_naming_files_outside_the_root_fail_alone(hostile_root):
    root = hostile_root / "root"
    images = ["good.png", "concat.jpg", "self.png", "playlist.jpg"] * 15
    with ServerProcess(["--data-root", str(root), "--threads", "2"], cwd=str(hostile_root)) as server, \
            FeedClient(server.address) as feed:
        pid = server.proc.pid
        fds, rss = _open_fds(pid), _rss_mb(pid)
        loader = feed.loader(files=images, batch_size=8, size=(24, 32), failure_budget=0.9)
        delivered = []
        for batch in loader:
            delivered += batch["index"].tolist()
            assert not (batch["image"][:, 0] > 200).any()  # nothing of the outside image
        assert delivered == [i for i, name in enumerate(images) if name == "good.png"]
        assert sorted(i for i, _ in loader.failures) == [
            i for i, name in enumerate(images) if name != "good.png"]
        assert all("not a supported image format" in why for _, why in loader.failures)

        clips = feed.loader(files=["good.mp4", "concat.mp4"], batch_size=2, size=(16, 16),
                            clip=(2, 1), failure_budget=1)
        assert [i for b in clips for i in b["index"].tolist()] == [0]
        (index, why), = clips.failures
        assert index == 1 and "not a supported video format" in why

        assert _open_fds(pid) <= fds + 8
        assert _rss_mb(pid) < rss + 300
        loader = feed.loader(files=["good.png"] * 10, batch_size=4, size=(8, 8))
        assert [i for b in loader for i in b["index"].tolist()] == list(range(10))
