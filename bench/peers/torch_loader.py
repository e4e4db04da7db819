"""PyTorch's DataLoader as most trainers use it: worker processes, Pillow decode + resize.

Each worker opens a file with Pillow, converts it to RGB, resizes it to the
output size (bilinear, as gpufeed's reference) and returns a uint8 [3, H, W]
tensor; the default collate stacks 32 of them in shared memory for the
trainer. Workers persist across passes, as ``persistent_workers`` does.
"""

from __future__ import annotations

import numpy as np


class _Images:
    def __init__(self, paths: list[str], size: tuple[int, int]):
        self.paths = paths
        self.size = size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        import torch
        from PIL import Image

        with Image.open(self.paths[i]) as im:
            rgb = im.convert("RGB").resize((self.size[1], self.size[0]), Image.BILINEAR)
        return torch.from_numpy(np.asarray(rgb).transpose(2, 0, 1).copy())


def run(config, meter, workers: int) -> str:
    import warnings

    from torch.utils.data import DataLoader

    # More workers than cores is the point of the 4-worker row; torch warns about it.
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    loader = DataLoader(_Images(config.paths, tuple(config.size)), batch_size=config.batch_size,
                        num_workers=workers, persistent_workers=True)
    for _ in range(config.passes):
        for batch in loader:
            meter.batch(int(batch.shape[0]))
    meter.stop()
    return f"{workers} worker processes, Pillow decode + bilinear resize"
