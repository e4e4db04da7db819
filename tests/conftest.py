"""Shared fixtures: a JPEG data set and a real server subprocess serving it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from forked_servers import ForkServer
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess

NUM_IMAGES = 300


@pytest.fixture(scope="session", autouse=True)
def _servers_forked_from_one_that_imported_torch():
    """Servers start as forks of a process that has imported torch (tests/forked_servers.py
    says why, and what differs); ``GPUFEED_TEST_FORK_SERVERS=0`` starts them plainly."""
    if os.environ.get("GPUFEED_TEST_FORK_SERVERS") == "0":
        yield
        return
    plain = ServerProcess.spawn
    forks = ForkServer(plain)
    ServerProcess.spawn = staticmethod(forks.spawn)  # type: ignore[method-assign]
    try:
        yield
    finally:
        ServerProcess.spawn = staticmethod(plain)  # type: ignore[method-assign]
        forks.close()


@pytest.fixture(scope="module", autouse=True)
def _environment_kept_to_its_module():
    """What a module does to ``os.environ`` ends with it. Lightning sets ``TORCH*``
    variables as it fits; left set, they reached every later server of that test
    process, and a server whose start-up environment differs from the fork server's
    starts plainly (~4 CPU-s each, tests/forked_servers.py)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


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


def _start_two(data_dir: Path) -> list[ServerProcess]:
    """Two servers of data_dir, one decode thread each (tests of several servers)."""
    return [ServerProcess(["--data-root", str(data_dir), "--threads", "1"]).start()
            for _ in range(2)]


@pytest.fixture()
def two_servers(data_dir):
    """A test's own two servers: it may kill them."""
    servers = _start_two(data_dir)
    yield servers
    for server in servers:
        server.kill()


@pytest.fixture(scope="module")
def server_pair(data_dir):
    """Two servers shared by a module's tests that kill neither."""
    servers = _start_two(data_dir)
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture()
def feed(server):
    from gpufeed.client import FeedClient

    with FeedClient(server.address) as client:
        yield client


def pytest_collection_modifyitems(config, items):
    """Modules with a ``slow`` test first, so that no worker of ``.ci/test`` is left
    running one alone at the end (run with ``--no-loadscope-reorder``, which keeps this
    order). Tests marked ``cuda`` run only where torch sees a CUDA device."""
    slow = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow)  # stable: each module's order kept

    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
