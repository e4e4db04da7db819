"""What the server refuses from a hostile file or client, and that it serves on meanwhile.

Each test attacks a real server subprocess (docs/guide/security.md lists what it
refuses), then checks that the same server still serves a well-behaved trainer
every sample exactly once: the attack is refused naming the field, or fails only
the file it hides in.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import queue
import shlex
import shutil
import subprocess
import sys
import tarfile
import textwrap

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from clips import encode_video
from gpufeed.client import FeedClient, FeedError
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from shards import write_shards
from support import wait_until

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
    with ServerProcess(["--data-root", str(root), "--threads", "2"],
                       cwd=str(hostile_root)) as server, \
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


def _trainer_pass(address: str, files: list[str], token: str | None = None) -> list[int]:
    with FeedClient(address, token=token) as feed:
        loader = feed.loader(files=files, batch_size=4, size=(8, 8))
        return [i for b in loader for i in b["index"].tolist()]


def _admitted_pass(address: str, files: list[str], passes: list) -> bool:
    """A trainer's pass into ``passes``; False when refused for --max-streams."""
    try:
        passes.append(_trainer_pass(address, files))
    except FeedError as e:
        if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return False
    return True


@pytest.mark.parametrize("token", [None, "s3cret"])
@pytest.mark.slow
def test_idle_calls_never_starve_health_info_or_trainers(data_dir, image_names, tmp_path, token):
    """More idle calls than the server has worker threads: calls that never send their
    first message (Stream, Info), and health watchers that never end."""
    args = ["--data-root", str(data_dir), "--max-streams", "2"]
    if token:
        (tmp_path / "token").write_text(token)
        args += ["--token-file", str(tmp_path / "token")]
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    never: queue.Queue = queue.Queue()  # idle calls' requests: nothing until the test ends
    with ServerProcess(args) as server, grpc.insecure_channel(server.address) as channel:
        feed_stub = feed_pb2_grpc.FeedStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        idle_info = channel.stream_unary("/gpufeed.v1.Feed/Info")
        try:
            idle = [feed_stub.Stream(iter(never.get, None), metadata=metadata) for _ in range(60)]
            idle += [idle_info.future(iter(never.get, None), metadata=metadata) for _ in range(20)]
            watchers = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(24)]
            assert wait_until(lambda: sum(not call.running() for call in idle) >= 80 - 16)

            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
            with FeedClient(server.address, token=token, connect_timeout=10) as feed:
                assert feed.info().version
            files = image_names[:24]
            assert _trainer_pass(server.address, files, token) == list(range(24))

            codes = {call.code() for call in idle}  # each ends: ended as oldest, or timed out
            assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
            details = {call.details().split("(")[-1] for call in idle}
            assert any("--max-waiting-calls 16" in d for d in details)
            assert any("--open-timeout" in d for d in details)
            assert _trainer_pass(server.address, files, token) == list(range(24))
        finally:
            for _ in range(200):
                never.put(None)
            for watcher in watchers:
                watcher.cancel()


def test_a_client_that_never_reads_loses_its_stream_after_the_lease_timeout(data_dir,
                                                                            image_names):
    """The server blocks sending to it (HTTP/2 flow control): the lease timeout must
    still end the stream and free what it holds, here the only stream allowed."""
    files = image_names[:40]
    with ServerProcess(["--data-root", str(data_dir), "--max-streams", "1",
                        "--lease-timeout", "2"]) as server, \
            grpc.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        request = feed_pb2.StreamRequest(  # 1.5 MB inline batches: far over a 64 KB window
            files=feed_pb2.FileList(paths=files), batch_size=8, prefetch=2,
            output=feed_pb2.OutputSpec(height=256, width=256), transport=feed_pb2.TRANSPORT_INLINE)
        never: queue.Queue = queue.Queue()
        stalled = feed_pb2_grpc.FeedStub(channel).Stream(
            itertools.chain([feed_pb2.ClientMessage(open=request)], iter(never.get, None)))
        try:
            # The trainer is refused (--max-streams 1) until the stalled stream is ended.
            passes: list[list[int]] = []
            assert wait_until(lambda: _admitted_pass(server.address, files, passes), 30)
            assert passes == [list(range(40))]
            assert not stalled.done()  # it still has not read: it never learns, and need not
        finally:
            stalled.cancel()
            never.put(None)


def _output(**fields) -> feed_pb2.OutputSpec:
    spec = feed_pb2.OutputSpec(height=8, width=8, dtype="float32")
    for name, value in fields.items():
        if name in ("mean", "std"):
            getattr(spec, name).extend(value)
        else:
            setattr(spec, name, value)
    return spec


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize("change, words", [
    ({"output": _output(resize=9)}, ["output.resize", "9"]),
    ({"output": _output(layout=7)}, ["output.layout", "7"]),
    ({"output": _output(resize=2, ratio_min=_INF, ratio_max=_INF)}, ["output.ratio"]),
    ({"output": _output(resize=2, ratio_min=1e30, ratio_max=1e30)}, ["output.ratio"]),
    ({"output": _output(resize=2, ratio_min=1e-30, ratio_max=1.0)}, ["output.ratio"]),
    ({"output": _output(resize=2, scale_min=_NAN, scale_max=1.0)}, ["output.scale"]),
    ({"output": _output(mean=[0.5] * 3, std=[_NAN] * 3)}, ["output.std"]),
    ({"output": _output(mean=[0.5] * 3, std=[0.0] * 3)}, ["output.std"]),
    ({"output": _output(mean=[_INF] * 3, std=[0.5] * 3)}, ["output.mean"]),
    ({"files": feed_pb2.FileList(paths=["img0000.jpg", "img\x00.jpg"])}, ["samples[1]", "NUL"]),
    ({"prefix": "\x00"}, ["samples[0]", "NUL"]),
    ({"list_file": "all\x00.flist"}, ["list_file", "NUL"]),
    ({"list_file": "nul.flist"}, ["samples[1]", "NUL"]),
])
def test_bad_values_are_refused_at_open_naming_the_field(server, data_dir, change, words):
    (data_dir / "nul.flist").write_text("img0000.jpg\nimg\x000001.jpg\n")
    request = feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=["img0000.jpg"] * 4),
                                     batch_size=2, output=_output(),
                                     transport=feed_pb2.TRANSPORT_INLINE)
    for name, value in change.items():
        if isinstance(value, str):
            setattr(request, name, value)
        else:
            getattr(request, name).CopyFrom(value)
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(feed_pb2_grpc.FeedStub(channel).Stream(
                iter([feed_pb2.ClientMessage(open=request)]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    for word in words:
        assert word in info.value.details()
    assert _trainer_pass(server.address, ["img0000.jpg"] * 4) == [0, 1, 2, 3]


def test_a_second_open_ends_the_stream(server, image_names):
    request = feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=image_names[:40]),
                                     batch_size=2, output=_output(), prefetch=1,
                                     transport=feed_pb2.TRANSPORT_INLINE)
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(feed_pb2_grpc.FeedStub(channel).Stream(
                iter([feed_pb2.ClientMessage(open=request)] * 2), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "open" in info.value.details() and "another" in info.value.details()


def test_an_unexpected_sample_error_logs_its_traceback_once(caplog):
    from gpufeed.server.serving.failures import sample_failure

    with caplog.at_level("DEBUG", logger="gpufeed.server.serving.failures"):
        for index in range(3):
            try:
                raise OverflowError(f"bug {index}")
            except OverflowError as e:
                category, _ = sample_failure(e, index, f"/data/{index}.jpg")
                assert category == feed_pb2.FAILURE_INTERNAL
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "sample 0" in tracebacks[0].getMessage()
    assert [r.levelname for r in caplog.records] == ["ERROR", "DEBUG", "DEBUG"]


_FULL_SHM_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from gpufeed.client import FeedClient
    from gpufeed.server.process import ServerProcess

    data_root, files = sys.argv[1], sys.argv[2:]
    results = {}

    def one_pass(server):
        with FeedClient(server.address) as feed:
            transports = list(feed.info().transports)
            loader = feed.loader(files=files, batch_size=8, size=(256, 256))  # 1.5 MB a batch
            indices = [i for b in loader for i in b["index"].tolist()]
        return {"indices": indices, "transport": loader.transport, "offered": transports}

    # 1 MB of /dev/shm: room for the server's probe, not for a stream's ring.
    with ServerProcess(["--data-root", data_root]) as server:
        results["ring_does_not_fit"] = one_pass(server)
        log = "".join(server.log)
    results["server_said"] = "no memory for a TRANSPORT_SHM stream" in log
    filler = os.open("/dev/shm/filler", os.O_WRONLY | os.O_CREAT)  # now not even the probe fits
    try:
        while os.write(filler, bytes(4096)):
            pass
    except OSError:
        pass
    os.close(filler)
    with ServerProcess(["--data-root", data_root]) as server:
        results["probe_does_not_fit"] = one_pass(server)
        results["server_warned"] = "offering the inline transport only" in "".join(server.log)
    print(json.dumps(results))
""")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
@pytest.mark.slow
def test_auto_falls_back_to_inline_when_dev_shm_is_full(data_dir, image_names):
    files = image_names[:20]
    command = shlex.join([sys.executable, "-c", _FULL_SHM_SCRIPT, str(data_dir), *files])
    script = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {command}"
    result = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True,
                            text=True, env=os.environ, timeout=300)
    if result.returncode != 0 and "mount" in result.stderr + result.stdout:
        pytest.skip(f"cannot make a private /dev/shm here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    results = json.loads(result.stdout)
    inline, shm = feed_pb2.TRANSPORT_INLINE, feed_pb2.TRANSPORT_SHM
    assert results["ring_does_not_fit"] == {"indices": list(range(20)), "transport": "inline",
                                            "offered": [inline, shm]}
    assert results["server_said"]
    assert results["probe_does_not_fit"] == {"indices": list(range(20)), "transport": "inline",
                                             "offered": [inline]}
    assert results["server_warned"]


# -- a server with --max-samples over tar shards: patterns, lying headers, loops --
_MAX_SAMPLES = 1000
_SHARD_COUNTS = [3, 2]
_SIZE = (16, 16)


@pytest.fixture(scope="module")
def shard_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("attacks")
    write_shards(root / "good", _SHARD_COUNTS)
    rng = np.random.default_rng(11)
    (root / "pics").mkdir()
    for name in ("a.jpg", "b.jpg"):
        (root / "pics" / name).write_bytes(encode_jpeg(synthetic_photo(rng, 40, 50)))
    return root


@pytest.fixture(scope="module")
def shard_feed(shard_root):
    with ServerProcess(["--data-root", str(shard_root), "--threads", "2",
                        "--max-samples", str(_MAX_SAMPLES)]) as server, \
            FeedClient(server.address) as client:
        yield client


def _indices(loader) -> list[int]:
    return [i for batch in loader for i in batch["index"].tolist()]


def _serves_shards(shard_feed) -> None:
    loader = shard_feed.loader(["good/train-{0000..0001}.tar"], batch_size=2, size=_SIZE)
    assert _indices(loader) == list(range(sum(_SHARD_COUNTS)))


@pytest.mark.parametrize("pattern", [
    "x-{0..999999999}.tar",  # a billion names from 20 bytes
    "x-{0..9}{0..9}{0..9}{0..9}.tar",  # 10,000 from groups that are small each
    "{a,b}" * 40 + ".tar",  # 2**40 names
])
def test_brace_patterns_over_max_samples_are_refused_before_they_expand(shard_feed, pattern):
    with pytest.raises(FeedError) as info:
        shard_feed.loader([pattern], batch_size=2, size=_SIZE)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "samples[0]" in str(info.value) and f"--max-samples {_MAX_SAMPLES}" in str(info.value)
    _serves_shards(shard_feed)


def test_a_pattern_of_thousands_of_brace_groups_is_one_name(shard_feed):
    """Each group was one level of recursion: 5000 of them ended the request UNKNOWN."""
    with pytest.raises(FeedError) as info:
        shard_feed.loader(["{a}" * 20000 + ".tar"], batch_size=2, size=_SIZE)
    assert info.value.code == grpc.StatusCode.NOT_FOUND  # the one name "aaa...a.tar"
    assert "no tar shard could be read" in str(info.value)
    _serves_shards(shard_feed)


def test_a_refusal_naming_a_long_path_arrives_with_its_status(shard_feed):
    """A status's message is a header: naming a 20,000-character path, it passed the
    client's 16 KB limit, which then reported RESOURCE_EXHAUSTED instead of the refusal."""
    name = "x" * 20000 + ".flist"
    with pytest.raises(FeedError) as info:
        shard_feed.loader(name, batch_size=2, size=_SIZE)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT  # too long for a file name
    assert "list_file" in str(info.value) and "bytes left out" in str(info.value)
    _serves_shards(shard_feed)


def _lying_header(kind: bytes, size: int) -> bytes:
    """A tar header of ``kind`` declaring ``size`` bytes (base-256, as GNU tar writes huge
    sizes) with a valid checksum, and a little data behind it."""
    header = bytearray(tarfile.TarInfo("././@LongLink").tobuf(format=tarfile.GNU_FORMAT))[:512]
    header[156:157] = kind
    field = bytearray(size.to_bytes(12, "big"))
    field[0] |= 0x80
    header[124:136] = field
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header) + b"x" * 2048


@pytest.mark.parametrize("kind", [tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE],
                         ids=["gnu-long-name", "pax-header"])
def test_a_tar_header_declaring_an_absurd_size_fails_its_shard_alone(shard_feed, shard_root, kind):
    """tarfile reads a long name or pax record whole: a header declaring 2**62 bytes was a
    MemoryError that ended the request UNKNOWN instead of failing that shard."""
    (shard_root / "lying").mkdir(exist_ok=True)
    (shard_root / "lying" / "liar.tar").write_bytes(_lying_header(kind, 2 ** 62))
    loader = shard_feed.loader(["good/train-0000.tar", "lying/liar.tar", "good/train-0001.tar"],
                         batch_size=2, size=_SIZE, failure_budget=1)
    first, second = _SHARD_COUNTS
    assert _indices(loader) == [*range(first), *range(first + 1, first + 1 + second)]
    ((index, reason),) = loader.failures
    assert index == first and "not a tar shard" in reason


def test_a_looping_symlink_in_a_listed_directory_fails_alone(shard_feed, shard_root):
    """A directory listing asked each entry whether it is a directory, and a symlink
    loop's answer (ELOOP) ended the request UNKNOWN; now it is a file like any symlink,
    failing when read. Among class folders it is no class."""
    (shard_root / "zoo" / "cat").mkdir(parents=True, exist_ok=True)
    (shard_root / "zoo" / "cat" / "c.jpg").write_bytes((shard_root / "pics" / "a.jpg").read_bytes())
    loops = [shard_root / "pics" / "loop-a.jpg", shard_root / "pics" / "loop-b.jpg",
             shard_root / "zoo" / "zz-a", shard_root / "zoo" / "zz-b"]
    for link, target in zip(loops, ["loop-b.jpg", "loop-a.jpg", "zz-b", "zz-a"]):
        link.symlink_to(target)
    try:
        loader = shard_feed.loader("pics/", batch_size=4, size=_SIZE, failure_budget=2)
        assert _indices(loader) == [0, 1]  # a.jpg, b.jpg; then the loops, failing
        assert [(i, reason.split(": ")[0]) for i, reason in loader.failures] == \
            [(2, "pics/loop-a.jpg"), (3, "pics/loop-b.jpg")]
        assert all("symbolic links" in reason for _, reason in loader.failures)

        classes = shard_feed.loader("zoo/", labels="folder", batch_size=4, size=_SIZE)
        assert classes.classes == ["cat"] and _indices(classes) == [0]
    finally:
        for link in loops:
            link.unlink()
