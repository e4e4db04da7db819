"""Train a small CNN on an ImageFolder tree served by gpufeed, with a mid-epoch resume.

The tree is ``DATA/train/<class>/...`` and ``DATA/val/<class>/...`` on the
server, DATA named as the server names it (relative to one of its
``--data-root`` directories). Training batches are random-resized crops with
flips, normalised by the server; evaluation is a centre crop with the folder
labels, numbered from the training set's class folders (``classes=train.classes``),
so a validation set missing a class, even its folder, keeps the training
numbers. Every ``--checkpoint-every`` steps the model, the optimiser and the
loader's position go to ``--checkpoint``; started again with the same
arguments, the script resumes from there, mid-epoch, at the sample after the
last one it trained on.

    gpufeed-server --data-root /data --listen 127.0.0.1:50051 &
    python examples/train_imagefolder.py --server 127.0.0.1:50051 --data imagenette

``--stop-after N`` ends the run after N steps, as a killed trainer would.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

from gpufeed.client import FeedClient

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True, help="gpufeed-server address, HOST:PORT")
    p.add_argument("--data", required=True,
                   help="the directory holding train/ and val/, as the server names it")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--size", type=int, default=64, help="side of the square crops")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default="checkpoint.pt")
    p.add_argument("--checkpoint-every", type=int, default=1, help="steps between checkpoints")
    p.add_argument("--stop-after", type=int, default=0, help="end after this many steps (0: never)")
    return p.parse_args(argv)


def tiny_cnn(num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, num_classes))


def evaluate(model: nn.Module, loader) -> float:
    """Top-1 accuracy over the loader's pass; samples repeated to pad ranks count once."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in loader:
            keep = ~batch["padded"] if "padded" in batch else slice(None)
            predicted = model(batch["image"]).argmax(1)
            correct += int((predicted[keep] == batch["label"][keep]).sum())
            total += int(batch["label"][keep].numel())
    model.train()
    return correct / max(total, 1)


def _save(path: str, state: dict) -> None:
    """Write the checkpoint whole or not at all (a trainer may be killed mid-write)."""
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    torch.manual_seed(args.seed)
    with FeedClient(args.server) as feed:
        train = feed.loader(files=f"{args.data}/train/", labels="folder",
                            batch_size=args.batch_size, size=(args.size, args.size),
                            resize="random_resized_crop", flip=0.5, dtype="float32",
                            mean=MEAN, std=STD, shuffle=True, seed=args.seed)
        val = feed.loader(files=f"{args.data}/val/", labels="folder",
                          batch_size=args.batch_size, size=(args.size, args.size),
                          resize="center_crop", dtype="float32", mean=MEAN, std=STD,
                          classes=train.classes)  # train's numbering, whatever val/ holds
        classes = train.classes  # known once the loader is made: its stream is open
        model = tiny_cnn(len(classes))
        optimiser = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        step = 0
        if os.path.exists(args.checkpoint):
            state = torch.load(args.checkpoint, weights_only=True)
            model.load_state_dict(state["model"])
            optimiser.load_state_dict(state["optimiser"])
            train.load_state_dict(state["loader"])
            step = state["step"]
            print(f"resumed at epoch {train.epoch}, sample {state['loader']['samples_consumed']} "
                  f"(step {step})", flush=True)
        # A pass that reaches its epoch's end makes the next pass the next epoch;
        # after load_state_dict, the first pass finishes the checkpoint's epoch.
        for epoch in range(train.epoch, args.epochs):
            samples, loss = 0, None
            for batch in train:
                loss = nn.functional.cross_entropy(model(batch["image"]), batch["label"])
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                step += 1
                samples += len(batch["label"])
                if step % args.checkpoint_every == 0:
                    _save(args.checkpoint, {"model": model.state_dict(),
                                            "optimiser": optimiser.state_dict(),
                                            "loader": train.state_dict(), "step": step})
                if step == args.stop_after:
                    print(f"stopped after step {step} ({samples} samples of epoch {epoch})",
                          flush=True)
                    return 0
            last = f"{loss.item():.3f}" if loss is not None else "-"
            print(f"epoch {epoch}: {samples} samples, last loss {last}, "
                  f"val accuracy {evaluate(model, val):.3f}", flush=True)
            if train.failures:
                print(f"  {len(train.failures)} samples failed: {train.failures[:3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
