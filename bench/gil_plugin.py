"""A sample transform that holds the GIL, registered twice: on the decode threads, and in
worker processes (``holds_gil=True``), for the train-pyloop rows (bench/README.md).

It visits pixels one at a time in Python (a local contrast tweak of 4000 random
pixels of the 224 x 224 output), the kind of transform a user writes first and
that numpy or torch would not run without the GIL.
"""

from __future__ import annotations

import numpy as np

from gpufeed.server import transforms

_PIXELS = 4000


def _pixel_loop():
    def apply(sample: dict, rng: np.random.Generator) -> dict:
        image = sample["image"]
        _, height, width = image.shape
        ys = rng.integers(0, height, _PIXELS).tolist()
        xs = rng.integers(0, width, _PIXELS).tolist()
        rows = image.tolist()  # Python lists: every read and write below holds the GIL
        for y, x in zip(ys, xs):
            for channel in rows:
                value = channel[y][x]
                channel[y][x] = min(255, value + value // 8)
        image[...] = rows
        return sample

    return apply


transforms.register("py_pixels")(_pixel_loop)
transforms.register("py_pixels_in_processes", holds_gil=True)(_pixel_loop)
