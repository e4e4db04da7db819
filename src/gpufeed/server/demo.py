"""``gpufeed-demo``: the main job in one command.

Makes a small built-in data set at first run (synthetic photo-like JPEGs, no
download), starts ``gpufeed-server`` on it, and runs a trainer-like client that
reads a few epochs and prints images/s as it goes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import av
import numpy as np

__all__ = ["encode_jpeg", "make_dataset", "synthetic_photo"]

_LIST_FILE = "demo.flist"


def synthetic_photo(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """An RGB uint8 [H, W, 3] image with a photo's mix of smooth areas, edges and grain."""
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    image = np.empty((height, width, 3), np.float32)
    for c in range(3):
        fy, fx, py, px = rng.uniform(0.5, 6, 2).tolist() + rng.uniform(0, 6.3, 2).tolist()
        wave = np.sin(2 * np.pi * fy * y + py) * np.cos(2 * np.pi * fx * x + px)
        image[..., c] = 0.5 + 0.25 * wave
    for _ in range(int(rng.integers(3, 8))):  # a few flat-coloured discs: sharp edges
        cy, cx, r = rng.uniform(0, 1, 3)
        inside = (y - cy) ** 2 + (x - cx) ** 2 < (0.05 + 0.2 * r) ** 2
        image[inside] = rng.uniform(0, 1, 3)
    image += rng.normal(0, 0.03, image.shape).astype(np.float32)
    return (np.clip(image, 0, 1) * 255).astype(np.uint8)


def encode_jpeg(rgb: np.ndarray, qscale: int = 3) -> bytes:
    """Baseline 4:2:0 JPEG bytes of ``rgb`` [H, W, 3] (qscale 2..31; 3 is about quality 90)."""
    height, width, _ = rgb.shape
    codec = av.CodecContext.create("mjpeg", "w")
    codec.width, codec.height, codec.pix_fmt = width, height, "yuvj420p"
    codec.qmin = codec.qmax = qscale
    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuvj420p")
    return b"".join(bytes(p) for p in [*codec.encode(frame), *codec.encode(None)])


def make_dataset(directory: Path, count: int, seed: int = 0, progress: bool = False) -> Path:
    """``count`` JPEGs of 320..640 x 240..480 in ``directory`` and a list file.

    Reused if present."""
    list_file = directory / _LIST_FILE
    if list_file.exists() and len(list_file.read_text().split()) == count:
        return list_file
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = []
    for i in range(count):
        height, width = int(rng.integers(240, 481)), int(rng.integers(320, 641))
        name = f"img{i:05d}.jpg"
        (directory / name).write_bytes(encode_jpeg(synthetic_photo(rng, height, width)))
        names.append(name)
        if progress and (i + 1) % 250 == 0:
            print(f"  {i + 1}/{count} images written", flush=True)
    list_file.write_text("\n".join(names) + "\n")
    return list_file


def _default_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "gpufeed" / "demo"


def main(argv: list[str] | None = None) -> int:
    from gpufeed.client import FeedClient

    from .process import ServerProcess

    p = argparse.ArgumentParser(prog="gpufeed-demo", description=__doc__)
    p.add_argument("--data-dir", type=Path, default=_default_dir())
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--transport", default="auto", choices=["auto", "inline", "shm"])
    args = p.parse_args(argv)

    print(f"data set: {args.images} JPEGs in {args.data_dir}", flush=True)
    started = time.perf_counter()
    list_file = make_dataset(args.data_dir, args.images, progress=True)
    print(f"  ready in {time.perf_counter() - started:.1f} s", flush=True)
    with ServerProcess(["--data-root", str(args.data_dir)]) as server, \
            FeedClient(server.address) as feed:
        print(f"server: {server.address}", flush=True)
        loader = feed.loader(files=list_file.name, batch_size=args.batch_size,
                             size=(args.size, args.size), shuffle=True, seed=0,
                             transport=args.transport)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            images, start, last_print = 0, time.perf_counter(), 0.0
            for batch in loader:
                images += batch["image"].shape[0]
                elapsed = time.perf_counter() - start
                if elapsed - last_print >= 1.0:
                    last_print = elapsed
                    print(f"  epoch {epoch}: {images:5d} images, {images / elapsed:7.1f} img/s",
                          flush=True)
            elapsed = time.perf_counter() - start
            print(f"epoch {epoch}: {images} images in {elapsed:.2f} s = "
                  f"{images / elapsed:.1f} img/s over {loader.transport}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
