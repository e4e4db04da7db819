"""The cuda_ipc transport.

End-to-end tests need a GPU (marked ``cuda``). Everything around the few CUDA
calls runs here on the CPU: refusals, what the server copies to the device,
and the client's per-batch views of a shared buffer and their release.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from gpufeed.client import FeedClient
from gpufeed.client.batches import SharedSlots, slot_tensors
from gpufeed.server.config import Limits
from gpufeed.server.memory.cuda_ipc import _host_written_spans
from gpufeed.server.process import ServerProcess
from gpufeed.server.serving.planning.plan import StreamPlan, plan_stream
from gpufeed.server.storage.roots import Storage
from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from support import MIN_PSNR_DB, psnr, reference_decode


def _refusal(data_dir, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``gpufeed-server --device cuda:0`` with the allocator settings of ``env`` alone."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    return subprocess.run([sys.executable, "-m", "gpufeed.server", "--data-root", str(data_dir),
                           "--device", "cuda:0", "--listen", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=60, env={**clean, **env})


def test_cpu_server_refuses_a_missing_gpu_clearly(data_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = _refusal(data_dir, {})
    assert result.returncode == 2
    assert "--device cuda:0: CUDA is not available" in result.stderr


@pytest.mark.parametrize("variable, setting", [
    ("PYTORCH_ALLOC_CONF", "expandable_segments:True"),
    ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, backend:cudaMallocAsync"),
])
def test_allocators_whose_memory_cannot_be_shared_are_refused(data_dir, variable, setting):
    result = _refusal(data_dir, {variable: setting})
    assert result.returncode == 2
    exported = setting.split(", ")[-1]
    assert f"{variable} sets {exported}, whose memory cannot be shared over CUDA IPC" in \
        result.stderr


def _plan(data_dir, **output) -> StreamPlan:
    request = feed_pb2.StreamRequest(
        files=feed_pb2.FileList(paths=["a.jpg"]), batch_size=4, labels=[3],
        output=feed_pb2.OutputSpec(height=8, width=8, **output))
    return plan_stream(request, Storage([str(data_dir)]), Limits(),
                       (feed_pb2.TRANSPORT_INLINE,))


def test_the_device_copy_skips_the_region_the_gpu_writes(data_dir):
    """A float batch is made on the GPU from the uint8 pixels: only those, index, label
    and flip cross to the device, not the (4x larger) float region."""
    plan = _plan(data_dir, dtype="float32", mean=[0.5] * 3, std=[0.2] * 3)
    places = {p.name: p for p in plan.layout.places}
    copied = bytearray(plan.layout.slot_bytes)
    for begin, end in _host_written_spans(plan.layout):
        copied[begin:end] = b"\1" * (end - begin)
    for name, place in places.items():
        size = plan.layout.batch_size * place.dtype.itemsize * int(np.prod(place.sample_shape))
        region = copied[place.offset:place.offset + size]
        assert all(region) == (name != "image") and any(region) == (name != "image"), name
    uint8 = _plan(data_dir)
    assert _host_written_spans(uint8.layout) == [(0, uint8.layout.slot_bytes)]


def _batch(seq: int, num_slots: int) -> feed_pb2.Batch:
    tensors = [feed_pb2.TensorMeta(name="image", dtype="uint8", shape=[2, 3], offset=0),
               feed_pb2.TensorMeta(name="half", dtype="bfloat16", shape=[2], offset=64),
               feed_pb2.TensorMeta(name="index", dtype="int64", shape=[2], offset=128)]
    return feed_pb2.Batch(seq=seq, slot=seq % num_slots, tensors=tensors)


def test_batch_views_of_a_shared_buffer_are_released_once_dropped():
    """The client's cuda_ipc bookkeeping (SharedSlots) over a CPU storage standing in for
    the opened device buffer: tensors alias their slot, and a slot goes back only when no
    tensor (or view of one) refers to it."""
    slot_bytes, num_slots = 4096, 3
    ring = torch.zeros(slot_bytes * num_slots, dtype=torch.uint8).untyped_storage()
    slots = SharedSlots(ring, num_slots, slot_bytes, copy=False)
    released: list[int] = []

    def fetch(seq: int) -> dict[str, torch.Tensor]:
        slots.make_room()
        return slots.tensors(_batch(seq, num_slots), lambda: released.append(seq))

    first = fetch(0)
    first["index"].copy_(torch.tensor([7, 9]))
    first["half"].copy_(torch.tensor([1.5, -2.0]))
    again = slot_tensors(ring[:slot_bytes], _batch(0, num_slots).tensors)  # the same bytes
    assert again["index"].tolist() == [7, 9] and again["half"].tolist() == [1.5, -2.0]
    del again
    row, index = first["image"][1], first["index"]  # a view of a tensor; a tensor
    del first
    second = fetch(1)
    assert released == []
    del row, second
    third = fetch(2)
    assert released == [1]  # batch 0 is still held, by `index` alone
    del index
    copied = third["image"].clone()  # a copy does not hold its batch
    del third
    fetch(3)
    assert released == [1, 0, 2]
    del copied


def test_a_trainer_holding_all_slots_but_one_gets_copies():
    """Batches kept beyond the ring are copied on arrival and their slot goes back at
    once; those kept earlier stay views, and nothing the trainer holds ever changes."""
    slot_bytes, num_slots = 4096, 3
    ring = torch.zeros(slot_bytes * num_slots, dtype=torch.uint8).untyped_storage()
    slots = SharedSlots(ring, num_slots, slot_bytes, copy=False)
    released: list[int] = []
    kept = []
    for seq in range(6):
        slots.make_room()
        batch = _batch(seq, num_slots)
        batch.slot = min(seq, 2)  # batches 0 and 1 stay held: the server has slot 2 left
        start = batch.slot * slot_bytes
        slot_tensors(ring[start:start + slot_bytes], batch.tensors)["index"].fill_(seq)
        kept.append(slots.tensors(batch, lambda s=seq: released.append(s)))
        assert released == list(range(2, seq + 1))  # from batch 2 on: copies, given back
    ring[2 * slot_bytes:] = 0  # the server reuses the slot it has back
    assert [b["index"].tolist() for b in kept] == [[seq, seq] for seq in range(6)]
    assert kept[0]["index"].untyped_storage().data_ptr() == ring.data_ptr()  # still a view
    del kept[:2]
    slots.make_room()
    assert released == [2, 3, 4, 5, 0, 1]


def test_copied_batches_from_a_shared_buffer_go_back_at_once():
    ring = torch.arange(8192, dtype=torch.int64).to(torch.uint8).untyped_storage()
    slots = SharedSlots(ring, 2, 4096, copy=True)
    released: list[int] = []
    batch = slots.tensors(_batch(1, 2), lambda: released.append(1))
    assert released == [1]
    assert batch["image"].flatten().tolist() == [0, 1, 2, 3, 4, 5]  # slot 1 starts at 4096
    ring[4096] = 99
    assert batch["image"][0, 0] == 0  # a copy, not a view


@pytest.fixture(scope="module")
def gpu_server(data_dir):
    with ServerProcess(["--data-root", str(data_dir), "--device", "cuda:0"]) as server:
        yield server


@pytest.mark.cuda
def test_every_sample_once_with_pixels_of_the_cpu_path(gpu_server, data_dir, image_names):
    with FeedClient(gpu_server.address) as feed:
        loader = feed.loader(files=image_names[:100], batch_size=16, size=(64, 64),
                             labels=list(range(100)))
        gpu = [{k: v.cpu() for k, v in b.items()} for b in loader]
        assert loader.transport == "cuda_ipc"
        cpu = [{k: v.clone() for k, v in b.items()} for b in
               feed.loader(files=image_names[:100], batch_size=16, size=(64, 64),
                           labels=list(range(100)), transport="inline")]
    assert sorted(i for b in gpu for i in b["index"].tolist()) == list(range(100))
    for g, c in zip(gpu, cpu):
        assert torch.equal(g["image"], c["image"]) and torch.equal(g["label"], c["index"])


@pytest.mark.cuda
def test_slots_are_reused_only_after_release(gpu_server, data_dir, image_names):
    with FeedClient(gpu_server.address) as feed:
        loader = feed.loader(files=image_names[:64], batch_size=8, size=(48, 48),
                             transport="cuda_ipc", prefetch=4)
        held = []
        for k, batch in enumerate(loader):
            if k < 3:
                held.append(batch)  # later batches must cycle through the other slots
            else:
                batch["image"].float().mul_(2).sum()  # queue kernels that read the slot
        for batch in held:
            assert batch["image"].is_cuda
            for row, i in enumerate(batch["index"].tolist()):
                ref = reference_decode(data_dir / image_names[i], 48, 48)
                assert psnr(batch["image"][row].cpu().numpy(), ref) >= MIN_PSNR_DB


@pytest.mark.cuda
def test_the_batch_pass_on_the_gpu_equals_the_cpu_path(gpu_server, image_names):
    """Flip, normalise, float16 and NHWC made on the GPU, from the uint8 pixels copied
    alone to the device, equal what the CPU makes of the same request."""
    options = dict(files=image_names[:48], batch_size=16, size=(32, 40), flip=0.5, seed=3,
                   dtype="float16", mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                   layout="NHWC")
    with FeedClient(gpu_server.address) as feed:
        gpu = [b["image"].cpu() for b in feed.loader(transport="cuda_ipc", **options)]
        cpu = [b["image"].clone() for b in feed.loader(transport="inline", **options)]
    assert len(gpu) == len(cpu) == 3
    for g, c in zip(gpu, cpu):
        assert g.shape == (16, 32, 40, 3) and g.dtype == torch.float16
        torch.testing.assert_close(g, c, rtol=0, atol=1e-2)  # float16 rounding of one op order


@pytest.mark.cuda
def test_rings_no_trainer_opened_are_freed(data_dir, image_names):
    """Trainers that read the header and leave without opening their ring (a failed open
    does the same) must not leave it allocated: more such streams, one at a time, than
    the GPU could hold at once are all served. A leak shows as RESOURCE_EXHAUSTED."""
    batch = 6000  # 0.9 GB of 224 x 224 pixels a slot, 2 slots a ring
    rings = int(torch.cuda.mem_get_info()[1] // (2 * batch * 3 * 224 * 224)) + 2
    request = feed_pb2.StreamRequest(
        files=feed_pb2.FileList(paths=(image_names * 20)[:batch]), batch_size=batch, prefetch=1,
        output=feed_pb2.OutputSpec(height=224, width=224), transport=feed_pb2.TRANSPORT_CUDA_IPC)
    with ServerProcess(["--data-root", str(data_dir), "--device", "cuda:0",
                        "--max-streams", "1"]) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = feed_pb2_grpc.FeedStub(channel)
        for _ in range(rings):
            while True:  # one stream at a time: the last one may still be closing
                call = stub.Stream(iter([feed_pb2.ClientMessage(open=request)]))
                try:
                    assert next(call).WhichOneof("kind") == "header"
                    break
                except grpc.RpcError as e:
                    assert "--max-streams" in e.details(), e.details()
                    time.sleep(0.05)
            call.cancel()


@pytest.mark.cuda
def test_kept_cuda_batches_equal_copies(gpu_server, image_names):
    """list(loader) and a label-collecting loop over cuda_ipc give what copy=True gives:
    batches kept beyond the ring are cloned on the device, never reused under the trainer."""
    options = dict(files=image_names[:120], labels=[(i * 7) % 10 for i in range(120)],
                   batch_size=8, size=(16, 16), shuffle=True, seed=2, transport="cuda_ipc",
                   prefetch=2)
    with FeedClient(gpu_server.address) as feed:
        expected = [{k: v.cpu() for k, v in b.items()} for b in feed.loader(copy=True, **options)]
        kept = list(feed.loader(**options))
        labels = torch.cat([b["label"] for b in feed.loader(**options)]).cpu()
        got = [{k: v.cpu() for k, v in b.items()} for b in kept]
    assert len(got) == len(expected) == 15
    for g, e in zip(got, expected):
        assert all(torch.equal(g[name], e[name]) for name in e)
    assert torch.equal(labels, torch.cat([b["label"] for b in expected]))


@pytest.mark.cuda
def test_a_trainer_waiting_for_its_kernels_does_not_spin_a_core(gpu_server, image_names):
    """A slot goes back once the kernels that read its batch have run; the client's
    thread that waits for them sleeps meanwhile. Each batch here is read by about 50 ms
    of GPU work, as by a training step, so the loop runs at the GPU's pace: a spinning
    wait would cost that thread about as much CPU time as the loop takes."""
    watched = []  # (wall clock, the waiting thread's CPU clock), at each batch
    with FeedClient(gpu_server.address) as feed:
        loader = feed.loader(files=image_names[:96], batch_size=8, size=(32, 32),
                             transport="cuda_ipc", prefetch=2)
        for batch in loader:
            batch["image"].float().sum()  # reads the slot, and a step's worth of kernels
            torch.cuda._sleep(100_000_000)  # after it (1e8 GPU cycles)
            if not watched:  # the thread starts as the stream opens; it ends with it
                thread = next(t for t in threading.enumerate()
                              if t.name == "gpufeed-cuda-release")
                clock = time.pthread_getcpuclockid(thread.ident)
            watched.append((time.perf_counter(), time.clock_gettime(clock)))
    (wall0, cpu0), (wall1, cpu1) = watched[1], watched[-1]
    assert wall1 - wall0 > 0.2, f"{wall1 - wall0:.3f} s: too short to tell"
    assert cpu1 - cpu0 < 0.2 * (wall1 - wall0), (cpu1 - cpu0, wall1 - wall0)
