"""Shared fixtures: a JPEG data set and a real server subprocess serving it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess

NUM_IMAGES = 300


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """NUM_IMAGES JPEGs of varied sizes (some under 224 px, so some are upscaled)."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(1234)
    names = []
    for i in range(NUM_IMAGES):
        height, width = int(rng.integers(120, 400)), int(rng.integers(160, 480))
        name = f"img{i:04d}.jpg"
        (root / name).write_bytes(encode_jpeg(synthetic_photo(rng, height, width)))
        names.append(name)
    (root / "all.flist").write_text("\n".join(names) + "\n")
    return root


@pytest.fixture(scope="session")
def image_names(data_dir) -> list[str]:
    return (data_dir / "all.flist").read_text().split()


@pytest.fixture(scope="session")
def server(data_dir):
    """One gpufeed-server for the session, serving data_dir."""
    with ServerProcess(["--data-root", str(data_dir), "--threads", "2"]) as proc:
        yield proc


@pytest.fixture()
def two_servers(data_dir):
    """Two servers of data_dir, one decode thread each (tests of several servers)."""
    servers = [ServerProcess(["--data-root", str(data_dir), "--threads", "1"]).start()
               for _ in range(2)]
    yield servers
    for server in servers:
        server.kill()


@pytest.fixture()
def feed(server):
    from gpufeed.client import FeedClient

    with FeedClient(server.address) as client:
        yield client


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run only where torch sees a CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
