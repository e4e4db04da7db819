"""Output transforms against references written here in plain numpy/Pillow/torch."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from gpufeed.client import FeedClient
from gpufeed.server.media.draws import sample_draws
from gpufeed.server.media.output import OutputTransform, random_resized_crop_box
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2
from support import MIN_PSNR_DB, psnr

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _reference_box(rng, height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision.transforms.RandomResizedCrop.get_params, with numpy draws."""
    area = height * width
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    if width / height < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif width / height > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _pil(path) -> Image.Image:
    return Image.open(io.BytesIO(path.read_bytes())).convert("RGB")


def _chw(image: Image.Image) -> np.ndarray:
    return np.asarray(image).transpose(2, 0, 1)


def _flip(seed, epoch, index, p) -> bool:
    return bool(p) and sample_draws(seed, epoch, index, 1).random() < p


@pytest.mark.parametrize("size", [(50, 60), (300, 200), (41, 397)])
def test_crop_geometry_is_torchvisions(size):
    for index in range(200):
        ours = random_resized_crop_box(sample_draws(7, 1, index), *size, (0.08, 1.0),
                                       (3 / 4, 4 / 3))
        assert ours == _reference_box(sample_draws(7, 1, index), *size)
    narrow = random_resized_crop_box(sample_draws(0, 0, 0), 10, 1000, (0.9, 1.0), (1.0, 1.0))
    assert narrow == _reference_box(sample_draws(0, 0, 0), 10, 1000, (0.9, 1.0), (1.0, 1.0))


def test_centre_crop_matches_resize_then_centre_crop(feed, data_dir, image_names):
    loader = feed.loader(files=image_names[:24], batch_size=8, size=(64, 64),
                         resize="center_crop", shorter_side=73)
    for batch in loader:
        for row, i in enumerate(batch["index"].tolist()):
            image = _pil(data_dir / image_names[i])
            w, h = image.size
            sw, sh = (73, int(73 * h / w)) if w <= h else (int(73 * w / h), 73)
            top, left = int(round((sh - 64) / 2.0)), int(round((sw - 64) / 2.0))
            ref = image.resize((sw, sh), Image.BILINEAR).crop((left, top, left + 64, top + 64))
            assert psnr(batch["image"][row].numpy(), _chw(ref)) >= MIN_PSNR_DB, image_names[i]


def test_centre_crop_default_shorter_side_is_torchvision_and_timms(feed, image_names):
    """Their evaluation resize is floor(size / 0.875): 109 for 96 (rounding would give 110).
    Explicit shorter sides are checked against Pillow above; the default must be one of them."""
    def images(**kwargs) -> torch.Tensor:
        loader = feed.loader(files=image_names[:16], batch_size=16, size=(96, 96),
                             resize="center_crop", **kwargs)
        return torch.cat([b["image"].clone() for b in loader])

    default = images()
    assert torch.equal(default, images(shorter_side=109))
    assert not torch.equal(default, images(shorter_side=110))


def test_random_resized_crop_and_flip_match_the_reference(feed, data_dir, image_names):
    """The crop each sample gets is torchvision's box for its (seed, epoch, index), and its
    pixels are Pillow's resize of exactly that box."""
    seed, epoch = 11, 3
    loader = feed.loader(files=image_names[:32], batch_size=8, size=(48, 48),
                         resize="random_resized_crop", flip=0.5, seed=seed, epoch=epoch)
    spec = feed_pb2.OutputSpec(height=48, width=48, resize=feed_pb2.RESIZE_RANDOM_RESIZED_CROP)
    flips = 0
    for batch in loader:
        for row, i in enumerate(batch["index"].tolist()):
            image = _pil(data_dir / image_names[i])
            top, left, h, w = _reference_box(sample_draws(seed, epoch, i), image.height,
                                             image.width)
            assert OutputTransform(spec, seed, epoch).box(i, image.height, image.width) == \
                (top, left, h, w)
            ref = image.resize((48, 48), Image.BILINEAR, box=(left, top, left + w, top + h))
            if _flip(seed, epoch, i, 0.5):
                ref, flips = ref.transpose(Image.FLIP_LEFT_RIGHT), flips + 1
            assert psnr(batch["image"][row].numpy(), _chw(ref)) >= MIN_PSNR_DB, image_names[i]
    assert 0 < flips < 32


@pytest.mark.slow
def test_same_seed_and_epoch_same_output_whatever_the_threads(data_dir, image_names):
    def run(threads: int, epoch: int) -> torch.Tensor:
        with ServerProcess(["--data-root", str(data_dir), "--threads", str(threads)]) as server, \
                FeedClient(server.address) as feed:
            loader = feed.loader(files=image_names[:40], batch_size=8, size=(32, 32),
                                 resize="random_resized_crop", flip=0.5, seed=5, epoch=epoch,
                                 shuffle=True)
            return torch.cat([b["image"].clone() for b in loader])

    one = run(1, epoch=0)
    assert torch.equal(one, run(4, epoch=0))
    assert not torch.equal(one, run(1, epoch=1))


@pytest.mark.parametrize("dtype, layout, tolerance", [
    ("float32", "NCHW", 1e-6), ("float16", "NHWC", 2e-3), ("bfloat16", "NCHW", 2e-2)])
def test_normalised_float_output(feed, image_names, dtype, layout, tolerance):
    files = image_names[:16]
    plain = torch.cat([b["image"].clone() for b in
                       feed.loader(files=files, batch_size=8, size=(20, 30), flip=1.0)])
    loader = feed.loader(files=files, batch_size=8, size=(20, 30), flip=1.0, dtype=dtype,
                         mean=MEAN, std=STD, layout=layout)
    out = torch.cat([b["image"].clone() for b in loader])
    assert out.dtype == getattr(torch, dtype)
    expected = (plain.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / \
        torch.tensor(STD).view(1, 3, 1, 1)
    if layout == "NHWC":
        assert out.shape == (16, 20, 30, 3)
        expected = expected.permute(0, 2, 3, 1)
    else:
        assert out.shape == (16, 3, 20, 30)
    assert torch.allclose(out.float(), expected, atol=tolerance * 4, rtol=tolerance)


def test_flip_one_is_a_mirror(feed, image_names):
    files = image_names[:8]
    plain = next(iter(feed.loader(files=files, batch_size=8, size=(16, 24))))["image"].clone()
    flipped = next(iter(feed.loader(files=files, batch_size=8, size=(16, 24), flip=1.0)))["image"]
    assert torch.equal(flipped, plain.flip(-1))


def test_labels_from_list_file_and_folders(feed, data_dir, image_names):
    (data_dir / "labelled.flist").write_text(
        "".join(f"{name}\t{i % 3}\n" for i, name in enumerate(image_names[:9])))
    loader = feed.loader(files="labelled.flist", batch_size=4, size=(8, 8), labels="list_file")
    assert [n for b in loader for n in b["label"].tolist()] == [i % 3 for i in range(9)]

    for folder in ("zebra", "ant"):
        (data_dir / "zoo" / folder).mkdir(parents=True, exist_ok=True)
        (data_dir / "zoo" / folder / "x.jpg").write_bytes((data_dir / image_names[0]).read_bytes())
    loader = feed.loader(files=["zoo/zebra/x.jpg", "zoo/ant/x.jpg", "zoo/zebra/x.jpg"],
                         batch_size=3, size=(8, 8), labels="folder")
    (batch,) = list(loader)
    assert loader.classes == ["ant", "zebra"]
    assert batch["label"].tolist() == [1, 0, 1]


@pytest.mark.parametrize("kwargs, words", [
    ({"dtype": "int7"}, ["output.dtype"]),
    ({"mean": MEAN, "std": STD}, ["float output.dtype"]),
    ({"resize": "center_crop", "shorter_side": 10}, ["output.shorter_side"]),
    ({"flip": 1.5}, ["output.flip_probability"]),
    ({"labels": "folder"}, ["LABELS_FROM_FOLDER", "img0000.jpg"]),
    ({"labels": "list_file"}, ["needs a list_file"]),
])
def test_bad_output_spec_is_refused(feed, kwargs, words):
    from gpufeed.client import FeedError

    with pytest.raises((FeedError, ValueError)) as info:
        list(feed.loader(files=["img0000.jpg"], batch_size=1, size=(16, 16), **kwargs))
    for word in words:
        assert word in str(info.value)
