"""A gpufeed loader under PyTorch Lightning and Accelerate, the real packages (CPU).

What they call on a loader, read from their sources (lightning 2.6, accelerate 1.15)
and checked here: Lightning calls ``set_epoch`` only on ``loader.sampler`` or
``loader.batch_sampler.sampler`` (lightning.fabric.utilities.data._set_sampler_epoch),
which a gpufeed loader does not have, and ``len(loader)`` for its totals; Accelerate's
``prepare`` hands back anything that is not a torch DataLoader untouched and calls
nothing on it. Neither calls ``loader.set_epoch``: each new pass must be the next
epoch by itself.
"""

from __future__ import annotations

import accelerate
import lightning
import torch

_FILES = 40


def _loader(feed, image_names):
    return feed.loader(files=image_names[:_FILES], batch_size=8, size=(8, 8), shuffle=True,
                       seed=11, resize="random_resized_crop", flip=0.5)


def _check_epochs(epochs: dict[int, list[int]]) -> None:
    assert sorted(epochs) == [0, 1]
    for order in epochs.values():
        assert sorted(order) == list(range(_FILES))  # every sample once per epoch
    assert epochs[0] != epochs[1]  # a new order


class _Tiny(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).extend(batch["index"].tolist())
        return self.layer(batch["image"].float().mean(dim=(2, 3))).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_lightning_fit_gets_a_new_order_each_epoch(feed, image_names):
    loader = _loader(feed, image_names)
    model = _Tiny()
    trainer = lightning.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False)
    trainer.fit(model, train_dataloaders=loader)
    assert trainer.num_training_batches == len(loader) == 5
    _check_epochs(model.seen)


def test_accelerate_loop_gets_a_new_order_each_epoch(feed, image_names):
    loader = _loader(feed, image_names)
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    assert prepared is loader  # not a DataLoader: passed through, nothing called on it
    seen: dict[int, list[int]] = {}
    for epoch in range(2):
        for batch in prepared:
            seen.setdefault(epoch, []).extend(batch["index"].tolist())
            loss = model(batch["image"].float().mean(dim=(2, 3))).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    _check_epochs(seen)
