"""Inline batches as a remote trainer gets them: the same tensors as shm, a wire any
protobuf client parses, and optional lossless compression of array samples."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

from gpufeed.client import FeedClient
from gpufeed.client.errors import FeedError
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2, feed_pb2_grpc


def _batches(loader) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def test_inline_tensors_equal_shm_tensors(feed, image_names):
    options = dict(files=image_names[:40], batch_size=16, size=(32, 48), shuffle=True, seed=3,
                   labels=list(range(40)))
    inline = _batches(feed.loader(transport="inline", **options))
    shm = _batches(feed.loader(transport="shm", **options))
    assert len(inline) == len(shm) == 3  # the last one short
    for a, b in zip(inline, shm):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key])


def test_inline_copy_gives_owned_writable_tensors(feed, image_names):
    batch = next(iter(feed.loader(files=image_names[:4], batch_size=4, size=(8, 8),
                                  transport="inline", copy=True)))
    image = batch["image"]
    reference = image.clone()
    image.zero_()  # in place: the trainer's own memory
    assert not torch.equal(image, reference)


def test_an_inline_batch_is_a_valid_server_message_for_any_client(server, feed, image_names):
    """Stock protobuf (the generated stub's deserializer) reads what gpufeed's client reads."""
    files = image_names[:10]
    ours = _batches(feed.loader(files=files, batch_size=4, size=(16, 16), transport="inline"))
    request = feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=files), batch_size=4,
                                     output=feed_pb2.OutputSpec(height=16, width=16),
                                     transport=feed_pb2.TRANSPORT_INLINE)
    with grpc.insecure_channel(server.address,
                               options=[("grpc.max_receive_message_length", -1)]) as channel:
        call = feed_pb2_grpc.FeedStub(channel).Stream(
            iter([feed_pb2.ClientMessage(open=request)]))
        messages = list(call)
    assert messages[0].WhichOneof("kind") == "header"
    batches = [m.batch for m in messages[1:]]
    assert [b.seq for b in batches] == [0, 1, 2]
    for theirs, mine in zip(batches, ours):
        for meta in theirs.tensors:
            array = np.frombuffer(theirs.data, np.dtype(meta.dtype), count=int(np.prod(meta.shape)),
                                  offset=meta.offset).reshape(tuple(meta.shape))
            assert torch.equal(torch.from_numpy(array.copy()), mine[meta.name])


@pytest.fixture(scope="module")
def array_server(tmp_path_factory):
    """Array samples as a trainer might ship them: float features and a label mask."""
    root = tmp_path_factory.mktemp("arrays")
    rng = np.random.default_rng(5)
    names = []
    for i in range(20):
        np.savez(root / f"s{i:02d}.npz",
                 img=rng.standard_normal((3, 16, 16), dtype=np.float32),
                 lbl=rng.integers(0, 21, (16, 16), dtype=np.uint8))
        names.append(f"s{i:02d}.npz")
    with ServerProcess(["--data-root", str(root), "--threads", "2"]) as proc:
        yield proc, root, names


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_compressed_arrays_arrive_bit_for_bit(array_server, compression):
    server, root, names = array_server
    with FeedClient(server.address) as feed:
        loader = feed.loader(files=names, batch_size=8, transport="inline",
                             compression=compression)
        batches = _batches(loader)
    assert [len(b["index"]) for b in batches] == [8, 8, 4]
    for batch in batches:
        for row, index in enumerate(batch["index"].tolist()):
            with np.load(root / names[index]) as want:
                for key in ("img", "lbl"):
                    got = batch[key][row].numpy()
                    assert got.dtype == want[key].dtype
                    assert got.tobytes() == want[key].tobytes()


def test_an_unknown_compression_is_refused_naming_the_field(array_server):
    server, _, names = array_server
    with FeedClient(server.address) as feed:
        with pytest.raises(FeedError) as error:
            next(iter(feed.loader(files=names, batch_size=8, transport="inline",
                                  compression="gzip")))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "compression" in str(error.value) and "gzip" in str(error.value)


def test_held_inline_batches_keep_their_pixels_while_later_ones_reuse_the_heap(feed, image_names):
    """The client keeps freed batch buffers for reuse (src/gpufeed/client/malloc.py): a
    batch the trainer still holds is never one of them, so it keeps its pixels while
    later batches arrive.
    Batches of 1.2 MB, above glibc's default mmap threshold, so they take that path."""
    options = dict(files=image_names[:40], batch_size=8, size=(224, 224))
    held = list(feed.loader(transport="inline", **options))  # every batch's views, kept
    shm = _batches(feed.loader(transport="shm", **options))
    assert len(held) == len(shm) == 5
    for a, b in zip(held, shm):
        assert torch.equal(a["image"], b["image"])


# In a fresh interpreter: optionally the client's malloc settings, then a 20 MB block;
# prints whether malloc placed it in its own mmap (glibc's mallinfo2: bytes so mapped).
_WHERE_A_20_MB_BLOCK_GOES = """
import ctypes, sys
from gpufeed.client.malloc import keep_large_buffers
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
keep_large_buffers()
block = bytearray(20 << 20)
print("mmap" if libc.mallinfo2().hblkhd >= 20 << 20 else "heap")
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
@pytest.mark.parametrize("environment, where", [
    ({}, "heap"),
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "mmap"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}, "mmap"),
])
def test_multi_mb_blocks_come_from_the_heap_unless_the_trainer_chose_its_own(environment, where):
    """After the client's settings a 20 MB block (a few batches' size) is heap memory that
    the next batch can reuse; a trainer started with its own malloc settings keeps them."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", _WHERE_A_20_MB_BLOCK_GOES],
                         env={**env, **environment}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == where
