"""mixup and cutmix over delivered batches: torchvision.transforms.v2's formulas, and draws
that a resumed run repeats (seeded by the loader's position, not a global RNG)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpufeed.client import cutmix, mixup

CLASSES = 5


def _batch(seed: int = 0, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 20, 28), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    return images, labels


def test_mixup_blends_each_sample_with_its_neighbour():
    images, labels = _batch()
    x = images.float()
    mixed, targets = mixup(x, labels, num_classes=CLASSES, alpha=0.4,
                           rng=np.random.default_rng(9))
    lam = np.random.default_rng(9).beta(0.4, 0.4)
    for i in range(len(x)):
        j = i - 1  # the batch rolled by one: sample i's partner is i - 1 (0's is the last)
        torch.testing.assert_close(mixed[i], lam * x[i] + (1 - lam) * x[j])
        expected = torch.zeros(CLASSES)
        expected[labels[i]] += lam
        expected[labels[j]] += 1 - lam
        torch.testing.assert_close(targets[i], expected)
    assert torch.equal(x, images.float())  # the input is left alone
    with pytest.raises(TypeError, match="float images"):
        mixup(images, labels, num_classes=CLASSES, rng=np.random.default_rng(0))


def test_cutmix_pastes_a_box_of_the_neighbour():
    images, labels = _batch(1)
    mixed, targets = cutmix(images, labels, num_classes=CLASSES, alpha=1.0,
                            rng=np.random.default_rng(4))
    rng = np.random.default_rng(4)
    lam = rng.beta(1.0, 1.0)
    cx, cy = int(rng.integers(28)), int(rng.integers(20))
    r = 0.5 * math.sqrt(1 - lam)
    x1, x2 = max(cx - int(r * 28), 0), min(cx + int(r * 28), 28)
    y1, y2 = max(cy - int(r * 20), 0), min(cy + int(r * 20), 20)
    inside = torch.zeros(20, 28, dtype=torch.bool)
    inside[y1:y2, x1:x2] = True
    assert inside.any()
    kept = 1 - inside.float().mean().item()
    for i in range(len(images)):
        j = i - 1
        assert torch.equal(mixed[i][:, inside], images[j][:, inside])
        assert torch.equal(mixed[i][:, ~inside], images[i][:, ~inside])
        expected = torch.zeros(CLASSES)
        expected[labels[i]] += kept
        expected[labels[j]] += 1 - kept
        torch.testing.assert_close(targets[i], expected)
    assert mixed.dtype == torch.uint8


def _mixed_pass(loader, start: int = 0) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for position, batch in enumerate(loader, start):
        images, targets = cutmix(batch["image"], batch["label"], num_classes=CLASSES,
                                 rng=loader.batch_rng())
        mixed, soft = mixup(images.float(), batch["label"], num_classes=CLASSES,
                            rng=loader.batch_rng())
        out[position] = (mixed, soft + targets)
    return out


def test_a_resumed_run_mixes_its_batches_the_same(feed, image_names):
    names = image_names[:48]
    labels = [i % CLASSES for i in range(len(names))]
    kw = dict(batch_size=8, size=24, shuffle=True, seed=3, labels=labels, transport="inline")
    whole = _mixed_pass(feed.loader(names, **kw))
    assert len(whole) == 6
    lams = {round(float(v[1].max()), 6) for v in whole.values()}
    assert len(lams) > 1  # batches draw anew

    loader = feed.loader(names, **kw)
    batches = iter(loader)
    next(batches), next(batches)
    state = loader.state_dict()
    batches.close()
    resumed = feed.loader(names, **kw)
    resumed.load_state_dict(state)
    rest = _mixed_pass(resumed, start=2)
    assert sorted(rest) == [2, 3, 4, 5]
    for position, (mixed, soft) in rest.items():
        assert torch.equal(mixed, whole[position][0]), position
        assert torch.equal(soft, whole[position][1]), position

