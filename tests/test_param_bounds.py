"""Sample-transform parameters, bounded at open: a request out of bounds is INVALID_ARGUMENT
naming ``sample_transforms[i]`` and the parameter, allocates nothing on the server, and the
server goes on serving; values at the bounds are served."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpufeed.client import FeedError
from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from support import reset_peak_mb, status_mb

N = 16
SIZE = 32
# What the server's memory may grow by while it refuses a request: a small multiple of
# anything a refused request's parsing needs, far under what the unbounded ones took (GBs).
MAX_GROWTH_MB = 100


def _images(loader) -> dict[int, object]:
    out = {}
    for batch in loader:
        for index, image in zip(batch["index"].tolist(), batch["image"].numpy()):
            assert index not in out
            out[index] = image.copy()
    return out


def _loader(feed, names, transforms):
    return feed.loader(names[:N], batch_size=8, size=SIZE, resize="random_resized_crop",
                       flip=0.5, seed=3, transport="inline", transforms=transforms)


def _refused(address: str, names: list[str], name: str, params_json: str) -> grpc.RpcError:
    """The server's answer to a raw request (one the client would not send: NaN, Infinity,
    100,000 levels deep) with the transform ``name`` and ``params_json``."""
    request = feed_pb2.StreamRequest(
        files=feed_pb2.FileList(paths=names[:N]), batch_size=8,
        output=feed_pb2.OutputSpec(height=SIZE, width=SIZE), transport=feed_pb2.TRANSPORT_INLINE,
        prefetch=1, sample_transforms=[feed_pb2.SampleTransform(name=name,
                                                               params_json=params_json)])
    with grpc.insecure_channel(address) as channel:
        call = feed_pb2_grpc.FeedStub(channel).Stream(
            iter([feed_pb2.ClientMessage(open=request)]), timeout=60)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    return info.value


def _still_serving(server, feed, names, reference: dict) -> None:
    """Health says SERVING, Info answers, and a pass gives exactly ``reference``."""
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert feed.info().version
    again = _images(_loader(feed, names, ["trivial_augment_wide"]))
    assert sorted(again) == sorted(reference)
    for index, image in reference.items():
        assert (again[index] == image).all(), index


@pytest.mark.parametrize("name, bad, good, words", [
    ("trivial_augment_wide", {"num_magnitude_bins": 257}, {"num_magnitude_bins": 256},
     ["num_magnitude_bins", "2..256"]),
    ("color_jitter", {"brightness": [1, 1e300]}, {"brightness": [0, 255]},
     ["brightness", "255"]),
    ("color_jitter", {"contrast": 300}, {"contrast": 254}, ["contrast", "255"]),
    ("random_erasing", {"ratio": [1, 1e300]}, {"ratio": [1, 100]}, ["ratio", "100"]),
    ("random_erasing", {"ratio": [0.001, 1]}, {"ratio": [0.01, 1]}, ["ratio", "0.01"]),
])
def test_builtin_parameters_out_of_range_are_refused_at_open(feed, image_names, name, bad, good,
                                                             words):
    """Each bound refuses what is past it, naming the transform's place and the parameter,
    and serves what is on it."""
    with pytest.raises(FeedError) as refused:
        _loader(feed, image_names, ["color_jitter", (name, bad)])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for word in ["sample_transforms[1]", repr(name), *words]:
        assert word in str(refused.value), str(refused.value)
    assert sorted(_images(_loader(feed, image_names, ["color_jitter", (name, good)]))) == \
        list(range(N))


def test_millions_of_magnitude_bins_are_refused_before_anything_is_allocated(server, feed,
                                                                             image_names):
    """A 100-byte request asking for 3,000,000 bins is refused at open; the server's
    memory does not grow, and it serves others exactly as before."""
    reference = _images(_loader(feed, image_names, ["trivial_augment_wide"]))
    before = reset_peak_mb(server.proc.pid)
    with pytest.raises(FeedError) as refused:
        _loader(feed, image_names, [("trivial_augment_wide", {"num_magnitude_bins": 3_000_000})])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sample_transforms[0]" in str(refused.value)
    assert "num_magnitude_bins" in str(refused.value)
    assert status_mb(server.proc.pid, "VmHWM") - before < MAX_GROWTH_MB
    assert status_mb(server.proc.pid) - before < MAX_GROWTH_MB
    _still_serving(server, feed, image_names, reference)


_DEEP = '{"value": ' + "[" * 30_000 + "]" * 30_000 + "}"  # under the size bound: its depth
_DEEPER = '{"value": ' + "[" * 100_000 + "]" * 100_000 + "}"  # over it: its size


@pytest.mark.parametrize("name, params_json, words", [
    ("random_erasing", '{"ratio": [1, Infinity]}', ["'ratio'", "finite"]),
    ("random_erasing", '{"ratio": [1, 1e999]}', ["'ratio'", "finite"]),
    ("random_erasing", '{"p": NaN}', ["'p'", "finite"]),
    ("color_jitter", '{"hue": -Infinity}', ["'hue'", "finite"]),
    ("random_erasing", _DEEP, ["nested deeper than 32 levels"]),
    ("random_erasing", _DEEPER, ["over the 65536"]),
    ("random_erasing", '{"value": [' + ", ".join(["0"] * 2_000_000) + "]}", ["over the 65536"]),
])
def test_parameters_the_client_would_not_send_are_refused_naming_them(server, feed, image_names,
                                                                      name, params_json, words):
    """Non-finite numbers, parameters nested 30,000 deep, or megabytes of them, sent raw:
    INVALID_ARGUMENT naming ``sample_transforms[0]`` and the transform (and the parameter
    where there is one), never UNKNOWN with a recursion error nor samples failing one by
    one; the server goes on serving."""
    reference = _images(_loader(feed, image_names, ["trivial_augment_wide"]))
    error = _refused(server.address, image_names, name, params_json)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    for word in ["sample_transforms[0]", repr(name), *words]:
        assert word in error.details(), error.details()
    assert "recursion" not in error.details()
    _still_serving(server, feed, image_names, reference)


def test_a_request_names_at_most_64_transforms(feed, image_names):
    """Each transform is made at open and kept while the stream is: their number is
    bounded, so the memory they hold is."""
    with pytest.raises(FeedError) as refused:
        _loader(feed, image_names, ["color_jitter"] * 65)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sample_transforms: 65 transforms, over the 64" in str(refused.value)
    assert sorted(_images(_loader(feed, image_names, ["color_jitter"] * 64))) == list(range(N))
