"""A gpufeed loader under PyTorch Lightning and Accelerate, the real packages (CPU).

What they call on a loader, read from their sources (lightning 2.6, accelerate 1.15)
and checked here: Lightning calls ``set_epoch`` on ``loader.sampler`` (or
``loader.batch_sampler.sampler``: lightning.fabric.utilities.data._set_sampler_epoch)
before every epoch, the training loader's and, while fitting, the evaluation
loaders'; ``len(loader)`` for its totals; and ``state_dict`` / ``load_state_dict``
of a loader that has both (its ``_Stateful``), the latter only to resume mid-epoch:
from an end-of-epoch checkpoint it restores nothing and sets the epoch. It looks at
``loader.batch_sampler`` of an evaluation loader too. Accelerate's ``prepare``
hands back anything that is not a torch DataLoader untouched and calls nothing on
it; ``register_for_checkpointing`` makes ``save_state`` / ``load_state`` call
``state_dict`` / ``load_state_dict``, and its loops call ``set_epoch`` only if the
script does. A run stopped at an epoch's end or inside one and resumed must then
get, epoch by epoch, the batches of a run never stopped: the same samples in the
same order with the same crops.
"""

from __future__ import annotations

import hashlib

import accelerate
import pytest
import torch

_FILES = 40
_EPOCHS = 4
_RESUME_FILES, _RESUME_BATCH = 24, 4  # 6 batches an epoch; Lightning takes 3 of them


def _loader(feed, image_names):
    return feed.loader(files=image_names[:_FILES], batch_size=8, size=(8, 8), shuffle=True,
                       seed=11, resize="random_resized_crop", flip=0.5)


def _check_epochs(epochs: dict[int, list[int]]) -> None:
    assert sorted(epochs) == [0, 1]
    for order in epochs.values():
        assert sorted(order) == list(range(_FILES))  # every sample once per epoch
    assert epochs[0] != epochs[1]  # a new order


@pytest.fixture(scope="module")
def lightning():
    """Imported by the tests that use it, not at collection: lightning imports
    torch._dynamo and sympy, ~3.5 CPU-s in every pytest worker that collects this file."""
    import lightning

    return lightning


def _tiny(lightning):
    class Tiny(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)
            self.seen: dict[int, list[int]] = {}

        def training_step(self, batch, batch_idx):
            self.seen.setdefault(self.current_epoch, []).extend(batch["index"].tolist())
            return self.layer(batch["image"].float().mean(dim=(2, 3))).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Tiny()


def test_lightning_fit_gets_a_new_order_each_epoch(lightning, feed, image_names):
    loader = _loader(feed, image_names)
    model = _tiny(lightning)
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


# Each epoch's batches as (indices, a digest of each image): the order and the crops.
_Epochs = dict[int, list[tuple[list[int], list[str]]]]


def _resume_loader(feed, image_names):
    return feed.loader(files=image_names[:_RESUME_FILES], batch_size=_RESUME_BATCH, size=16,
                       shuffle=True, seed=12, resize="random_resized_crop", flip=0.5)


def _note(seen: _Epochs, epoch: int, batch: dict[str, torch.Tensor]) -> None:
    images = [hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()
              for image in batch["image"]]
    seen.setdefault(epoch, []).append((batch["index"].tolist(), images))


def _check_same_run(*runs: _Epochs) -> None:
    first = runs[0]
    assert sorted(first) == list(range(_EPOCHS))
    assert len({str(batches) for batches in first.values()}) == _EPOCHS  # each epoch its own
    for run in runs[1:]:
        assert run == first


class _Crash(Exception):
    """The trainer process dying, just after a checkpoint."""


def _recorder(lightning, crash_at: tuple[int, str] | None):
    """A module that notes each epoch's batches; at ``crash_at`` (global step, path) it
    saves a checkpoint and dies."""

    class Recorder(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)
            self.seen: _Epochs = {}

        def training_step(self, batch, batch_idx):
            _note(self.seen, self.current_epoch, batch)
            return self.layer(batch["image"].float().mean(dim=(2, 3))).mean()

        def validation_step(self, batch, batch_idx):
            pass

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if crash_at and self.trainer.global_step == crash_at[0]:
                self.trainer.save_checkpoint(crash_at[1])  # a mid-epoch checkpoint
                raise _Crash

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Recorder()


def _fit(lightning, feed, image_names, folder, max_epochs: int, ckpt_path=None,
         crash_at=None) -> _Epochs:
    """One trainer process: a fresh loader, as a restarted job makes; a checkpoint at
    every epoch's end (``epoch=N.ckpt``); 3 of the loader's 6 batches an epoch, so every
    pass is left early, and an evaluation loader beside it."""
    model = _recorder(lightning, crash_at)
    trainer = lightning.Trainer(
        max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_train_batches=3,
        limit_val_batches=1, num_sanity_val_steps=1, default_root_dir=folder,
        callbacks=[lightning.pytorch.callbacks.ModelCheckpoint(
            dirpath=folder, filename="{epoch}", save_top_k=-1)])
    evaluation = feed.loader(files=image_names[:8], batch_size=4, size=16, resize="center_crop")
    try:
        trainer.fit(model, train_dataloaders=_resume_loader(feed, image_names),
                    val_dataloaders=evaluation, ckpt_path=ckpt_path)
    except _Crash:
        pass
    return model.seen


def test_lightning_resumed_at_an_epoch_end_or_inside_one_runs_as_if_never_stopped(
        lightning, feed, image_names, tmp_path):
    whole = _fit(lightning, feed, image_names, tmp_path / "whole", _EPOCHS)
    # Stopped after epoch 1: Lightning restores nothing into the new loader and sets
    # epoch 2 through loader.sampler.
    first = _fit(lightning, feed, image_names, tmp_path / "first", 2)
    then = _fit(lightning, feed, image_names, tmp_path / "first", _EPOCHS,
                ckpt_path=tmp_path / "first" / "epoch=1.ckpt")
    # Stopped after epoch 2's second batch (global step 3 + 3 + 2): load_state_dict,
    # then set_epoch(2) again, which keeps the position.
    crashed = _fit(lightning, feed, image_names, tmp_path / "crashed", _EPOCHS,
                   crash_at=(8, str(tmp_path / "mid.ckpt")))
    after = _fit(lightning, feed, image_names, tmp_path / "crashed", _EPOCHS,
                 ckpt_path=tmp_path / "mid.ckpt")
    assert len(crashed[2]) == 2 and len(after[2]) == 1
    _check_same_run(whole, {**first, **then},
                    {**crashed, **after, 2: crashed[2] + after[2]})


def _accelerate_run(feed, image_names, folder, *, resume: bool = False,
                    stop_at: tuple[int, int] | None = None) -> _Epochs:
    """A trainer process as Accelerate's examples write it, the loader registered for
    checkpointing; ``stop_at`` (epoch, batches): save_state there and stop, as a
    preempted job does (at batch 0: at the epoch's start, i.e. the last one's end)."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer,
                                                   _resume_loader(feed, image_names))
    accelerator.register_for_checkpointing(loader)
    if resume:
        accelerator.load_state(str(folder))
    seen: _Epochs = {}
    for epoch in range(loader.epoch, _EPOCHS):
        if stop_at == (epoch, 0):
            accelerator.save_state(str(folder))
            return seen
        for k, batch in enumerate(loader):
            _note(seen, epoch, batch)
            accelerator.backward(model(batch["image"].float().mean(dim=(2, 3))).mean())
            optimizer.step()
            optimizer.zero_grad()
            if stop_at == (epoch, k + 1):
                accelerator.save_state(str(folder))
                return seen
    return seen


@pytest.mark.parametrize("stop_at", [(2, 0), (2, 2)], ids=["at-epoch-end", "mid-epoch"])
def test_accelerate_resumed_from_save_state_runs_as_if_never_stopped(feed, image_names,
                                                                     tmp_path, stop_at):
    whole = _accelerate_run(feed, image_names, tmp_path)
    before = _accelerate_run(feed, image_names, tmp_path, stop_at=stop_at)
    after = _accelerate_run(feed, image_names, tmp_path, resume=True)
    assert min(after) == 2
    joined = {**before, **after, 2: before.get(2, []) + after[2]}
    _check_same_run(whole, joined)
