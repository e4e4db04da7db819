"""The benchmark's array set: the same samples as ``.npy`` files and as ``.npz`` files.

Each sample is a float32 [3, 64, 64] array (an image-like tensor of
pre-computed features). The ``.npy`` set holds that array alone; each ``.npz``
holds it as ``img`` next to a uint8 [64, 64] ``lbl`` (a segmentation map), the
two-member layout of SPDL's data-format benchmark, saved uncompressed with
``np.savez`` as SPDL recommends. Built once into ``root`` and reused while its
manifest matches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["ArraySet", "build"]

_MANIFEST = "manifest.json"
_RECIPE = 1
SHAPE = (3, 64, 64)
LISTS = {"npy": "npy.flist", "npz": "npz.flist"}


@dataclass
class ArraySet:
    root: Path
    count: int
    npy_bytes: int
    npz_bytes: int

    def names(self, fmt: str) -> list[str]:
        return (self.root / LISTS[fmt]).read_text().split()

    def describe(self) -> dict:
        return {"root": str(self.root), "count": self.count, "npy": f"float32 {list(SHAPE)}",
                "npz": f"img float32 {list(SHAPE)} + lbl uint8 {list(SHAPE[1:])}, uncompressed",
                "npy_bytes": self.npy_bytes, "npz_bytes": self.npz_bytes}


def build(root: Path, count: int, *, seed: int = 0, log=print) -> ArraySet:
    root = Path(root)
    want = {"recipe": _RECIPE, "count": count, "seed": seed}
    manifest = root / _MANIFEST
    if manifest.exists():
        have = json.loads(manifest.read_text())
        if {k: have.get(k) for k in want} == want:
            return ArraySet(root, count, have["npy_bytes"], have["npz_bytes"])
    log(f"building {count} .npy and {count} .npz samples in {root} ...")
    rng = np.random.default_rng(seed)
    for fmt in LISTS:
        (root / fmt).mkdir(parents=True, exist_ok=True)
    names = {fmt: [] for fmt in LISTS}
    for i in range(count):
        img = rng.standard_normal(SHAPE, dtype=np.float32)
        lbl = rng.integers(0, 21, SHAPE[1:], dtype=np.uint8)
        np.save(root / "npy" / f"s{i:05d}.npy", img, allow_pickle=False)
        np.savez(root / "npz" / f"s{i:05d}.npz", img=img, lbl=lbl)
        names["npy"].append(f"npy/s{i:05d}.npy")
        names["npz"].append(f"npz/s{i:05d}.npz")
    for fmt, listed in names.items():
        (root / LISTS[fmt]).write_text("\n".join(listed) + "\n")
    meta = {**want, "npy_bytes": (root / names["npy"][0]).stat().st_size,
            "npz_bytes": (root / names["npz"][0]).stat().st_size}
    manifest.write_text(json.dumps(meta))
    return ArraySet(root, count, meta["npy_bytes"], meta["npz_bytes"])
