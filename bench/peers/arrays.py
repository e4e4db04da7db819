"""Loading pre-computed arrays (.npy, .npz): gpufeed against numpy.load in threads and DataLoader.

Every row reads the same files in the same order, in batches of
``batch_size``, and hands the trainer a dict of batched torch tensors keyed by
array name ("array" for .npy, the members "img" and "lbl" for .npz):

- gpufeed: a server on the array set's folder, this process the trainer,
  over shm (``feed.loader(files=<list file>, batch_size=...)``, no ``size``).
- numpy.load in a thread pool, as SPDL's data-format benchmark does
  (``allow_pickle=False``), ``threads`` workers kept a few batches ahead,
  then ``np.stack`` per key into the batch (the collate a trainer needs).
- torch DataLoader with worker processes: each worker np.loads a sample,
  the default collate stacks the dict of tensors in shared memory.

If the server refuses arrays (support not merged, or the client still
requires ``size``), the gpufeed row says "unavailable" with the reason.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np

from . import Unavailable

_KEYS = {"npy": ("array",), "npz": ("img", "lbl")}


def _paths(config, fmt: str) -> list[str]:
    from ..arrays import LISTS

    root = Path(config.arrays_root)
    return [str(root / name) for name in (root / LISTS[fmt]).read_text().split()]


def _load(path: str) -> dict[str, np.ndarray]:
    if path.endswith(".npy"):
        return {"array": np.load(path, allow_pickle=False)}
    with np.load(path, allow_pickle=False) as z:
        return {key: z[key] for key in z.files}


def run_gpufeed(config, meter, fmt: str) -> str:
    import grpc

    from gpufeed.client import FeedClient
    from gpufeed.client.errors import FeedError
    from gpufeed.server.process import ServerProcess

    from ..arrays import LISTS

    paths = _paths(config, fmt)
    meter.expected = len(paths) * config.array_passes
    first = _load(paths[0])
    args = ["--data-root", config.arrays_root, "--threads", str(config.threads)]
    with ServerProcess(args) as server, FeedClient(server.address) as feed:
        try:
            loader = feed.loader(files=LISTS[fmt], batch_size=config.batch_size, transport="shm")
        except TypeError as e:
            raise Unavailable(f"this client cannot ask for arrays yet ({e})") from None
        try:
            for epoch in range(config.array_passes):
                loader.set_epoch(epoch)
                for batch in loader:
                    if meter.images == 0:
                        _check(batch, first, fmt)
                    meter.batch(int(batch[_KEYS[fmt][0]].shape[0]))
        except (FeedError, grpc.RpcError) as e:
            code = e.code() if isinstance(e, grpc.RpcError) else e.code
            if meter.images == 0 and code in (grpc.StatusCode.INVALID_ARGUMENT,
                                              grpc.StatusCode.UNIMPLEMENTED):
                raise Unavailable(f"the server refused {fmt} arrays: {e}") from None
            raise
        meter.stop()
        if loader.transport != "shm":
            raise RuntimeError(f"asked for shm, the server chose {loader.transport}")
    return f"server: {config.threads} decode threads, shm; trainer in another process"


def _check(batch, first: dict[str, np.ndarray], fmt: str) -> None:
    """The first sample must arrive bit for bit, under the names the row expects."""
    for key in _KEYS[fmt]:
        if key not in batch:
            raise RuntimeError(f"batch has {sorted(batch)}, expected {key!r}")
        got = batch[key][0].numpy()
        if got.dtype != first[key].dtype or not np.array_equal(got, first[key]):
            raise RuntimeError(f"{key!r} of sample 0 differs from the file")


def run_numpy(config, meter, fmt: str) -> str:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    paths = _paths(config, fmt) * config.array_passes
    meter.expected = len(paths)
    size = config.batch_size
    batches = [paths[i:i + size] for i in range(0, len(paths), size)]
    ahead = 4  # batches in flight, like a prefetching loader
    with ThreadPoolExecutor(config.threads) as pool:
        pending: deque = deque()
        todo = iter(batches)
        for batch in todo:
            pending.append([pool.submit(_load, p) for p in batch])
            if len(pending) < ahead:
                continue
            _deliver(pending.popleft(), meter, torch)
        while pending:
            _deliver(pending.popleft(), meter, torch)
    meter.stop()
    return f"numpy.load in {config.threads} threads, {ahead} batches ahead, np.stack per key"


def _deliver(futures, meter, torch) -> None:
    samples = [f.result() for f in futures]
    batch = {key: torch.from_numpy(np.stack([s[key] for s in samples])) for key in samples[0]}
    meter.batch(len(samples))
    del batch


class _Arrays:
    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        import torch

        return {key: torch.from_numpy(a) for key, a in _load(self.paths[i]).items()}


def run_torch(config, meter, fmt: str, workers: int) -> str:
    from torch.utils.data import DataLoader

    paths = _paths(config, fmt)
    meter.expected = len(paths) * config.array_passes
    loader = DataLoader(_Arrays(paths), batch_size=config.batch_size, num_workers=workers,
                        persistent_workers=True)
    key = _KEYS[fmt][0]
    for _ in range(config.array_passes):
        for batch in loader:
            meter.batch(int(batch[key].shape[0]))
    meter.stop()
    return f"{workers} worker processes, np.load, default collate"
