"""Tar shards in WebDataset's layout, written for the tests: JPEG + .cls per sample."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np

from gpufeed.server.demo import encode_jpeg, synthetic_photo


def label_of(index: int) -> int:
    """The label the tests store for the sample at ``index`` (its position over all shards)."""
    return 1000 + 7 * index


def shard_bytes(first: int, count: int, seed: int = 0) -> tuple[bytes, list[bytes]]:
    """A tar of samples first..first+count-1 (``{i:06d}.jpg`` + ``.cls``), and their JPEGs."""
    rng = np.random.default_rng(seed + first)
    out, jpegs = io.BytesIO(), []
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for index in range(first, first + count):
            jpeg = encode_jpeg(synthetic_photo(rng, int(rng.integers(40, 90)),
                                               int(rng.integers(40, 90))))
            jpegs.append(jpeg)
            for name, data in ((f"{index:06d}.jpg", jpeg),
                               (f"{index:06d}.cls", str(label_of(index)).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue(), jpegs


def write_shards(folder: Path, counts: list[int], name: str = "train-{:04d}.tar"
                 ) -> tuple[list[str], list[bytes]]:
    """Shards of ``counts[s]`` samples each under ``folder``; their names and every JPEG."""
    folder.mkdir(parents=True, exist_ok=True)
    names, jpegs, first = [], [], 0
    for s, count in enumerate(counts):
        data, shard_jpegs = shard_bytes(first, count)
        (folder / name.format(s)).write_bytes(data)
        names.append(name.format(s))
        jpegs += shard_jpegs
        first += count
    return names, jpegs


def cut_shard() -> bytes:
    """Samples 100..103, cut 100 bytes into sample 102's image (103 is gone)."""
    data, _ = shard_bytes(100, 4)
    header = data.index(b"000102.jpg")  # a member's name opens its 512-byte header
    return data[:header + 512 + 100]


def corrupt_shard() -> bytes:
    """Samples 200..202, sample 201's image overwritten with zeros after 20 bytes."""
    data, _ = shard_bytes(200, 3)
    start = data.index(b"000201.jpg") + 512
    return data[:start + 20] + b"\0" * 200 + data[start + 220:]
