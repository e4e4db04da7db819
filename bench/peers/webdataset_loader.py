"""WebDataset + PyTorch's DataLoader (2 workers) on the shards gpufeed's shard rows read.

The pipeline as WebDataset's own examples write it: ``WebDataset(urls)`` (each
DataLoader worker takes every other shard, WebDataset's default split; with
fewer shards than workers, as the bench's one ~100 MB shard, that would leave a
worker idle, so then every worker reads every shard and keeps every other
sample: the reads double, the decoding is shared), each
sample's ``.jpg`` made into an image of the job by the torch DataLoader row's
Pillow steps (``torch_loader.pillow_image``) and its ``.cls`` into a label,
``batched`` in the workers, ``WebLoader(batch_size=None)`` on top, workers
persisting across passes.

Local shards are plain paths. From S3 (the SeaweedFS the gpufeed S3 rows
use), each shard is one streamed GET through boto3, registered as WebDataset's
opener for ``s3://`` URLs; WebDataset's own examples pipe ``aws s3 cp`` or
``curl`` instead, which would add a process per shard and not change the reads.
"""

from __future__ import annotations

import importlib
import io
import itertools

from .. import jobs
from . import Unavailable
from .shards import BUCKET, pack, seaweed_shards

__all__ = ["run"]

_WORKERS = 2


def _wds():
    try:
        import webdataset
    except ImportError:
        raise Unavailable("webdataset is not installed (pip install webdataset)") from None
    return webdataset


def run(config, meter, job: str, where: str) -> str:
    """``where``: "local" (the shards' files) or "s3" (SeaweedFS on loopback)."""
    wds = _wds()
    if where == "local":
        folder, shards = pack(config)
        _read(wds, [str(folder / name) for name in shards], config, meter, job)
        return (f"{len(shards)} shards on the local disk; DataLoader, {_WORKERS} workers"
                f"{_split(shards)}")
    with seaweed_shards(config) as (s3, shards):
        # webdataset.gopen the module (the package exports a function of that name)
        importlib.import_module("webdataset.gopen").gopen_schemes["s3"] = _s3_opener(s3)
        _read(wds, [f"s3://{BUCKET}/shards/{name}" for name in shards], config, meter, job)
    return (f"{len(shards)} shards in SeaweedFS on loopback, one streamed GET each (boto3); "
            f"DataLoader, {_WORKERS} workers{_split(shards)}")


def _split(shards: list[str]) -> str:
    return "" if len(shards) >= _WORKERS else ", each reading every shard, keeping its share"


def _read(wds, urls: list[str], config, meter, job: str) -> None:
    from .torch_loader import pillow_image  # torch: only once webdataset is known to be here

    size = tuple(config.size)
    if len(urls) >= _WORKERS:  # WebDataset's default: each worker its own shards
        dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    else:  # too few shards for that: every worker reads them all and keeps its share
        dataset = (wds.WebDataset(urls, shardshuffle=False, empty_check=False,
                                  workersplitter=None)
                   .compose(_worker_share))
    dataset = (dataset
               .map(lambda sample: (pillow_image(io.BytesIO(sample["jpg"]), size, job),
                                    int(sample["cls"])))
               .batched(config.batch_size))
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=_WORKERS,
                           persistent_workers=True)
    for _ in range(config.passes):
        for images, _labels in loader:
            if meter.images == 0:
                jobs.check_batch(images.shape, images.dtype, size, job)
            meter.batch(int(images.shape[0]))
    meter.stop()


def _worker_share(samples):
    """Every other sample (one of every num_workers), from this worker's place."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    share, workers = (info.id, info.num_workers) if info else (0, 1)
    yield from itertools.islice(samples, share, None, workers)


def _s3_opener(s3):
    """WebDataset's opener for s3:// URLs: the object's body, streamed (in each worker)."""
    def gopen_s3(url: str, mode: str = "rb", bufsize: int = 8192, **kw):
        bucket, key = url.removeprefix("s3://").split("/", 1)
        return s3.client().get_object(Bucket=bucket, Key=key)["Body"]
    return gopen_s3
