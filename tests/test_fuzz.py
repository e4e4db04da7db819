"""Random bytes, random requests and hostile files against a real server, which must serve on.

A fixed budget (call counts, one seed): raw bytes sent to every method through a
generic channel call with no serializer, then StreamRequests whose every field
takes a random value (in and out of range, non-finite, NUL bytes, unknown enum
values). Meanwhile a well-behaved trainer makes passes, each of which must
deliver every sample exactly once, and health checks must answer.

Then the surfaces that read what a file or a parameter says: tar shards with
one seeded mutation each (bit flips past the member names, sizes and checksums
that lie, pax records and GNU long names that lie, truncation), sidecar files
(boxes, metadata) that lie in their own ways, and sample-transform parameters
drawn in and out of range. Every pass must end with an expected status (no
hang, no server bug), deliver each shard sample with the image its label names,
and leave the server serving a normal pass exactly, with nothing left in
/dev/shm and its memory back near where it started.
"""

from __future__ import annotations

import io
import json
import random
import tarfile
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpufeed.client import FeedClient, FeedError, Field
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from shards import write_shards
from support import MIN_PSNR_DB, psnr, shm_prefix, status_mb, stream_segments, wait_until

SEED = 20261123
RAW_CALLS = 120
REQUEST_CALLS = 150
# Statuses a fuzzed call may end with. Not UNKNOWN or INTERNAL: those are
# exceptions the server did not expect (CANCELLED is the fuzzer going away).
_ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
            grpc.StatusCode.UNIMPLEMENTED}
_METHODS = ["/gpufeed.v1.Feed/Stream", "/gpufeed.v1.Feed/Info", "/grpc.health.v1.Health/Check",
            "/grpc.health.v1.Health/Watch", "/gpufeed.v1.Feed/NoSuchMethod"]
_FLOATS = [0.0, -1.0, 0.5, 1.0, 2.0, 1e-30, 1e30, float("nan"), float("inf"), float("-inf")]


def _raw_call(channel: grpc.Channel, rng: random.Random) -> grpc.StatusCode:
    method = rng.choice(_METHODS)
    messages = [rng.randbytes(rng.choice([0, 1, 7, 64, 1000, 20000]))
                for _ in range(rng.randint(0, 3))]
    call = channel.stream_stream(method)(iter(messages), timeout=10)
    try:
        for _, _ in zip(range(3), call):
            pass
    except grpc.RpcError:
        pass
    call.cancel()
    return call.code()


def _random_request(rng: random.Random, names: list[str]) -> feed_pb2.StreamRequest:
    """Half the requests draw every field from all its values, half from valid ones only
    (the first value of each ``pick``, default floats), so that streams run too."""
    wild = rng.random() < 0.5

    def pick(*values):
        return rng.choice(values if wild else values[:1])

    junk = ["", "..", "../../etc/passwd", "/etc/passwd", "a\x00b", "dir/", "no-such.jpg",
            "x.mp4", "x.npz", "\u00e9\u0301.png", "all.flist"]
    paths = [rng.choice(names + junk if wild else names) for _ in range(rng.randint(1, 40))]
    request = feed_pb2.StreamRequest(
        prefix=pick("", "sub/", "\x00", "/"), batch_size=rng.choice([1, 4, 8]) if not wild
        else pick(0, -3, 2**31 - 1),
        drop_last=rng.random() < 0.5, shuffle=rng.random() < 0.5, seed=rng.getrandbits(64),
        epoch=rng.getrandbits(64), rank=pick(0, 0, 1, -1, 5), world_size=pick(0, 1, 2, -2, 3),
        transport=pick(0, 1, 1, 2, 3, 9), prefetch=pick(0, 1, 2, 3, -1, 1000),
        start_batch=pick(0, 0, 1, 3, -1, 2**40), max_failures=pick(0, 3, -1, 1000),
        max_failure_fraction=rng.choice(_FLOATS) if wild else 0.0,
        job=pick("", "fuzz", "\x00"),
        label_source=pick(0, 0, 1, 2, 7))
    if rng.random() < 0.1:
        request.list_file = pick("all.flist", "nope.flist", "../x", "img0000.jpg", "a\x00")
    else:
        request.files.paths.extend(paths)
    if rng.random() < 0.3:
        request.labels.extend(rng.randint(-5, 5) for _ in range(pick(len(paths), 1, 0)))
    output = request.output
    output.height, output.width = pick(8, 16, 0, -1, 9000), pick(16, 8, 0, -1, 9000)
    output.resize, output.layout = pick(0, 1, 2, 9), pick(0, 1, 7)
    output.shorter_side = pick(0, 0, 8, 20, -5)
    floats = _FLOATS if wild else [0.0]  # 0: the default
    output.scale_min, output.scale_max = rng.choice(floats), rng.choice(floats)
    output.ratio_min, output.ratio_max = rng.choice(floats), rng.choice(floats)
    output.flip_probability = rng.choice(floats)
    output.dtype = pick("", "uint8", "float32", "float16", "bfloat16", "int7")
    if rng.random() < 0.3:
        output.dtype = pick("float32", "uint8")
        output.mean.extend(rng.choice(_FLOATS) if wild else 0.5 for _ in range(pick(3, 1)))
        output.std.extend(rng.choice(_FLOATS) if wild else 0.25 for _ in range(pick(3, 2)))
    if rng.random() < 0.2:
        request.clip.frames, request.clip.stride = pick(1, 2, 0, -1), pick(0, 1, -1)
        request.clip.random_start = rng.random() < 0.5
    return request


def _request_call(channel: grpc.Channel, rng: random.Random,
                  names: list[str]) -> grpc.StatusCode:
    """Open a random request, read a few messages, release some or none, go away."""
    messages = [feed_pb2.ClientMessage(open=_random_request(rng, names))]
    for _ in range(rng.randint(0, 3)):
        messages.append(rng.choice([
            feed_pb2.ClientMessage(release=feed_pb2.Release(seqs=[rng.randint(-2, 5)])),
            feed_pb2.ClientMessage(attached=feed_pb2.Attached()),
            feed_pb2.ClientMessage(open=_random_request(rng, names)),
        ]))
    call = channel.stream_stream(
        "/gpufeed.v1.Feed/Stream", request_serializer=feed_pb2.ClientMessage.SerializeToString,
        response_deserializer=feed_pb2.ServerMessage.FromString)(iter(messages), timeout=10)
    try:
        for _, _ in zip(range(rng.randint(0, 6)), call):
            pass
    except grpc.RpcError:
        pass
    call.cancel()
    return call.code()


class _Trainer(threading.Thread):
    """Passes over ``files`` until stopped; each pass must deliver every sample once."""

    def __init__(self, address: str, files: list[str]):
        super().__init__(daemon=True)
        self.address, self.files = address, files
        self.stopping = threading.Event()
        self.passes, self.wrong, self.error = 0, [], None

    def run(self) -> None:
        try:
            with FeedClient(self.address) as feed:
                while not self.stopping.is_set():
                    loader = feed.loader(files=self.files, batch_size=4, size=(16, 16),
                                         shuffle=True, seed=self.passes)
                    indices = sorted(i for b in loader for i in b["index"].tolist())
                    if indices != list(range(len(self.files))):
                        self.wrong.append(indices)
                    self.passes += 1
        except Exception as e:  # noqa: BLE001 (reported by the test)
            self.error = e


@pytest.mark.slow
def test_fuzzed_calls_leave_the_server_serving(data_dir, image_names):
    rng = random.Random(SEED)
    args = ["--data-root", str(data_dir), "--max-streams", "8", "--max-prefetch", "4",
            "--max-batch-bytes", str(8 << 20), "--max-samples", "5000",
            "--max-request-bytes", str(1 << 20), "--lease-timeout", "3", "--open-timeout", "3"]
    files = image_names[:40]
    with ServerProcess(args) as server, grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        trainer = _Trainer(server.address, files)
        trainer.start()
        codes = []
        try:
            for n in range(RAW_CALLS + REQUEST_CALLS):
                if n < RAW_CALLS:
                    codes.append(_raw_call(channel, rng))
                else:
                    codes.append(_request_call(channel, rng, image_names[:60]))
                if n % 30 == 0:
                    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                        health_pb2.HealthCheckResponse.SERVING
        finally:
            trainer.stopping.set()
            trainer.join(120)
        assert trainer.error is None and not trainer.wrong and trainer.passes >= 1
        assert set(codes) <= _ALLOWED, set(codes) - _ALLOWED
        assert server.proc.poll() is None
        with FeedClient(server.address) as feed:
            loader = feed.loader(files=files, batch_size=4, size=(16, 16))
            assert [i for b in loader for i in b["index"].tolist()] == list(range(40))
        assert not [line for line in server.log if "Traceback" in line], "".join(server.log)


# -- the newer surfaces: tar shards, sidecar files, sample-transform parameters ---------

SURFACE_SEED = 20261126
MUTATED_SHARDS, SIDECAR_SAMPLES, PARAM_CALLS = 36, 24, 60
# Statuses a pass over fuzzed files or parameters may end with: never UNKNOWN or INTERNAL
# (a server bug), nor DEADLINE_EXCEEDED (a pass that hangs).
_SURFACE_ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.DATA_LOSS}
_SIZE = (16, 16)


def _members(tar: bytes) -> list[int]:
    """The offsets of a tar's member headers."""
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        return [member.offset for member in archive.getmembers()]


def _pax_header(records: bytes) -> bytes:
    """A pax extended header block (valid checksum) followed by ``records``, padded."""
    header = bytearray(512)
    header[0:10] = b"PaxHeader"
    header[100:108] = b"0000644\0"
    header[124:136] = b"%011o\0" % len(records)
    header[156:157] = b"x"
    header[257:265] = b"ustar\x0000"
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header) + records + b"\0" * (-len(records) % 512)


def _mutated(rng: random.Random, good: bytes) -> bytes:
    """``good`` with one seeded mutation of its headers (names left alone: a renamed
    member is a different, valid tar), or cut short."""
    data = bytearray(good)
    at = rng.choice(_members(good))
    kind = rng.randrange(6)
    if kind == 0:  # bit flips past the name: mode, sizes, times, checksum, type, magic
        for _ in range(rng.randint(1, 8)):
            data[at + rng.randrange(100, 512)] ^= 1 << rng.randrange(8)
    elif kind == 1:  # a size that lies
        data[at + 124:at + 136] = rng.choice([
            b"-0000000001\0", b"77777777777\0", b"\x80" + rng.randbytes(11),
            b"\xff" * 12, b"99999999999\0", b"           \0", b"%011o\0" % (len(good) * 4)])
    elif kind == 2:  # a wrong checksum
        data[at + 148:at + 156] = b"%06o\0 " % rng.randrange(1 << 18)
    elif kind == 3:  # a pax header whose records lie, before a member
        records = rng.choice([b"13 size=-512\n", b"14 size=-1536\n", b"9 size=9\n",
                              b"12 size=1e9\n", b"30 path=" + b"a" * 22 + b"\n",
                              b"999999 path=x\n", b"1 \n", rng.randbytes(rng.randint(1, 300))])
        data[at:at] = _pax_header(records)
    elif kind == 4:  # a GNU long name declaring far more than the shard holds
        longname = bytearray(512)
        longname[0:13] = b"././@LongLink"
        longname[124:136] = rng.choice([b"77777777777\0",  # 8 GiB; then 2**62 (base-256):
                                        b"\x80" + b"\0" * 3 + b"\x40" + b"\0" * 7])
        longname[156:157] = b"L"
        longname[257:265] = b"ustar  \0"
        longname[148:156] = b" " * 8
        longname[148:156] = b"%06o\0 " % sum(longname)
        data[at:at] = longname
    else:  # cut short, anywhere
        del data[rng.randrange(1, len(data)):]
    return bytes(data)


def _sidecar(rng: random.Random, kind: str) -> bytes:
    """A hostile boxes (.txt) or meta (.json) file."""
    if kind == "txt":
        return rng.choice([
            b"0 0 1 1 0\n" * rng.choice([1, 8, 9, 5000]), b"nan nan inf -inf 1\n",
            b"1e400 0 1 1 0\n", b"0 0 1\n", b"a b c d e\n", rng.randbytes(rng.randint(0, 4000)),
            b"-5 -5 -1 -1 -7\n" * 3, b"\0" * 100, b"0 0 1 1 99999999999999999999999\n"])
    depth = rng.choice([1, 31, 33, 500, 50_000])
    return rng.choice([
        b"[" * depth + b"]" * depth, b'{"a": ' * 40 + b"1" + b"}" * 40, b"NaN",
        json.dumps({"x": "y" * rng.choice([10, 5000])}).encode(), b"\xff\xfe{", b"",
        rng.randbytes(rng.randint(1, 3000)), b'"' + b"\\u" * 100 + b'"', b"1" * 5000])


def _wild(rng: random.Random, depth: int = 0):
    """A parameter value: in range (half the time), out of range, non-finite, huge, deep,
    or the wrong type."""
    if rng.random() < 0.5:
        return rng.choice([0, 0.1, 0.5, [0.1, 0.3], 1])
    pick = rng.randrange(10)
    if pick == 0 and depth < 3:
        return [_wild(rng, depth + 1) for _ in range(rng.choice([0, 1, 2, 3, 4, 100]))]
    if pick == 1:
        nested = 0
        for _ in range(rng.choice([5, 33, 200])):
            nested = [nested]
        return nested
    return rng.choice([0, 1, -1, 0.5, 2, 31, 255, 256, 3_000_000, 10**30, 1e308,
                       float("nan"), float("inf"), -float("inf"), "x", True, None, {"k": 1}])


def _wild_transforms(rng: random.Random) -> list:
    params = {"color_jitter": ["brightness", "contrast", "saturation", "hue"],
              "trivial_augment_wide": ["num_magnitude_bins", "fill"],
              "random_erasing": ["p", "scale", "ratio", "value"]}
    chosen = []
    for name in rng.sample(sorted(params), rng.randint(1, 3)):
        keys = rng.sample(params[name], rng.randint(1, len(params[name])))
        chosen.append((name, {key: _wild(rng) for key in keys}))
    return chosen


def _fuzz_root(root: Path, rng: random.Random) -> tuple[list[str], list[bytes]]:
    """Shards (good ones first, then mutated ones) and images with hostile sidecars."""
    good, jpegs = write_shards(root / "shards", [4, 5, 3])
    for k in range(MUTATED_SHARDS):
        source = (root / "shards" / rng.choice(good)).read_bytes()
        (root / "shards" / f"bad-{k:03d}.tar").write_bytes(_mutated(rng, source))
    side = root / "side"
    side.mkdir()
    for i in range(SIDECAR_SAMPLES):
        (side / f"s{i:02d}.jpg").write_bytes(jpegs[i % len(jpegs)])
        if i % 3 == 0:  # every third sample's sidecars are fine
            (side / f"s{i:02d}.txt").write_text("0 0 4 4 1\n")
            (side / f"s{i:02d}.json").write_text('{"ok": true}')
        else:
            (side / f"s{i:02d}.txt").write_bytes(_sidecar(rng, "txt"))
            (side / f"s{i:02d}.json").write_bytes(_sidecar(rng, "json"))
    return good, jpegs


def _checked_pass(feed, rng_or_none, **options) -> grpc.StatusCode:
    """One pass; each delivered shard sample's image is the one its label says (a label
    never goes with another sample's image), no failure is a server bug. Its status."""
    jpegs = options.pop("jpegs", None)
    try:
        loader = feed.loader(batch_size=4, size=_SIZE, failure_budget=10_000, **options)
        for batch in loader:
            if jpegs is not None:
                for image, label in zip(batch["image"].numpy(), batch["label"].tolist()):
                    assert psnr(image, _jpeg_reference(jpegs[(label - 1000) // 7])) >= MIN_PSNR_DB
        assert not [f for f in loader.failures if f.category == "internal"], loader.failures
    except FeedError as e:
        return e.code
    return grpc.StatusCode.OK


def _raw_pass(address: str, shard: str, transforms: list) -> grpc.StatusCode:
    """A whole stream of raw gRPC with ``transforms``' parameters as Python writes them."""
    request = feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=[shard]), batch_size=4,
                                     output=feed_pb2.OutputSpec(height=16, width=16),
                                     transport=feed_pb2.TRANSPORT_INLINE, max_failures=1000)
    for name, params in transforms:
        request.sample_transforms.add(name=name, params_json=json.dumps(params))
    with grpc.insecure_channel(address) as channel:
        call = feed_pb2_grpc.FeedStub(channel).Stream(
            iter([feed_pb2.ClientMessage(open=request)]), timeout=60)
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass
        return call.code()


def _jpeg_reference(jpeg: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(jpeg)) as im:
        return np.asarray(im.convert("RGB").resize(_SIZE[::-1], Image.BILINEAR)).transpose(2, 0, 1)


@pytest.mark.slow
@pytest.mark.timeout(180)  # a hang fails here, not at the suite's 300 s
def test_fuzzed_shards_sidecars_and_parameters_leave_the_server_serving(tmp_path):
    rng = random.Random(SURFACE_SEED)
    good, jpegs = _fuzz_root(tmp_path, rng)
    bad = [f"bad-{k:03d}.tar" for k in range(MUTATED_SHARDS)]
    args = ["--data-root", str(tmp_path), "--threads", "2", "--max-streams", "8"]
    with ServerProcess(args) as server, FeedClient(server.address) as feed:
        prefix = shm_prefix(server.address)
        exact = dict(files=[f"shards/{name}" for name in good], jpegs=jpegs)
        assert _checked_pass(feed, None, **exact) == grpc.StatusCode.OK  # warm: then RSS
        before = status_mb(server.proc.pid)
        codes = []
        for k in range(0, MUTATED_SHARDS, 2):  # two mutated shards beside a good one
            names = [good[k % len(good)], bad[k], bad[k + 1]]
            codes.append(_checked_pass(feed, None, files=[f"shards/{n}" for n in names],
                                       jpegs=jpegs, shuffle=k % 4 == 0, seed=k))
        fields = {"boxes": Field(".txt", max_items=8), "meta": Field(".json", max_items=512)}
        for seed in range(3):
            codes.append(_checked_pass(feed, None, files="side/", fields=fields, seed=seed,
                                       resize="random_resized_crop", flip=0.5))
        for k in range(PARAM_CALLS):
            transforms = _wild_transforms(rng)
            if k % 2:  # as JSON text the client library would not send (NaN, Infinity)
                codes.append(_raw_pass(server.address, f"shards/{good[0]}", transforms))
                continue
            try:
                codes.append(_checked_pass(feed, None, files=[f"shards/{good[0]}"],
                                           transforms=transforms))
            except (ValueError, TypeError):  # refused by the client before it is sent
                codes.append(grpc.StatusCode.INVALID_ARGUMENT)
        assert set(codes) <= _SURFACE_ALLOWED, set(codes) - _SURFACE_ALLOWED
        assert grpc.StatusCode.OK in codes and grpc.StatusCode.INVALID_ARGUMENT in codes
        # Then: serving, a normal pass exact, nothing left in /dev/shm, memory back.
        with grpc.insecure_channel(server.address) as channel:
            assert health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        assert _checked_pass(feed, None, **exact) == grpc.StatusCode.OK
        assert wait_until(lambda: not stream_segments(prefix))
        assert status_mb(server.proc.pid) - before < 150  # MB
    assert not [line for line in server.log if "Traceback" in line], "".join(server.log)
