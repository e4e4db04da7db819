"""Tar shards trusted for nothing: a hostile header fails its shard alone (never a loop, a
huge allocation or a silent loss), a shard replaced after it was indexed never hands out
the other version's bytes, and indexing is bounded (shards, samples) and stoppable while
it runs.

End-to-end tests run a real server subprocess and check what a trainer relies on: every
good sample once, with its label and its pixels, each failure named, and the same server
serving a normal pass afterwards. Index-level tests call ``ShardSet.index`` on a real
``Storage``.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from gpufeed.client import FeedClient, FeedError, metadata
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess
from gpufeed.server.storage.roots import Storage
from gpufeed.server.storage.shards import IndexCancelled, ShardSet, TooManySamples
from shards import label_of
from support import MIN_PSNR_DB, psnr, reset_peak_mb, status_mb

SIZE = (32, 40)
_END = bytes(1024)  # the end-of-archive blocks


# -- writing tars, hostile ones included --------------------------------------------

def _signed(header: bytearray) -> bytes:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def _member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE,
            size_field: bytes | None = None) -> bytes:
    """A ustar header (its size field ``size_field`` if given), then ``data`` in blocks."""
    info = tarfile.TarInfo(name)
    info.size, info.type = len(data), kind
    header = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    if size_field is not None:
        header[124:136] = size_field
    return _signed(header) + data + bytes(-len(data) % 512)


def _pax(**records: str) -> bytes:
    """A pax extended header for the next member."""
    body = b""
    for key, value in records.items():
        line = f" {key}={value}\n".encode()
        length = len(line) + 1
        while len(str(length)) + len(line) != length:
            length = len(str(length)) + len(line)
        body += str(length).encode() + line
    return _member("././@PaxHeader", body, tarfile.XHDTYPE)


def _base256(n: int) -> bytes:
    """A size field in GNU's base-256 (0x80, or 0xff for a negative number, then 11 bytes)."""
    return b"\x80" + n.to_bytes(11, "big") if n >= 0 else \
        b"\xff" + (256 ** 11 + n).to_bytes(11, "big")


def _bad_checksum() -> bytes:
    header = bytearray(_member("000090.jpg", b"x" * 10))
    header[0] = ord("1")  # after signing
    return bytes(header)


def _jpeg(index: int) -> bytes:
    """Sample ``index``'s image, the same each time it is asked for."""
    rng = np.random.default_rng(index)
    return encode_jpeg(synthetic_photo(rng, int(rng.integers(40, 70)), int(rng.integers(40, 70))))


def _samples(indices, labels: dict[int, int] | None = None) -> bytes:
    """Samples ``{i:06d}.jpg`` (``_jpeg(i)``) + ``.cls`` (``label_of(i)`` unless ``labels``
    says)."""
    out = b""
    for i in indices:
        label = (labels or {}).get(i, label_of(i))
        out += _member(f"{i:06d}.jpg", _jpeg(i)) + _member(f"{i:06d}.cls", str(label).encode())
    return out


# What follows two good samples in a hostile shard, and a word of why its index stops there.
HOSTILE = {
    # The pax size sends the next header back onto the pax header: tarfile looped for ever.
    "negative_pax_size": (_pax(size="-1536") + _member("000090.jpg", b"x" * 10), "bad size"),
    # -512 in base-256: the next header is this one again (tarfile looped, growing).
    "negative_base256_size": (_member("000090.jpg", b"x" * 512, size_field=_base256(-512)),
                              "bad size field"),
    "huge_base256_size": (_member("000090.jpg", b"x" * 512, size_field=_base256(2 ** 80)),
                          "declares"),
    "overflowing_pax_size": (_pax(size="9" * 30) + _member("000090.jpg", b"x" * 10),
                             "bad size"),
    "gnu_long_name_of_2**62_bytes": (_member("././@LongLink", b"x" * 2048,
                                             tarfile.GNUTYPE_LONGNAME, _base256(2 ** 62)),
                                     "declares"),
    "bad_checksum": (_bad_checksum(), "bad checksum"),
    "non_numeric_size": (_member("000090.jpg", b"x" * 10, size_field=b"0000000001x\0"),
                         "bad size field"),
    "cut_inside_a_header": (_member("000090.jpg", b"x" * 10)[:100], "ends inside a header"),
}
CASES = [(kind, "after_two_samples") for kind in HOSTILE] + [("negative_pax_size", "first")]


# -- a server over good and hostile shards ---------------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """good/train-0000.tar holds samples 0..2, good/train-0001.tar samples 5 and 6 (a
    hostile shard goes between them, as samples 3 and 4)."""
    root = tmp_path_factory.mktemp("trust")
    (root / "good").mkdir()
    (root / "hostile").mkdir()
    (root / "good" / "train-0000.tar").write_bytes(_samples(range(3)) + _END)
    (root / "good" / "train-0001.tar").write_bytes(_samples(range(5, 7)) + _END)
    return root


@pytest.fixture(scope="module")
def feed(root):
    with ServerProcess(["--data-root", str(root), "--threads", "2"]) as server, \
            FeedClient(server.address) as client:
        yield client


def _reference(jpeg: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(jpeg)) as im:
        return np.asarray(im.convert("RGB").resize(SIZE[::-1], Image.BILINEAR)).transpose(2, 0, 1)


def _delivered(loader) -> list[tuple[int, int, np.ndarray]]:
    return [(i, label, image.copy()) for batch in loader
            for i, label, image in zip(batch["index"].tolist(), batch["label"].tolist(),
                                       batch["image"].numpy())]


def _check_samples(delivered, expected: dict[int, tuple[int, int]]) -> None:
    """Every expected sample exactly once (stream index -> (label, sample written)), with
    its label and its image's pixels."""
    assert sorted(i for i, _, _ in delivered) == sorted(expected)
    for i, label, image in delivered:
        assert label == expected[i][0], (i, label)
        assert psnr(image, _reference(_jpeg(expected[i][1]))) >= MIN_PSNR_DB, i


def _serves_a_normal_pass(feed) -> None:
    loader = feed.loader(["good/train-{0000..0001}.tar"], batch_size=2, size=SIZE)
    _check_samples(_delivered(loader), {
        position: (label_of(i), i) for position, i in enumerate([0, 1, 2, 5, 6])})
    assert loader.failures == []


@pytest.mark.timeout(120)  # tarfile looped for ever on some of these: fail, not hang
@pytest.mark.parametrize("kind,where", CASES)
def test_a_hostile_tar_fails_its_shard_alone(feed, root, kind, where):
    hostile, why = HOSTILE[kind]
    before = _samples([3, 4]) if where != "first" else b""
    # Beyond the break, samples never to be read (a cut shard has nothing beyond).
    after = b"" if kind == "cut_inside_a_header" else \
        _samples([60, 61], labels={60: 7777, 61: 7777}) + _END
    name = f"hostile/{kind}-{where}.tar"
    (root / name).write_bytes(before + hostile + after)
    loader = feed.loader(["good/train-0000.tar", name, "good/train-0001.tar"], batch_size=2,
                         size=SIZE, failure_budget=5)
    delivered = _delivered(loader)
    failures = {f.index: f for f in loader.failures}
    if where == "first":  # nothing indexed: the shard is one failed sample
        assert list(failures) == [3]
        assert "not a tar shard" in failures[3].reason and why in failures[3].reason
        expected = {0: 0, 1: 1, 2: 2, 4: 5, 5: 6}  # stream index -> sample
    else:  # sample 3 whole; 4, the last before the break, may go on past it: it fails
        assert list(failures) == [4]
        assert "truncated shard" in failures[4].reason and why in failures[4].reason
        assert failures[4].category == "undecodable"
        expected = {0: 0, 1: 1, 2: 2, 3: 3, 5: 5, 6: 6}
    _check_samples(delivered, {i: (label_of(s), s) for i, s in expected.items()})
    _serves_a_normal_pass(feed)


# -- a shard replaced after it was indexed ---------------------------------------------

def test_a_local_shard_replaced_after_its_index_fails_its_samples_not_shifted(tmp_path):
    """The stream indexes both shards at open and opens s-1 only when it reaches it; s-1 is
    replaced (write, then rename over it) while the trainer holds the first batch, by a
    version with one more leading sample. Its samples fail, named; none is read at the old
    offsets of the new file. The next request indexes the new version."""
    folder = tmp_path / "swap"
    folder.mkdir()
    (folder / "s-0.tar").write_bytes(_samples(range(8)) + _END)
    old = _samples(range(8, 12))
    (folder / "s-1.tar").write_bytes(old + _END)
    new = _samples([7000], labels={7000: 7000}) + old + _END
    with ServerProcess(["--data-root", str(tmp_path), "--threads", "2"]) as server, \
            FeedClient(server.address) as client:
        # One sample a batch, one batch ahead: the server is a few samples ahead of the
        # trainer at most, far from s-1's first (8).
        loader = client.loader(["swap/s-{0..1}.tar"], batch_size=1, prefetch=1, size=SIZE,
                               failure_budget=10)
        delivered = []
        for batch in loader:
            if not delivered:
                staged = folder / "s-1.tar.new"
                staged.write_bytes(new)
                os.replace(staged, folder / "s-1.tar")
            delivered += _delivered([batch])
        _check_samples(delivered, {i: (label_of(i), i) for i in range(8)})
        assert sorted(f.index for f in loader.failures) == [8, 9, 10, 11]
        for failure in loader.failures:
            assert "shard changed since it was indexed" in failure.reason, failure
            assert failure.category == "unreadable"
        # A new request: the new version, indexed afresh (5 samples, the first one new).
        loader = client.loader(["swap/s-{0..1}.tar"], batch_size=4, size=SIZE)
        expected = {i: (label_of(i), i) for i in range(8)}
        expected[8] = (7000, 7000)
        expected.update({i + 1: (label_of(i), i) for i in range(8, 12)})
        _check_samples(_delivered(loader), expected)
        assert loader.failures == []


def test_a_local_shard_written_in_place_while_read_fails_its_rest(tmp_path):
    """``cp`` over a shard (or ``rsync --inplace``) keeps its inode: the descriptor a stream
    has open then reads the new bytes. Every read is checked after it is made, so no
    sample of the new version is delivered under the old index; the rest fail, named."""
    folder = tmp_path / "inplace"
    folder.mkdir()
    old = _samples(range(8)) + _END
    (folder / "s-0.tar").write_bytes(old)
    new = _samples(range(8), labels={i: 2000 + 7 * i for i in range(8)}) + _END
    assert len(new) == len(old)  # same offsets, other labels
    with ServerProcess(["--data-root", str(tmp_path), "--threads", "1"]) as server, \
            FeedClient(server.address) as client:
        loader = client.loader(["inplace/s-0.tar"], batch_size=1, prefetch=1, size=SIZE,
                               failure_budget=8)
        delivered = []
        for batch in loader:
            if not delivered:
                with open(folder / "s-0.tar", "r+b") as f:  # same inode, new bytes
                    f.write(new)
            delivered += _delivered([batch])
    failed = sorted(f.index for f in loader.failures)
    assert failed and sorted([i for i, _, _ in delivered] + failed) == list(range(8))
    _check_samples(delivered, {i: (label_of(i), i) for i, _, _ in delivered})  # old, all
    for failure in loader.failures:
        assert "shard changed since it was indexed" in failure.reason, failure


# -- bounds on indexing --------------------------------------------------------------

def test_a_request_naming_more_shards_than_max_shards_is_refused_before_indexing(root):
    with ServerProcess(["--data-root", str(root), "--threads", "2",
                        "--max-shards", "4"]) as server, FeedClient(server.address) as feed:
        for names, field in ((["good/train-{0000..0009}.tar"], "samples[0]"),
                             ([f"good/train-{i:04d}.tar" for i in range(5)], "samples[4]")):
            with pytest.raises(FeedError) as refused:
                feed.loader(names, batch_size=2, size=SIZE)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-shards 4" in str(refused.value) and field in str(refused.value)
        _serves_a_normal_pass(feed)


def _many_members(samples: int) -> bytes:
    """``samples`` samples of two empty members (``%08d.jpg``, ``.cls``): 512 bytes each."""
    template = bytearray(_member("00000000.jpg"))
    template[148:156] = b" " * 8
    mid, tail = bytes(template[12:148]), bytes(template[156:512])
    base = sum(template) - sum(template[:12])
    parts = []
    for i in range(samples):
        digits = b"%08d" % i
        for name in (digits + b".jpg", digits + b".cls"):
            parts += (name, mid, b"%06o\0 " % (base + sum(name)), tail)
    return b"".join(parts) + _END


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("many") / "many.tar"
    path.write_bytes(_many_members(100_000))
    return path


def _storage(path: Path) -> tuple[Storage, CollectorRegistry]:
    registry = CollectorRegistry()
    storage = Storage([str(path.parent)])
    storage.register_metrics(registry)
    return storage, registry


def _index_bytes(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("gpufeed_storage_index_bytes_total", {"source": "local"})


def _fresh(path: Path, name: str) -> Path:
    """The same file under another name: an index not in the server's cache."""
    other = path.with_name(name)
    os.link(path, other)
    return other


def test_a_shard_of_200000_members_indexes_every_sample(many):
    storage, _ = _storage(many)
    shards = ShardSet.index(storage, [str(many)])
    assert shards.num_samples == 100_000 and shards.unreadable() == []
    index = shards.indexes[0]
    at = np.arange(100_000) * 1024
    assert (index.image_offset == at + 512).all() and (index.label_offset == at + 1024).all()
    assert (index.image_size == 0).all() and (index.failure == 0).all()


def test_indexing_stops_as_soon_as_the_shards_pass_max_samples(many):
    path = _fresh(many, "limited.tar")
    storage, registry = _storage(path)
    with pytest.raises(TooManySamples):
        ShardSet.index(storage, [str(path)], max_samples=1000)
    assert _index_bytes(registry) < path.stat().st_size / 10  # not the whole shard first


def test_a_cancelled_index_stops_within_a_few_thousand_headers(many):
    path = _fresh(many, "cancelled.tar")
    storage, registry = _storage(path)
    asked = []

    def cancelled() -> bool:  # from its fourth question on
        asked.append(True)
        return len(asked) > 3

    with pytest.raises(IndexCancelled):
        ShardSet.index(storage, [str(path)], cancelled=cancelled)
    read = _index_bytes(registry)
    assert read < path.stat().st_size / 10
    # Cancelled before it starts: no shard is read, however many are listed.
    with pytest.raises(IndexCancelled):
        ShardSet.index(storage, [str(path)] * 20, cancelled=lambda: True)
    assert _index_bytes(registry) == read


def test_a_field_member_over_its_bound_fails_its_sample_unread(tmp_path):
    """A shard sample's metadata member larger than its field's max_items fails that sample
    (too_large) before the member is read: 300 MB never reach the server's memory."""
    big = b'{"caption": "' + b"x" * 300_000_000 + b'"}'
    shard = (_member("000000.jpg", _jpeg(0)) + _member("000000.cls", b"1")
             + _member("000000.json", big)
             + _member("000001.jpg", _jpeg(1)) + _member("000001.cls", b"2")
             + _member("000001.json", b'{"caption": "fine"}') + _END)
    (tmp_path / "meta.tar").write_bytes(shard)
    del big, shard
    with ServerProcess(["--data-root", str(tmp_path), "--threads", "2"]) as server, \
            FeedClient(server.address) as feed:
        before = reset_peak_mb(server.proc.pid)
        loader = feed.loader(["meta.tar"], batch_size=2, size=SIZE, fields=["meta"],
                             failure_budget=1)
        delivered = [(i, meta) for b in loader for i, meta in zip(b["index"].tolist(),
                                                                  metadata(b))]
        assert delivered == [(1, {"caption": "fine"})]
        (failure,) = loader.failures
        assert failure.index == 0 and failure.category == "too_large", failure
        assert "meta: 300000015 bytes, over the 4096 bytes" in failure.reason
        assert status_mb(server.proc.pid, "VmHWM") - before < 100  # MB
