"""Crop, then scale: each sample's box, through the real server, against Pillow on that box.

The set is made to exercise every decode path: large 4:2:0 JPEGs whose crops
are several times the output (DCT-scaled decode), 4:4:4, progressive and
grayscale JPEGs, a CMYK JPEG and PNGs (PyAV, then the same resize).
"""

from __future__ import annotations

import importlib
import io
import sys

import numpy as np
import pytest
from PIL import Image

from gpufeed.client import FeedClient
from gpufeed.server.demo import synthetic_photo
from gpufeed.server.media.draws import sample_draws
from gpufeed.server.media.output import OutputTransform
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2
from support import psnr

SIZE = (48, 56)
SEED, EPOCH = 3, 2
RESIZES = {"random_resized_crop": feed_pb2.RESIZE_RANDOM_RESIZED_CROP,
           "center_crop": feed_pb2.RESIZE_SHORTER_CENTER_CROP}


def _photo(rng, height: int, width: int) -> Image.Image:
    """A synthetic photo with sensor grain: fine detail is what a wrong box or filter shows."""
    pixels = synthetic_photo(rng, height, width).astype(np.int16)
    pixels += rng.integers(-12, 13, pixels.shape, dtype=np.int16)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def _encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


@pytest.fixture(scope="module")
def crop_files(data_dir) -> list[str]:
    rng = np.random.default_rng(99)
    files = {}
    for i in range(14):
        height, width = int(rng.integers(200, 900)), int(rng.integers(200, 900))
        files[f"crops/big{i}.jpg"] = _encoded(_photo(rng, height, width), "JPEG", quality=90)
    photo = _photo(rng, 333, 471)
    files.update({
        "crops/444.jpg": _encoded(photo, "JPEG", quality=92, subsampling=0),
        "crops/progressive.jpg": _encoded(photo, "JPEG", quality=90, progressive=True),
        "crops/gray.jpg": _encoded(photo.convert("L"), "JPEG", quality=90),
        "crops/cmyk.jpg": _encoded(photo.convert("CMYK"), "JPEG", quality=95),
        "crops/a.png": _encoded(photo, "PNG"),
        "crops/b.png": _encoded(_photo(rng, 610, 380), "PNG"),
    })
    (data_dir / "crops").mkdir(exist_ok=True)
    for name, data in files.items():
        (data_dir / name).write_bytes(data)
    return list(files)


def _reference(path, box, flip: bool) -> np.ndarray:
    """Pillow: decode, RGB, crop ``box`` (top, left, height, width), bilinear resize."""
    top, left, h, w = box
    with Image.open(io.BytesIO(path.read_bytes())) as image:
        ref = image.convert("RGB").resize(SIZE[::-1], Image.BILINEAR,
                                          box=(left, top, left + w, top + h))
    if flip:
        ref = ref.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(ref).transpose(2, 0, 1)


@pytest.mark.parametrize("resize", RESIZES)
def test_crops_match_pillow_on_the_same_box(feed, data_dir, crop_files, resize):
    """Every sample once, over shm; its box recomputed with the server's own function from
    (seed, epoch, index): mean PSNR >= 30 dB, worst >= 25 dB (the decoder's bar in
    bench/RESULTS.md, "Decoder accuracy")."""
    loader = feed.loader(files=crop_files, batch_size=8, size=SIZE, resize=resize, flip=0.5,
                         seed=SEED, epoch=EPOCH, transport="shm")
    transform = OutputTransform(feed_pb2.OutputSpec(height=SIZE[0], width=SIZE[1],
                                                    resize=RESIZES[resize]), SEED, EPOCH)
    values, scaled = {}, 0
    for batch in loader:
        for row, i in enumerate(batch["index"].tolist()):
            path = data_dir / crop_files[i]
            with Image.open(path) as image:
                box = transform.box(i, image.height, image.width)
            flip = sample_draws(SEED, EPOCH, i, 1).random() < 0.5
            values[crop_files[i]] = psnr(batch["image"][row].numpy(), _reference(path, box, flip))
            scaled += box[2] >= 2 * SIZE[0] and box[3] >= 2 * SIZE[1]
    assert sorted(values) == sorted(crop_files)
    assert scaled >= 3  # some boxes are decoded at 1/2 scale or smaller
    mean, worst = np.mean(list(values.values())), min(values.values())
    assert mean >= 30 and worst >= 25, values


def test_damage_inside_a_jpeg_fails_the_sample(data_dir, crop_files):
    """A JPEG cut short that still ends with an end-of-image marker (so the fast path takes
    it) fails: libjpeg's 'premature end of data' is an error here, not grey blocks."""
    whole = (data_dir / crop_files[0]).read_bytes()
    (data_dir / "crops" / "cut.jpg").write_bytes(whole[:len(whole) * 2 // 3] + b"\xff\xd9")
    with ServerProcess(["--data-root", str(data_dir)]) as server, \
            FeedClient(server.address) as feed:
        loader = feed.loader(files=["crops/cut.jpg", crop_files[0]], batch_size=2, size=SIZE,
                             failure_budget=1)
        indices = [i for batch in loader for i in batch["index"].tolist()]
    assert indices == [1]
    assert "not a decodable image" in dict(loader.failures)[0]


def test_without_the_extension_the_server_says_so_and_crops_right(data_dir, crop_files, tmp_path):
    """A server whose C extension cannot be imported logs that it decodes JPEGs with PyAV,
    and its crops still match Pillow on the same box."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'gpufeed.server.media._jpeg':\n"
        "            raise ImportError('hidden by the test')\n"
        "sys.meta_path.insert(0, _Hide())\n")
    with ServerProcess(["--data-root", str(data_dir)],
                       env={"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}"}) as server, \
            FeedClient(server.address) as feed:
        log = "".join(server.log)
        files = crop_files[:4]
        batch = next(iter(feed.loader(files=files, batch_size=4, size=SIZE,
                                      resize="random_resized_crop", seed=SEED, epoch=EPOCH)))
    assert "JPEG decoder: PyAV" in log and "hidden by the test" in log, log
    transform = OutputTransform(feed_pb2.OutputSpec(height=SIZE[0], width=SIZE[1],
                                                    resize=RESIZES["random_resized_crop"]),
                                SEED, EPOCH)
    for row, i in enumerate(batch["index"].tolist()):
        path = data_dir / files[i]
        with Image.open(path) as image:
            box = transform.box(i, image.height, image.width)
        assert psnr(batch["image"][row].numpy(), _reference(path, box, False)) >= 25, files[i]


def test_the_server_logs_its_jpeg_decoder(server):
    from gpufeed.server.media import jpeg

    assert jpeg.describe() in "".join(server.log)


def _filter_matrix(box0: float, length: float, size: int, out: int) -> np.ndarray:
    """The resize's weights along one axis as an [out, size] integer matrix: the C
    extension's formula (Pillow's triangle widened by the shrink factor, 14-bit)."""
    scale = length / out
    widen = max(scale, 1.0)
    taps = int(np.ceil(widen)) * 2 + 2
    matrix = np.zeros((out, size), np.int64)
    for i in range(out):
        centre = box0 + (i + 0.5) * scale
        lo = max(int(np.floor(centre - widen + 0.5)), 0)
        hi = min(int(np.floor(centre + widen + 0.5)), size, lo + taps)
        if hi <= lo:
            lo = 0 if centre < 0.5 else size - 1
            hi = lo + 1
        x = np.arange(lo, hi)
        weights = np.clip(1 - np.abs((x + 0.5 - centre) / widen), 0, None)
        matrix[i, lo:hi] = np.rint(weights / weights.sum() * (1 << 14)) if weights.sum() > 0 \
            else (x == lo) << 14
    return matrix


def _apply(matrix: np.ndarray, pixels: np.ndarray) -> np.ndarray:
    """One pass: weights times pixels along axis 0, rounded and clamped to 0..255."""
    return ((np.tensordot(matrix, pixels.astype(np.int64), 1) + (1 << 13)) >> 14).clip(0, 255)


@pytest.fixture(params=["wide", "sse2"])
def resize_variant(request):
    """The resize's passes are compiled for AVX2 and for SSE2: both run."""
    from gpufeed.server.media import jpeg
    if not jpeg.AVAILABLE:
        pytest.skip("the JPEG fast path's extension is not built")
    native = importlib.import_module("gpufeed.server.media._jpeg")
    if native.use_wide(request.param == "wide") != (request.param == "wide"):
        pytest.skip("no AVX2 passes on this CPU or compiler")
    yield request.param
    native.use_wide(True)


@pytest.mark.usefixtures("resize_variant")
@pytest.mark.parametrize("out_size", [(224, 224), (37, 53), (301, 300), (1, 1)])
def test_the_resize_is_its_formula_to_the_integer(out_size):
    """The vectorised passes (AVX2 and SSE2) give exactly what the formula gives, lane
    order, tails and flips included; the PSNR tests above could miss a pixel or a
    channel out of place in a smooth image, this cannot."""
    from gpufeed.server.media import jpeg
    rng = np.random.default_rng(5)
    image = rng.integers(0, 256, (395, 457, 3), dtype=np.uint8)
    out = np.empty((3, *out_size), np.uint8)
    boxes = [(0.0, 0.0, 395.0, 457.0), (10.25, 3.5, 200.0, 333.75), (150.0, 400.0, 40.0, 57.0)]
    for box in boxes:
        top, left, height, width = box
        rows = _filter_matrix(top, height, image.shape[0], out_size[0])
        cols = _filter_matrix(left, width, image.shape[1], out_size[1])
        expected = _apply(cols, _apply(rows, image).transpose(1, 0, 2)).transpose(2, 1, 0)
        for flip in (False, True):
            jpeg.resize_rgb(image, out, box, flip)
            want = expected[:, :, ::-1] if flip else expected
            np.testing.assert_array_equal(out, want, err_msg=f"box {box}, flip {flip}")


@pytest.mark.parametrize("subsampling", [0, 1, 2], ids=["444", "422", "420"])
def test_a_window_on_an_imcu_boundary_decodes_as_in_the_whole_image(subsampling):
    """The fast path decodes only the iMCU columns under a box; chroma upsampling takes a
    column's colour from its neighbours, so the window keeps a column to spare on each
    side. At 1:1 every crop, its edges on an iMCU boundary or not, equals that crop of
    Pillow's decode of the whole image (libjpeg-turbo both), exactly."""
    from gpufeed.server.media import jpeg

    if not jpeg.AVAILABLE:
        pytest.skip("the JPEG fast path is not built here")
    rng = np.random.default_rng(subsampling)
    for _ in range(12):
        height, width = int(rng.integers(80, 300)), int(rng.integers(80, 300))
        data = _encoded(_photo(rng, height, width), "JPEG", quality=90, subsampling=subsampling)
        with Image.open(io.BytesIO(data)) as im:
            whole = np.asarray(im.convert("RGB"))
        for _ in range(8):
            box_w, box_h = int(rng.integers(8, 64)), int(rng.integers(8, 64))
            left = 16 * int(rng.integers(0, (width - box_w) // 16 + 1))  # on a boundary
            if rng.random() < 0.5:  # or its right edge on one
                left = max(0, (left + box_w) // 16 * 16 - box_w)
            top = int(rng.integers(0, height - box_h + 1))
            out = np.zeros((3, box_h, box_w), np.uint8)
            jpeg.decode_crop(data, out, (top, left, box_h, box_w))
            want = whole[top:top + box_h, left:left + box_w].transpose(2, 0, 1)
            assert np.array_equal(out, want), (width, height, left, top, box_w, box_h)
