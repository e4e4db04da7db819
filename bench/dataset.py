"""The benchmark's JPEG set: built once, reused by every later run.

Images are cut from the real photographs scikit-image ships inside its wheel
(no download at run time): a random crop of one photo, resized to about
457x395, flipped and colour-jittered, with a little sensor grain, saved as a
baseline 4:2:0 JPEG at quality 88, so sizes land near 100 KB like ImageNet's.
Without scikit-image the photo-like synthetic images of ``gpufeed-demo`` stand
in, and the manifest says so.

A manifest next to the files records how they were made; a set is reused only
when the manifest matches the request, so a changed recipe never mixes sets.
"""

from __future__ import annotations

import importlib.util
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

__all__ = ["DataSet", "build"]

_MANIFEST = "manifest.json"
_LIST_FILE = "bench.flist"
_RECIPE = 2  # bump when the way images are made changes
# scikit-image's bundled colour photographs (public domain or CC0, see its data/README).
_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "hubble_deep_field.jpg", "ihc.png",
           "motorcycle_left.png", "motorcycle_right.png", "retina.jpg", "rocket.jpg")
# Grey textures (grass, gravel) blended in: real photos carry more fine detail than
# these upscaled crops, and detail is what makes a JPEG ~100 KB and slow to decode.
_TEXTURES = ("grass.png", "gravel.png")
_QUALITY = 88
# Width and height ranges; their means are 457x395.
_WIDTHS, _HEIGHTS = (420, 495), (365, 426)


@dataclass
class DataSet:
    """A built set: ``root`` holds the files, ``list_file`` their names, one per line."""

    root: Path
    names: list[str]
    source: str  # "scikit-image photos" or "synthetic"
    mean_bytes: float
    mean_width: float
    mean_height: float
    quality: int = _QUALITY

    @property
    def list_file(self) -> Path:
        return self.root / _LIST_FILE

    @property
    def paths(self) -> list[str]:
        return [str(self.root / name) for name in self.names]

    def describe(self) -> dict:
        d = asdict(self)
        d["root"], d["count"] = str(self.root), len(self.names)
        del d["names"]
        return d


def build(root: Path, count: int, *, seed: int = 0, log=print) -> DataSet:
    """``count`` JPEGs in ``root``; reuses what an earlier call with the same arguments made.

    Without scikit-image the set is synthetic and goes to ``root`` + ``-synthetic``:
    two virtualenvs sharing bench/data (a before/after comparison) then never
    rebuild each other's set, nor compare rows measured on different files (the
    synthetic files are half the size and decode faster).
    """
    root = Path(root)
    photos, textures = _load_photos()
    source = "scikit-image photos" if photos else "synthetic"
    if not photos:
        root = root.with_name(root.name + "-synthetic")
        log("scikit-image is not installed: a synthetic set, whose figures do not compare "
            "with the photo set's (pip install scikit-image)")
    want = {"recipe": _RECIPE, "count": count, "seed": seed, "source": source}
    manifest = root / _MANIFEST
    if manifest.exists():
        have = json.loads(manifest.read_text())
        if {k: have.get(k) for k in want} == want and (root / _LIST_FILE).exists():
            return _dataset(root, have)
    log(f"building {count} JPEGs from {source} in {root} ...")
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names, sizes, dims = [], [], []
    for i in range(count):
        rgb = _photo_crop(rng, photos, textures) if photos else _synthetic(rng)
        data = _encode(rgb)
        name = f"img{i:05d}.jpg"
        (root / name).write_bytes(data)
        names.append(name)
        sizes.append(len(data))
        dims.append(rgb.shape[:2])
        if (i + 1) % 500 == 0:
            log(f"  {i + 1}/{count}")
    (root / _LIST_FILE).write_text("\n".join(names) + "\n")
    heights, widths = zip(*dims)
    meta = {**want, "names": names, "mean_bytes": float(np.mean(sizes)),
            "mean_width": float(np.mean(widths)), "mean_height": float(np.mean(heights))}
    manifest.write_text(json.dumps(meta))
    return _dataset(root, meta)


def _dataset(root: Path, meta: dict) -> DataSet:
    return DataSet(root=root, names=meta["names"], source=meta["source"],
                   mean_bytes=meta["mean_bytes"], mean_width=meta["mean_width"],
                   mean_height=meta["mean_height"])


def _load_photos() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The bundled photos (RGB) and textures (grey), found without importing scikit-image."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        return [], []
    from PIL import Image

    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    photos = []
    for name in _PHOTOS:
        if (data / name).exists():
            with Image.open(data / name) as im:
                photos.append(np.asarray(im.convert("RGB")))
    textures = []
    for name in _TEXTURES:
        if (data / name).exists():
            with Image.open(data / name) as im:
                grey = np.asarray(im.convert("L"), dtype=np.float32)
                textures.append(grey - grey.mean())
    return (photos, textures) if photos and textures else ([], [])


def _photo_crop(rng: np.random.Generator, photos: list[np.ndarray],
                textures: list[np.ndarray]) -> np.ndarray:
    """A random crop of a random photo at a random ~457x395 size, flipped and jittered."""
    from PIL import Image

    photo = photos[int(rng.integers(len(photos)))]
    width, height = int(rng.integers(*_WIDTHS)), int(rng.integers(*_HEIGHTS))
    ph, pw, _ = photo.shape
    # The largest crop of the target's aspect ratio, then 75..100% of it.
    scale = min(pw / width, ph / height) * rng.uniform(0.75, 1.0)
    cw, ch = max(16, int(width * scale)), max(16, int(height * scale))
    x, y = int(rng.integers(0, pw - cw + 1)), int(rng.integers(0, ph - ch + 1))
    crop = Image.fromarray(photo[y:y + ch, x:x + cw]).resize((width, height), Image.LANCZOS)
    rgb = np.asarray(crop, dtype=np.float32)
    if rng.random() < 0.5:
        rgb = rgb[:, ::-1]
    rgb = rgb * rng.uniform(0.85, 1.15, 3) + rng.uniform(-12, 12)
    rgb += _texture(rng, textures, height, width)
    rgb += rng.normal(0, rng.uniform(5, 9), rgb.shape)  # sensor grain: real photos are not clean
    return np.clip(rgb, 0, 255).astype(np.uint8)


def _texture(rng: np.random.Generator, textures: list[np.ndarray], height: int,
             width: int) -> np.ndarray:
    """Fine detail: one grey texture on all channels plus shifted copies per channel (chroma)."""
    texture = textures[int(rng.integers(len(textures)))]
    y = int(rng.integers(0, texture.shape[0] - height + 1))
    x = int(rng.integers(0, texture.shape[1] - width + 1))
    luma = texture[y:y + height, x:x + width, None]
    chroma = np.stack([np.roll(texture, 37 * (c + 1), axis=c % 2)[y:y + height, x:x + width]
                       for c in range(3)], -1)
    return 0.75 * luma + 0.6 * chroma


def _synthetic(rng: np.random.Generator) -> np.ndarray:
    from gpufeed.server.demo import synthetic_photo

    return synthetic_photo(rng, int(rng.integers(*_HEIGHTS)), int(rng.integers(*_WIDTHS)))


def _encode(rgb: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rgb).save(out, "JPEG", quality=_QUALITY, subsampling="4:2:0")
    return out.getvalue()
