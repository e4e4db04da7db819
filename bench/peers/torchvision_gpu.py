"""The peer a user would pick on a GPU host without DALI: torchvision on the GPU.

DataLoader worker processes read each file's bytes; the trainer's process
decodes the batch on the GPU in one ``torchvision.io.decode_jpeg(list,
device="cuda")`` call (nvJPEG, batched), then takes each image's
random-resized crop (``RandomResizedCrop.get_params``, torchvision's own
draw) with ``resized_crop`` (bilinear, antialiased) and flips it, on the GPU,
into the batch. Batches count when the GPU has made them (peers/gpu.py).

It needs torchvision built for the machine's CUDA torch: the GPU device
machine has one. (torchvision from PyPI is a CUDA build that does not import
beside the CPU torch of the development machines: there the row says so.)
"""

from __future__ import annotations

import torch

from .. import jobs
from . import Unavailable
from .gpu import count_when_done


class _FileBytes(torch.utils.data.Dataset):
    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.paths[i], "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)


def run(config, meter, job: str, workers: int) -> str:
    if job != "train-u8":
        raise ValueError(f"the torchvision GPU row does train-u8, not {job}")
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
        from torchvision.transforms import RandomResizedCrop
        from torchvision.transforms.v2 import functional
    except Exception as e:  # not installed, or built for another torch
        raise Unavailable(f"torchvision does not import here: {e}") from None
    if not torch.cuda.is_available():
        raise Unavailable("no CUDA device")
    height, width = size = tuple(config.size)
    loader = torch.utils.data.DataLoader(
        _FileBytes(config.paths), batch_size=config.batch_size, num_workers=workers,
        collate_fn=list, persistent_workers=True, prefetch_factor=4)

    def batches():
        for _ in range(config.passes):
            for data in loader:
                images = decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda")
                out = torch.empty((len(images), 3, height, width), dtype=torch.uint8,
                                  device="cuda")
                for k, image in enumerate(images):
                    top, left, h, w = RandomResizedCrop.get_params(image, list(jobs.SCALE),
                                                                   list(jobs.RATIO))
                    crop = functional.resized_crop(image, top, left, h, w, [height, width],
                                                   antialias=True)
                    out[k] = crop.flip(-1) if torch.rand(()) < jobs.FLIP else crop
                yield out

    count_when_done(meter, batches(), size)
    return f"{workers} DataLoader workers read bytes; nvJPEG batched decode, crops on the GPU"
