"""Memory bounded in total and per read: what would exhaust the server is refused, clearly.

A server-wide budget for rings and plans; regular files of a bounded size only;
a bounded list file; declared sizes checked before anything is allocated for
them (arrays, video frames, sizes derived from options); and memory given back
after large plans and abandoned shared jobs.
"""

from __future__ import annotations

import io
import os
import stat
import zipfile

import av
import grpc
import numpy as np
import pytest

from gpufeed.client import FeedClient, FeedError
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from support import status_mb, wait_until

_MEMORY = 3_000_000  # a stream of 5 slots of 32 images of 64x64 (~2 MB) fits; two do not
_FILE = 1_000_000
_LIST = 4096
_PIXELS = 20_000


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    rng = np.random.default_rng(17)
    for i in range(40):
        (root / f"img{i:02d}.jpg").write_bytes(encode_jpeg(synthetic_photo(rng, 80, 100)))
    return root


@pytest.fixture(scope="module")
def feed(root):
    with ServerProcess(["--data-root", str(root), "--threads", "2",
                        "--max-memory-bytes", str(_MEMORY), "--max-file-bytes", str(_FILE),
                        "--max-list-bytes", str(_LIST), "--max-pixels", str(_PIXELS)]) as server:
        with FeedClient(server.address) as client:
            yield client


def _indices(loader) -> list[int]:
    return [i for batch in loader for i in batch["index"].tolist()]


def _images(count: int) -> list[str]:
    return [f"img{i:02d}.jpg" for i in range(count)]


def test_memory_budget_counts_open_streams_and_gets_them_back(feed):
    """One request planned a 17.9 GB ring once; now every stream's ring counts, until it ends."""
    def loader(repeat: int = 1):
        return feed.loader(files=_images(40) * repeat, batch_size=32, size=(64, 64),
                           prefetch=4, transport="inline", reconnect_timeout=0)

    holding = iter(loader(repeat=10))  # more batches than slots: it stays open
    next(holding)  # open, holding ~2 MB of the budget
    with pytest.raises(FeedError) as info:
        next(iter(loader()))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-memory-bytes" in str(info.value) and "slots" in str(info.value)
    holding.close()  # ends the stream: its memory goes back

    def opens() -> bool:
        try:
            return len(_indices(loader())) == 40
        except FeedError as e:
            assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            return False
    assert wait_until(opens)


def test_only_regular_files_within_the_size_limit_are_read(feed, root):
    """A FIFO or device under a root was read until 3 GB; a sparse file cost its size per read."""
    (root / "odd").mkdir()
    os.mkfifo(root / "odd" / "pipe.jpg")
    with open(root / "odd" / "sparse.jpg", "wb") as f:
        f.write((root / "img00.jpg").read_bytes())
        f.truncate(2 * _FILE)
    names = ["img00.jpg", "odd/pipe.jpg", "odd/sparse.jpg"]
    try:  # a character device (here /dev/null's numbers) needs CAP_MKNOD; a FIFO does not
        os.mknod(root / "odd" / "null.jpg", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        names.append("odd/null.jpg")
    except PermissionError:
        pass
    loader = feed.loader(files=names + ["img01.jpg"], batch_size=8, size=(16, 16),
                         failure_budget=len(names))
    assert _indices(loader) == [0, len(names)]
    reasons = dict(loader.failures)
    assert "a FIFO, not a regular file" in reasons[1]
    assert f"file of {2 * _FILE} bytes" in reasons[2] and "--max-file-bytes" in reasons[2]
    if len(names) == 4:
        assert "a character device, not a regular file" in reasons[3]


def test_each_failure_arrives_with_its_category(feed, root, tmp_path):
    """The category is set by the server where the sample fails and read by the trainer
    from ``loader.failures``, beside the (index, reason) pair; nobody parses reasons."""
    (root / "cat").mkdir()
    (root / "cat" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    with open(root / "cat" / "huge.jpg", "wb") as f:  # sparse: over --max-file-bytes
        f.truncate(_FILE + 1)
    rng = np.random.default_rng(3)
    (root / "cat" / "wide.jpg").write_bytes(encode_jpeg(synthetic_photo(rng, 150, 200)))
    os.mkfifo(root / "cat" / "pipe.jpg")
    (tmp_path / "secret.jpg").write_bytes((root / "img00.jpg").read_bytes())
    (root / "cat" / "link.jpg").symlink_to(tmp_path / "secret.jpg")
    expected = {"cat/missing.jpg": "not_found", "cat/corrupt.jpg": "undecodable",
                "cat/huge.jpg": "too_large", "cat/wide.jpg": "too_large",  # --max-pixels
                "cat/pipe.jpg": "unreadable", "cat/link.jpg": "permission_denied"}
    names = ["img00.jpg", *expected]
    loader = feed.loader(files=names, batch_size=4, size=(16, 16),
                         failure_budget=len(expected))
    assert _indices(loader) == [0]
    got = {names[f.index]: f.category for f in loader.failures}
    assert got == expected
    for failure in loader.failures:  # still the (index, reason) pair it always was
        index, reason = failure
        assert reason.startswith(names[index] + ": ") and failure.reason == reason


def test_list_file_is_bounded(feed, root):
    (root / "long.flist").write_text("\n".join(_images(40) * 20) + "\n")  # 8000 bytes
    with pytest.raises(FeedError) as info:
        _indices(feed.loader(files="long.flist", batch_size=8, size=(16, 16)))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "list_file" in str(info.value) and "--max-list-bytes" in str(info.value)

    os.mkfifo(root / "pipe.flist")
    with pytest.raises(FeedError) as info:
        _indices(feed.loader(files="pipe.flist", batch_size=8, size=(16, 16)))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "list_file" in str(info.value) and "not a regular file" in str(info.value)


def _npy_header(shape: tuple[int, ...]) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        out, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return out.getvalue()


def test_arrays_declaring_more_than_they_hold_are_refused_before_allocating(feed, root):
    """A 1.4 MB .npz made numpy allocate 1.4 GB before any check."""
    np.savez(root / "good.npz", x=np.arange(4, dtype=np.float32))
    with zipfile.ZipFile(root / "liar.npz", "w") as z:  # a header for 400 MB, 16 bytes of data
        z.writestr("x.npy", _npy_header((100_000_000,)) + bytes(16))
    np.savez_compressed(root / "zipbomb.npz", x=np.zeros(5 * _FILE // 4, np.float32))
    assert (root / "zipbomb.npz").stat().st_size < _FILE  # small on disk, 5 MB inflated
    loader = feed.loader(files=["good.npz", "liar.npz", "zipbomb.npz", "good.npz"],
                         batch_size=4, failure_budget=2)
    assert _indices(loader) == [0, 3]
    reasons = dict(loader.failures)
    assert "declares an array of 400000000 bytes" in reasons[1]
    assert "uncompressed, over the limit" in reasons[2] and "--max-file-bytes" in reasons[2]


def _video(width: int, height: int, frames: int = 8) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=25)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            image = np.zeros((height, width, 3), np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def test_video_frames_over_max_pixels_are_refused(feed, root):
    """A 16000x16000 video frame bypassed --max-pixels."""
    (root / "small.mp4").write_bytes(_video(96, 64))
    (root / "large.mp4").write_bytes(_video(192, 128))  # 24576 pixels > _PIXELS
    loader = feed.loader(files=["small.mp4", "large.mp4"], batch_size=2, size=(16, 16),
                         clip=(2, 1), failure_budget=1)
    assert _indices(loader) == [0]
    ((index, reason),) = loader.failures
    assert index == 1 and "video declares 192x128" in reason and "--max-pixels" in reason


def test_sizes_derived_from_options_are_bounded(feed):
    """shorter_side 12000 added 932 MB: it is bounded at open, and every scaled size per sample."""
    with pytest.raises(FeedError) as info:
        _indices(feed.loader(files=_images(1), batch_size=1, size=(16, 16),
                             resize="center_crop", shorter_side=12000))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "output.shorter_side" in str(info.value)
    # A shorter side of 200 on 80x100 sources would scale each to 200x250 (over
    # --max-pixels) to cut the centre; the crop path resizes only the centre box to
    # the output, so nothing that size is made and the samples are served. (Without
    # the JPEG extension the decoder still scales whole images: there the scaled
    # size is checked against --max-pixels, src/gpufeed/server/media/decode.py.)
    loader = feed.loader(files=_images(2), batch_size=2, size=(16, 16), resize="center_crop",
                         shorter_side=200, failure_budget=2)
    assert _indices(loader) == [0, 1] and not loader.failures


def test_memory_returns_after_large_plans_and_abandoned_jobs(tmp_path):
    """Six sequential 2M-sample streams once left a server 1.8 GB larger, and four abandoned
    shared jobs of 2M samples 1.3 GB larger: plans are compact, jobs do not keep them, and
    what a plan freed goes back to the system."""
    samples = 1_000_000
    names = "".join(f"train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG\n" for i in range(samples))
    (tmp_path / "big.flist").write_text(names)  # ~45 MB; the files need not exist

    def open_and_leave(stub, job: str) -> None:
        request = feed_pb2.StreamRequest(
            list_file="big.flist", batch_size=32, output=feed_pb2.OutputSpec(height=8, width=8),
            transport=feed_pb2.TRANSPORT_INLINE, prefetch=1, shuffle=True, job=job)
        call = stub.Stream(iter([feed_pb2.ClientMessage(open=request)]))
        assert next(call).WhichOneof("kind") == "header"
        call.cancel()

    with ServerProcess(["--data-root", str(tmp_path), "--threads", "1"]) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = feed_pb2_grpc.FeedStub(channel)
        pid = server.proc.pid
        open_and_leave(stub, "")  # warm up: imports, thread stacks, gRPC's buffers
        assert wait_until(lambda: status_mb(pid) < 400, timeout=60)
        start = status_mb(pid)
        for k in range(4):
            open_and_leave(stub, f"job-{k}" if k % 2 else "")
        # On the old server each of these kept ~150 MB (a plan in an abandoned job, ~300 MB).
        assert wait_until(lambda: status_mb(pid) < start + 60, timeout=60), (start, status_mb(pid))


class _Plan:
    """What a job is made from (a stand-in for a StreamPlan of three batches)."""

    batches = [np.arange(2)] * 3


def _job_request(name: str) -> feed_pb2.StreamRequest:
    return feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=["a.jpg"]), batch_size=2,
                                  job=name)


def test_a_shared_job_keeps_no_plan_and_idle_jobs_are_bounded():
    """Four abandoned 2M-sample jobs once held 1.3 GB: a job keeps its place, not its plan,
    and jobs without a consumer are kept up to a bound, the one idle longest forgotten first."""
    import weakref

    from gpufeed.server.serving.running.sources import JobRegistry

    registry = JobRegistry()

    def abandon(name: str, plan: _Plan):
        """A job whose one consumer took a batch and left."""
        job = registry.join(_job_request(name), plan)
        wake = lambda: None  # noqa: E731
        job.add_consumer(wake)
        job.claim()
        job.remove_consumer(wake)
        return job

    plan = _Plan()
    planned = weakref.ref(plan)
    abandon("first", plan)
    del plan
    assert planned() is None  # the consumer's plan went with its stream

    kept = abandon("kept", _Plan())
    assert registry.join(_job_request("kept"), _Plan()) is kept  # rejoined: the same pass
    for i in range(300):
        abandon(f"other-{i}", _Plan())
    assert registry.join(_job_request("kept"), _Plan()) is not kept  # forgotten: a new pass
