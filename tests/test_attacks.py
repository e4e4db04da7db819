"""A hostile user's requests and a hostile file's tricks that earlier checks missed.

Each test attacks a real server subprocess with what once made it fail a whole
request with UNKNOWN or try to build a billion names: the attack must be refused
naming the field (or fail only the file it hides in), and the same server must
then serve a well-behaved trainer every sample once.
"""

from __future__ import annotations

import tarfile

import grpc
import numpy as np
import pytest

from gpufeed.client import FeedClient, FeedError
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess
from shards import write_shards

_MAX_SAMPLES = 1000
_SHARD_COUNTS = [3, 2]
_SIZE = (16, 16)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("attacks")
    write_shards(root / "good", _SHARD_COUNTS)
    rng = np.random.default_rng(11)
    (root / "pics").mkdir()
    for name in ("a.jpg", "b.jpg"):
        (root / "pics" / name).write_bytes(encode_jpeg(synthetic_photo(rng, 40, 50)))
    return root


@pytest.fixture(scope="module")
def feed(root):
    with ServerProcess(["--data-root", str(root), "--threads", "2",
                        "--max-samples", str(_MAX_SAMPLES)]) as server, \
            FeedClient(server.address) as client:
        yield client


def _indices(loader) -> list[int]:
    return [i for batch in loader for i in batch["index"].tolist()]


def _serves_shards(feed) -> None:
    loader = feed.loader(["good/train-{0000..0001}.tar"], batch_size=2, size=_SIZE)
    assert _indices(loader) == list(range(sum(_SHARD_COUNTS)))


@pytest.mark.parametrize("pattern", [
    "x-{0..999999999}.tar",  # a billion names from 20 bytes
    "x-{0..9}{0..9}{0..9}{0..9}.tar",  # 10,000 from groups that are small each
    "{a,b}" * 40 + ".tar",  # 2**40 names
])
def test_brace_patterns_over_max_samples_are_refused_before_they_expand(feed, pattern):
    with pytest.raises(FeedError) as info:
        feed.loader([pattern], batch_size=2, size=_SIZE)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "samples[0]" in str(info.value) and f"--max-samples {_MAX_SAMPLES}" in str(info.value)
    _serves_shards(feed)


def test_a_pattern_of_thousands_of_brace_groups_is_one_name(feed):
    """Each group was one level of recursion: 5000 of them ended the request UNKNOWN."""
    with pytest.raises(FeedError) as info:
        feed.loader(["{a}" * 20000 + ".tar"], batch_size=2, size=_SIZE)
    assert info.value.code == grpc.StatusCode.NOT_FOUND  # the one name "aaa...a.tar"
    assert "no tar shard could be read" in str(info.value)
    _serves_shards(feed)


def test_a_refusal_naming_a_long_path_arrives_with_its_status(feed):
    """A status's message is a header: naming a 20,000-character path, it passed the
    client's 16 KB limit, which then reported RESOURCE_EXHAUSTED instead of the refusal."""
    name = "x" * 20000 + ".flist"
    with pytest.raises(FeedError) as info:
        feed.loader(name, batch_size=2, size=_SIZE)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT  # too long for a file name
    assert "list_file" in str(info.value) and "bytes left out" in str(info.value)
    _serves_shards(feed)


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
def test_a_tar_header_declaring_an_absurd_size_fails_its_shard_alone(feed, root, kind):
    """tarfile reads a long name or pax record whole: a header declaring 2**62 bytes was a
    MemoryError that ended the request UNKNOWN instead of failing that shard."""
    (root / "lying").mkdir(exist_ok=True)
    (root / "lying" / "liar.tar").write_bytes(_lying_header(kind, 2 ** 62))
    loader = feed.loader(["good/train-0000.tar", "lying/liar.tar", "good/train-0001.tar"],
                         batch_size=2, size=_SIZE, failure_budget=1)
    first, second = _SHARD_COUNTS
    assert _indices(loader) == [*range(first), *range(first + 1, first + 1 + second)]
    ((index, reason),) = loader.failures
    assert index == first and "not a tar shard" in reason


def test_a_looping_symlink_in_a_listed_directory_fails_alone(feed, root):
    """A directory listing asked each entry whether it is a directory, and a symlink
    loop's answer (ELOOP) ended the request UNKNOWN; now it is a file like any symlink,
    failing when read. Among class folders it is no class."""
    (root / "zoo" / "cat").mkdir(parents=True, exist_ok=True)
    (root / "zoo" / "cat" / "c.jpg").write_bytes((root / "pics" / "a.jpg").read_bytes())
    loops = [root / "pics" / "loop-a.jpg", root / "pics" / "loop-b.jpg",
             root / "zoo" / "zz-a", root / "zoo" / "zz-b"]
    for link, target in zip(loops, ["loop-b.jpg", "loop-a.jpg", "zz-b", "zz-a"]):
        link.symlink_to(target)
    try:
        loader = feed.loader("pics/", batch_size=4, size=_SIZE, failure_budget=2)
        assert _indices(loader) == [0, 1]  # a.jpg, b.jpg; then the loops, failing
        assert [(i, reason.split(": ")[0]) for i, reason in loader.failures] == \
            [(2, "pics/loop-a.jpg"), (3, "pics/loop-b.jpg")]
        assert all("symbolic links" in reason for _, reason in loader.failures)

        classes = feed.loader("zoo/", labels="folder", batch_size=4, size=_SIZE)
        assert classes.classes == ["cat"] and _indices(classes) == [0]
    finally:
        for link in loops:
            link.unlink()
