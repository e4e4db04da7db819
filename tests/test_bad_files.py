"""A data set's worst files, mixed into good ones: each bad one fails alone, nothing else does."""

from __future__ import annotations

import io
import struct
import zlib

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from gpufeed.client import FeedClient, FeedError
from gpufeed.server.demo import synthetic_photo
from gpufeed.server.process import ServerProcess
from support import MIN_PSNR_DB, psnr, status_mb

SIZE = (40, 48)


def _save(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header declaring width x height, with almost no data behind it."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def _jpeg_bomb(small_jpeg: bytes, width: int, height: int) -> bytes:
    """A real JPEG whose frame header is rewritten to declare width x height."""
    at = small_jpeg.index(b"\xff\xc0")
    return small_jpeg[:at + 5] + struct.pack(">HH", height, width) + small_jpeg[at + 9:]


def _exif_rotated(image: Image.Image) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    return _save(image, "JPEG", quality=90, exif=exif)


def _animated_gif(frames: list[Image.Image]) -> bytes:
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return out.getvalue()


@pytest.fixture(scope="module")
def odd_files(data_dir):
    """name -> (bytes, None if it must fail, else the Pillow image it must look like)."""
    rng = np.random.default_rng(5)
    photo = Image.fromarray(synthetic_photo(rng, 90, 120))
    rgba = photo.copy()
    rgba.putalpha(Image.fromarray((np.arange(120)[None, :].repeat(90, 0) * 2).astype(np.uint8)))
    good_jpeg = _save(photo, "JPEG", quality=90)
    sixteen = Image.fromarray(np.asarray(photo.convert("L")).astype(np.uint16) * 257)
    frames = [Image.fromarray(synthetic_photo(rng, 90, 120)) for _ in range(3)]
    files = {
        "truncated.jpg": (good_jpeg[:len(good_jpeg) // 2], None),
        "empty.jpg": (b"", None),
        "text.jpg": (b"not an image at all\n" * 50, None),
        "bomb.jpg": (_jpeg_bomb(good_jpeg, 60000, 60000), None),
        "bomb.png": (_png_bomb(50000, 50000), None),
        "cmyk.jpg": (_save(photo.convert("CMYK"), "JPEG", quality=95), photo),
        "gray.jpg": (_save(photo.convert("L"), "JPEG", quality=95), photo.convert("L")),
        "progressive.jpg": (_save(photo, "JPEG", quality=90, progressive=True), photo),
        "alpha.png": (_save(rgba, "PNG"), photo),
        "16bit.png": (_save(sixteen, "PNG"), photo.convert("L")),
        "palette.png": (_save(photo.quantize(64), "PNG"), photo.quantize(64)),
        "animated.gif": (_animated_gif(frames), frames[0].quantize(256)),
        "lossless.webp": (_save(photo, "WEBP", lossless=True), photo),
        "image.bmp": (_save(photo, "BMP"), photo),
        "image.tiff": (_save(photo, "TIFF"), photo),
        "exif-rotated.jpg": (_exif_rotated(photo), photo),  # pixels as stored: no rotation
    }
    for name, (data, _) in files.items():
        (data_dir / "odd" / name).parent.mkdir(exist_ok=True)
        (data_dir / "odd" / name).write_bytes(data)
    return files


def test_bad_files_fail_alone_among_200_good(data_dir, image_names, odd_files):
    names = [f"odd/{n}" for n in odd_files]
    files = image_names[:100] + names + image_names[100:200]
    with ServerProcess(["--data-root", str(data_dir), "--max-pixels", "50000000"]) as server, \
            FeedClient(server.address) as feed:
        loader = feed.loader(files=files, batch_size=16, size=SIZE, failure_budget=10,
                             transport="shm")
        got = {int(i): batch["image"][row].clone() for batch in loader
               for row, i in enumerate(batch["index"])}
        peak_mb = status_mb(server.proc.pid, "VmHWM")
    failed = dict(loader.failures)
    must_fail = {100 + k for k, (_, ref) in enumerate(odd_files.values()) if ref is None}
    assert set(failed) == must_fail, failed
    assert sorted(got) == sorted(set(range(len(files))) - must_fail)  # every other sample once
    reasons = {names[i - 100]: failed[i] for i in failed}
    assert reasons["odd/empty.jpg"] == "odd/empty.jpg: empty file"
    assert "60000x60000" in reasons["odd/bomb.jpg"] and "--max-pixels" in reasons["odd/bomb.jpg"]
    assert "50000x50000" in reasons["odd/bomb.png"]
    # A decoded 60000 x 60000 frame alone would take 5.4 GB; nothing near was allocated.
    assert peak_mb < 1000, peak_mb
    for k, (name, (_, ref)) in enumerate(odd_files.items()):
        if ref is not None:
            want = np.asarray(ref.convert("RGB").resize(SIZE[::-1], Image.BILINEAR))
            assert psnr(got[100 + k].numpy(), want.transpose(2, 0, 1)) >= MIN_PSNR_DB, name


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_a_batch_whose_every_sample_failed_is_not_yielded(feed, transport):
    """An empty batch gives a NaN loss: it is skipped, its failures listed, and the
    position moves past it (the last batch of the pass included)."""
    files = ["gone0.jpg", "gone1.jpg", "img0000.jpg", "img0001.jpg", "gone2.jpg", "gone3.jpg"]
    loader = feed.loader(files=files, batch_size=2, size=(8, 8), transport=transport)
    assert [batch["index"].tolist() for batch in loader] == [[2, 3]]
    assert sorted(index for index, _ in loader.failures) == [0, 1, 4, 5]
    state = loader.state_dict()
    assert (state["epoch"], state["samples_consumed"]) == (1, 0)  # the pass ran to its end
    # Resuming after the skipped batch gives the rest of the pass, no more.
    loader.load_state_dict({**state, "epoch": 0, "samples_consumed": 2})
    assert [batch["index"].tolist() for batch in loader] == [[2, 3]]


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_every_rank_yields_len_loader_batches_when_a_whole_batch_fails(feed, data_dir,
                                                                         transport):
    """A rank one batch short hangs DDP at the epoch's end: split over ranks, a batch
    whose every sample failed still goes out, with one row repeating the next sample of
    the list that decodes (a real sample with its label, marked padded)."""
    (data_dir / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg at all")
    files = ["broken.jpg", "img0000.jpg"]
    loaders = [feed.loader(files=files, batch_size=1, size=(8, 8), labels=[7, 9], rank=rank,
                           world_size=2, failure_budget=5, transport=transport)
               for rank in range(2)]
    ranks = [[{k: t.clone() for k, t in batch.items()} for batch in loader]
             for loader in loaders]
    assert [len(batches) for batches in ranks] == [len(loader) for loader in loaders] == [1, 1]
    (refill,), (own,) = ranks
    assert refill["index"].tolist() == [1] and refill["padded"].tolist() == [True]
    assert refill["label"].tolist() == [9]
    assert torch.equal(refill["image"], own["image"])  # the same sample, the same pixels
    assert own["padded"].tolist() == [False]
    assert [index for index, _ in loaders[0].failures] == [0]  # the failure still listed
    assert loaders[1].failures == []


def test_a_split_with_nothing_to_pad_an_empty_batch_with_ends_with_data_loss(feed):
    """No sample of the list decodes: no row to stand in, so the pass ends, saying why."""
    loader = feed.loader(files=["gone0.jpg", "gone1.jpg"], batch_size=1, size=(8, 8),
                         rank=0, world_size=2, failure_budget=5)
    with pytest.raises(FeedError) as error:
        list(loader)
    assert error.value.code == grpc.StatusCode.DATA_LOSS
    assert "no sample to pad it with" in str(error.value)
