"""Bad requests get a clear status naming the problem, and the server keeps serving."""

from __future__ import annotations

import grpc
import pytest

from gpufeed.client import FeedClient, FeedError
from gpufeed.v1 import feed_pb2, feed_pb2_grpc


def _fails(feed, **kwargs) -> FeedError:
    args = {"files": ["img0000.jpg"], "batch_size": 4, "size": (16, 16), **kwargs}
    with pytest.raises(FeedError) as info:
        list(feed.loader(**args))
    return info.value


@pytest.mark.parametrize("kwargs, code, words", [
    ({"files": ["../../etc/passwd"]}, grpc.StatusCode.PERMISSION_DENIED, ["samples[0]", "leaves"]),
    ({"files": ["/etc/passwd"]}, grpc.StatusCode.PERMISSION_DENIED, ["samples[0]", "not under"]),
    ({"files": "no-such.flist"}, grpc.StatusCode.NOT_FOUND, ["list_file", "no-such.flist"]),
    ({"files": "../outside.flist"}, grpc.StatusCode.PERMISSION_DENIED, ["list_file"]),
    ({"files": []}, grpc.StatusCode.INVALID_ARGUMENT, ["samples", "empty"]),
    ({"batch_size": 0}, grpc.StatusCode.INVALID_ARGUMENT, ["batch_size", "0"]),
    ({"size": (0, 0)}, grpc.StatusCode.INVALID_ARGUMENT, ["output", "(0, 0)"]),
    ({"labels": [1, 2]}, grpc.StatusCode.INVALID_ARGUMENT, ["labels", "2 labels for 1"]),
    ({"rank": 3, "world_size": 3}, grpc.StatusCode.INVALID_ARGUMENT, ["rank", "3"]),
    ({"prefetch": 1000}, grpc.StatusCode.INVALID_ARGUMENT, ["prefetch", "--max-prefetch"]),
    ({"batch_size": 100000, "size": (1024, 1024)}, grpc.StatusCode.RESOURCE_EXHAUSTED,
     ["--max-batch-bytes"]),
    ({"transport": "cuda_ipc"}, grpc.StatusCode.INVALID_ARGUMENT, ["transport", "CUDA_IPC"]),
])
def test_bad_request_is_refused_clearly(feed, kwargs, code, words):
    error = _fails(feed, **kwargs)
    assert error.code == code
    for word in words:
        assert word in str(error)
    # ...and the server still serves.
    assert [b["index"].tolist() for b in feed.loader(files=["img0000.jpg"], batch_size=1,
                                                     size=(8, 8))] == [[0]]


def test_symlink_out_of_the_data_root_fails_that_sample(feed, data_dir, tmp_path):
    outside = tmp_path / "secret.jpg"
    outside.write_bytes((data_dir / "img0000.jpg").read_bytes())
    (data_dir / "link.jpg").symlink_to(outside)
    loader = feed.loader(files=["img0001.jpg", "link.jpg"], batch_size=2, size=(8, 8))
    assert [b["index"].tolist() for b in loader] == [[0]]
    (index, reason), = loader.failures
    assert index == 1 and "outside the data roots" in reason


def test_stream_must_open_with_a_request(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = feed_pb2_grpc.FeedStub(channel)
        release = feed_pb2.ClientMessage(release=feed_pb2.Release(seqs=[0]))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Stream(iter([release])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "open" in info.value.details()


def test_releasing_a_batch_never_sent_ends_the_stream(server, image_names):
    seq = 99
    with grpc.insecure_channel(server.address) as channel:
        stub = feed_pb2_grpc.FeedStub(channel)
        request = feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=image_names[:8]),
                                         batch_size=2,
                                         output=feed_pb2.OutputSpec(height=8, width=8),
                                         transport=feed_pb2.TRANSPORT_INLINE, prefetch=1)
        messages = [feed_pb2.ClientMessage(open=request),
                    feed_pb2.ClientMessage(release=feed_pb2.Release(seqs=[seq]))]
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Stream(iter(messages)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"release: batch {seq} is not one this stream sent" in info.value.details()


def test_missing_server_is_a_clear_error():
    with FeedClient("127.0.0.1:1", connect_timeout=1) as feed:
        with pytest.raises(FeedError) as info:
            feed.info()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "127.0.0.1:1" in str(info.value)



def test_numpy_arguments_are_accepted(feed):
    import numpy as np

    loader = feed.loader(files=["img0000.jpg", "img0001.jpg"], batch_size=2, size=(8, 8),
                         labels=np.array([3, 4]), dtype="float32",
                         mean=np.array([0.5, 0.5, 0.5]), std=np.array([0.25, 0.25, 0.25]))
    (batch,) = list(loader)
    assert batch["label"].tolist() == [3, 4]
