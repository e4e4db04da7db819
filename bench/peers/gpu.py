"""What the GPU rows share: when a batch counts, and one crop's resize and flip on the device.

A batch made on the GPU is counted once the GPU has finished it, one batch late:
the row queues batch k, then waits for batch k - 1's event. That is the overlap
a trainer gets (its step on batch k - 1 runs while the loader queues batch k),
and the clock never stops before the device's work is done. On the CPU (a
decoder's CPU backend, tried where there is no GPU) a batch counts when made.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import jobs

__all__ = ["count_when_done", "resize_flip"]


def count_when_done(meter, batches: Iterable[torch.Tensor], size: tuple[int, int]) -> None:
    """Meter ``batches`` (uint8 [N, 3, H, W]) as the module docstring says; the first is
    checked to be the train-u8 job's output."""
    pending: tuple[int, torch.cuda.Event | None] | None = None
    for batch in batches:
        if meter.images == 0 and pending is None:
            jobs.check_batch(batch.shape, batch.dtype, size, "train-u8")
        done = None
        if batch.is_cuda:
            done = torch.cuda.Event(blocking=True)  # waited for asleep: a spinning wait
            done.record()  # would count a core's CPU against the peer
        if pending is not None:
            _count(meter, *pending)
        pending = (int(batch.shape[0]), done)
    if pending is not None:
        _count(meter, *pending)
    meter.stop()


def _count(meter, images: int, done: torch.cuda.Event | None) -> None:
    if done is not None:
        done.synchronize()
    meter.batch(images)


def resize_flip(chw: torch.Tensor, size: tuple[int, int], flip: bool) -> torch.Tensor:
    """A decoded crop (uint8 [3, h, w], on any device) resized to ``size`` with a bilinear
    filter widened when shrinking (Pillow's, as gpufeed's CPU path), then mirrored if
    ``flip``: uint8 [3, H, W]."""
    scaled = torch.nn.functional.interpolate(chw[None].float(), size=size, mode="bilinear",
                                             antialias=True, align_corners=False)[0]
    out = scaled.round_().clamp_(0, 255).to(torch.uint8)
    return out.flip(-1) if flip else out
