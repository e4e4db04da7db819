"""One trainer rank of ``bench.open_scale``, in its own process, as torchrun would start it.

``python -m bench.open_scale_rank {gpufeed,dataloader} --rank R --world-size N ...``

It imports torch and what its side needs, prints ``ready`` and waits for a
line on its standard input: the start barrier (the parent releases every rank
at one moment). Then it opens its loader, the same job on both sides
(``bench.jobs``' ``train-u8``: random-resized crop + flip 0.5 to 224x224,
uint8, batch 32, shuffled, this rank's part of the set):

- ``gpufeed``: ``FeedClient(ADDRESS).loader(LIST_FILE, labels="list_file",
  shuffle=True, rank=R, world_size=N, transport="shm")``; the server parses the
  list, the rank holds none of it.
- ``dataloader``: ``DataLoader(ImageFolderIndex(ROOT), sampler=
  DistributedSampler(rank=R, num_replicas=N, shuffle=True), num_workers=W,
  persistent_workers=True, prefetch_factor=2)``, each sample Pillow decode +
  the random-resized crop and flip that bench/peers/torch_loader.py writes out
  (torchvision does not import here). ``ImageFolderIndex`` is torchvision's
  ``ImageFolder`` index built as its ``find_classes`` and ``make_dataset`` build
  it: the class folders by ``os.scandir``, sorted; each class's files by
  ``os.walk(followlinks=True)``, sorted, kept by extension; a Python list of
  ``(path, class_index)`` tuples and the list of targets.

It prints ``first <t>`` at its first batch (``t``: ``time.monotonic()``,
CLOCK_MONOTONIC, which every process on the host shares), takes ``--more``
batches, prints ``held <t> <batches>`` and keeps everything as a trainer in
its step would (the stream open or the workers alive, their prefetched batches
queued, its last batch held) until a line or the end of its standard input;
then it closes its loader and ends. An error: ``error <message>``, exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

__all__ = ["IMG_EXTENSIONS", "ImageFolderIndex", "main", "per_class"]

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_CLASSES = 1000


def per_class(lines: int, classes: int = _CLASSES) -> list[int]:
    """How many of ``lines`` samples each class has in bench.open_scale's list file."""
    return [lines // classes + (c < lines % classes) for c in range(classes)]


class ImageFolderIndex:
    """``torchvision.datasets.ImageFolder(root)``'s index, built the way its
    ``find_classes`` and ``make_dataset`` build it (torchvision 0.2x), with the
    same attributes: ``classes``, ``class_to_idx``, ``samples`` (a list of
    ``(path, class_index)`` tuples), ``targets``, ``imgs`` (``samples`` again).

    ``limit``: at most ``limit[c]`` files of class c (its first, sorted), so
    that the index holds the very samples bench.open_scale's list file names:
    its class folders all link to one pool of 1300 files, and ImageNet's
    classes have 1281 or 1282 of them on average. With ``limit`` None it is
    make_dataset's walk unchanged.
    """

    def __init__(self, root: str, limit: list[int] | None = None):
        self.root = root
        self.classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        samples: list[tuple[str, int]] = []
        for target_class in sorted(self.class_to_idx):
            class_index = self.class_to_idx[target_class]
            target_dir = os.path.join(root, target_class)
            room = len(samples) + (limit[class_index] if limit is not None else sys.maxsize)
            for folder, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
                for fname in sorted(fnames):
                    path = os.path.join(folder, fname)
                    if path.lower().endswith(IMG_EXTENSIONS) and len(samples) < room:
                        samples.append((path, class_index))
        self.samples = samples
        self.targets = [s[1] for s in samples]
        self.imgs = self.samples

    def __len__(self) -> int:
        return len(self.samples)


class _Dataset:
    """ImageFolder's ``__getitem__``: the path's image through the transform, its target."""

    def __init__(self, index: ImageFolderIndex, size: tuple[int, int], image):
        self.index = index
        self.size = size
        self.image = image  # bench/peers/torch_loader.py's pillow_image

    def __len__(self) -> int:
        return len(self.index.samples)

    def __getitem__(self, i: int):
        path, target = self.index.samples[i]
        return self.image(path, self.size, "train-u8"), target


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.open_scale_rank", description=__doc__)
    p.add_argument("side", choices=["gpufeed", "dataloader"])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--address", help="gpufeed: the server")
    p.add_argument("--list-file", help="gpufeed: the list file, relative to the server's root")
    p.add_argument("--root", help="dataloader: the ImageFolder root (train/)")
    p.add_argument("--lines", type=int, help="dataloader: the samples of the list file")
    p.add_argument("--workers", type=int, default=8, help="dataloader: worker processes")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--more", type=int, default=5, help="batches to take after the first")
    return p


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import faulthandler
    import signal
    import warnings

    faulthandler.register(signal.SIGUSR1)  # the parent asks a rank that is late where it is

    import torch  # noqa: F401  (every trainer has it; imported before the barrier)

    from bench import jobs

    # 8 workers a rank on 2 cores is the point of the peer; torch warns about it.
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    size = (args.size, args.size)
    if args.side == "gpufeed":
        from gpufeed.client import FeedClient
    else:
        from torch.utils.data import DataLoader, DistributedSampler

        from bench.peers.torch_loader import pillow_image
    _say("ready")
    if not sys.stdin.readline():
        return 0
    feed = None
    try:
        if args.side == "gpufeed":
            feed = FeedClient(args.address)
            loader = feed.loader(args.list_file, batch_size=args.batch_size, size=size,
                                 labels="list_file", shuffle=True, seed=1, rank=args.rank,
                                 world_size=args.world_size, transport="shm",
                                 resize="random_resized_crop", scale=jobs.SCALE,
                                 ratio=jobs.RATIO, flip=jobs.FLIP)
        else:
            index = ImageFolderIndex(args.root, per_class(args.lines))
            sampler = DistributedSampler(index, num_replicas=args.world_size, rank=args.rank,
                                         shuffle=True, seed=1)
            workers = args.workers
            loader = DataLoader(_Dataset(index, size, pillow_image), batch_size=args.batch_size,
                                sampler=sampler, num_workers=workers,
                                persistent_workers=workers > 0,
                                prefetch_factor=2 if workers > 0 else None)
        batches = iter(loader)
        batch = next(batches)
        first = time.monotonic()
        image = batch["image"] if args.side == "gpufeed" else batch[0]
        jobs.check_batch(image.shape, image.dtype, size, "train-u8")
        if image.shape[0] != args.batch_size:
            raise RuntimeError(f"a first batch of {image.shape[0]} images")
        del image
        _say(f"first {first:.6f}")
        taken = 1
        for _ in range(args.more):
            batch = None  # a trainer's step drops its batch before it takes the next
            batch = next(batches)
            taken += 1
        _say(f"held {time.monotonic():.6f} {taken}")
        sys.stdin.readline()  # the parent has read the memory
        del batch, batches, loader  # the stream ends; the workers are shut down
    except Exception as e:  # reported to the parent, which stops the row
        _say(f"error {type(e).__name__}: {e}")
        return 1
    finally:
        if feed is not None:
            feed.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
