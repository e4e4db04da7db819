"""The cuda_ipc transport. End-to-end tests need a GPU; refusals are checked everywhere."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gpufeed.client import FeedClient
from gpufeed.server.process import ServerProcess
from support import MIN_PSNR_DB, psnr, reference_decode


def test_cpu_server_refuses_a_missing_gpu_clearly(data_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = subprocess.run([sys.executable, "-m", "gpufeed.server", "--data-root", str(data_dir),
                             "--device", "cuda:0", "--listen", "127.0.0.1:0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--device cuda:0: CUDA is not available" in result.stderr


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
