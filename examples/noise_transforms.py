"""An example gpufeed plugin: two sample transforms an operator installs on the server.

Install and run (any importable module works; here, this file's directory on the path):

    PYTHONPATH=examples gpufeed-server --data-root /data --plugins noise_transforms

Request them by name, with JSON parameters, next to the built-in ones:

    loader = feed.loader(files, batch_size=256, size=224, resize="random_resized_crop",
                         transforms=[("color_jitter", {"brightness": 0.4}),
                                     ("gaussian_noise", {"sigma": 8.0, "p": 0.5}),
                                     ("salt_and_pepper", {"amount": 0.002})])

Each registered function is a factory: it checks its parameters when a stream
opens (a ValueError here refuses the request, INVALID_ARGUMENT naming the
transform) and returns the function run on every sample. That function gets the
sample's fields ({"image": uint8 [3, H, W]}, the decoded row after crop and
flip) and a numpy Generator seeded by (seed, epoch, sample index): every random
draw must come from it, so passes repeat exactly and resume where they stopped.
"""

from __future__ import annotations

import numpy as np

from gpufeed.server import transforms


@transforms.register("gaussian_noise")
def gaussian_noise(sigma: float = 8.0, p: float = 1.0):
    """Adds N(0, sigma^2) noise to every pixel with probability ``p``. numpy releases the
    GIL in its array loops, so this runs on the server's decode threads."""
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    if not 0 <= p <= 1:
        raise ValueError(f"p must be in [0, 1], got {p}")

    def apply(sample: dict, rng: np.random.Generator) -> dict:
        if rng.random() >= p:
            return sample
        image = sample["image"]
        noisy = image + rng.normal(0.0, sigma, image.shape)
        np.rint(noisy, out=noisy)
        image[...] = np.clip(noisy, 0, 255)  # written into the batch row in place
        return sample

    return apply


@transforms.register("salt_and_pepper", holds_gil=True)
def salt_and_pepper(amount: float = 0.01):
    """Sets a fraction ``amount`` of the pixels to black or white, one pixel at a time in
    Python: it holds the GIL, so it says so and the server runs it in worker processes."""
    if not 0 <= amount <= 1:
        raise ValueError(f"amount must be in [0, 1], got {amount}")

    def apply(sample: dict, rng: np.random.Generator) -> dict:
        image = sample["image"]
        _, height, width = image.shape
        count = int(amount * height * width)
        ys = rng.integers(0, height, count).tolist()
        xs = rng.integers(0, width, count).tolist()
        white = (rng.random(count) < 0.5).tolist()
        for y, x, w in zip(ys, xs, white):
            image[:, y, x] = 255 if w else 0
        return sample

    return apply
