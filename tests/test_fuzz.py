"""Random bytes and random requests against a real server, which must serve on.

A fixed budget (call counts, one seed): raw bytes sent to every method through a
generic channel call with no serializer, then StreamRequests whose every field
takes a random value (in and out of range, non-finite, NUL bytes, unknown enum
values). Meanwhile a well-behaved trainer makes passes, each of which must
deliver every sample exactly once, and health checks must answer.
"""

from __future__ import annotations

import random
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpufeed.client import FeedClient
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2

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
