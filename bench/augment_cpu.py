"""CPU time per image of the built-in augmentations, torch path against C kernels.

``python -m bench.augment_cpu [--data bench/data] [--images 32] [--repeats 7]``

Each kernel, and each transform as a request names it, runs on the same 224x224
uint8 rows on one thread (torch.set_num_threads(1), as the server runs it);
``time.thread_time`` over all the rows, the best of ``--repeats``, divided by the
rows. Rows are the bench set's JPEGs (bench/dataset.py) squashed to 224x224 with
Pillow, or gpufeed-demo's synthetic photos if there is no set. A CPU
measurement: it holds on a shared machine, where images/s do not.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from gpufeed.server.media.transforms import builtins as augment

from . import jobs

SIZE = 224


def _rows(data: Path, count: int) -> tuple[list[np.ndarray], str]:
    files = sorted(data.glob("*.jpg"))[:count] if data.is_dir() else []
    if files:
        from PIL import Image

        rows = []
        for file in files:
            with Image.open(file) as im:
                rgb = im.convert("RGB").resize((SIZE, SIZE), Image.BILINEAR)
            rows.append(np.ascontiguousarray(np.asarray(rgb).transpose(2, 0, 1)))
        return rows, f"{len(rows)} JPEGs of {data}, squashed to {SIZE}x{SIZE}"
    from gpufeed.server.demo import synthetic_photo

    rng = np.random.default_rng(0)
    rows = [np.ascontiguousarray(synthetic_photo(rng, SIZE, SIZE).transpose(2, 0, 1))
            for _ in range(count)]
    return rows, f"{count} synthetic {SIZE}x{SIZE} photos"


def _best_ms(work: Callable[[np.ndarray, int], object], rows: list[np.ndarray],
             repeats: int) -> float:
    """Best thread CPU ms per row of ``work(row, i)`` over ``repeats`` passes."""
    best = float("inf")
    for _ in range(repeats):
        copies = [row.copy() for row in rows]  # transforms may work in place
        start = time.thread_time()
        for i, row in enumerate(copies):
            work(row, i)
        best = min(best, time.thread_time() - start)
    return best * 1000 / len(rows)


def _kernel(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[np.ndarray, int], object]:
    return lambda row, i: fn(torch.from_numpy(row))


def _transform(specs: list) -> Callable[[np.ndarray, int], object]:
    """The request's transforms one after the other, each made once, a generator per row
    (the same draws for both paths)."""
    from gpufeed.server import transforms

    made = []
    for spec in specs:
        name, params = (spec, {}) if isinstance(spec, str) else spec
        made.append(transforms.lookup(name).make(params))

    def run(row: np.ndarray, i: int) -> object:
        sample = {"image": row}
        for k, fn in enumerate(made):
            sample = fn(sample, np.random.default_rng([i, k]))
        return sample

    return run


def cases() -> list[tuple[str, Callable[[np.ndarray, int], object]]]:
    a = augment
    wide = [(op, m) for op, m in (("ShearX", 0.3), ("TranslateX", 12.0), ("Rotate", 30.0),
                                  ("Brightness", 0.3), ("Color", 0.3), ("Contrast", 0.3),
                                  ("Sharpness", 0.3), ("Posterize", 4), ("Solarize", 0.5),
                                  ("AutoContrast", 0.0), ("Equalize", 0.0))]
    return [
        ("brightness 1.3", _kernel(lambda x: a.adjust_brightness(x, 1.3))),
        ("contrast 1.3", _kernel(lambda x: a.adjust_contrast(x, 1.3))),
        ("saturation 1.3", _kernel(lambda x: a.adjust_saturation(x, 1.3))),
        ("hue 0.07", _kernel(lambda x: a.adjust_hue(x, 0.07))),
        *[(f"TrivialAugmentWide {op} {m:g}",
           _kernel(lambda x, op=op, m=m: a.apply_wide_op(x, op, m))) for op, m in wide],
        ("transform color_jitter (bench's)", _transform([("color_jitter", jobs.JITTER)])),
        ("transform trivial_augment_wide", _transform(["trivial_augment_wide"])),
        ("transform random_erasing p=1", _transform([("random_erasing", {"p": 1.0})])),
        ("the bench's augmentations (both)", _transform(list(jobs.AUGMENT))),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, source = _rows(args.data, args.images)
    print(f"rows: {source}; best of {args.repeats}; CPU ms per image, one thread")
    paths = ["torch"] + (["C"] if augment.NATIVE_BUILT else [])
    print("| operation | " + " | ".join(paths) + (" | ratio |" if len(paths) == 2 else " |"))
    print("|---|" + "---:|" * (len(paths) + (len(paths) == 2)))
    for name, work in cases():
        figures = []
        for path in paths:
            augment.use_native(path == "C")
            figures.append(_best_ms(work, rows, args.repeats))
        ratio = [f"{figures[0] / figures[1]:.1f}x"] if len(figures) == 2 else []
        print(f"| {name} | " + " | ".join([f"{f:.3f}" for f in figures] + ratio) + " |")
    augment.use_native(augment.NATIVE_BUILT)


if __name__ == "__main__":
    main()
