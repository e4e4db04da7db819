"""JPEGs decoded a batch at a time by nvImageCodec (``--decoder nvimgcodec``), tested on
its libjpeg-turbo CPU backend: everything but the GPU itself (the batching, the regions
of interest, the resampling, the rows, the fallback to the CPU path, single failures).

The pixel rule is the CPU path's: the crop box, resampled with Pillow's bilinear
filter (widened when shrinking) over its exact sub-pixel position. Against Pillow
cropping and resizing the same box, every pixel is within 2 levels (the CPU path
rounds between passes and uses fixed-point weights; this path does neither, and
decodes the full resolution where the CPU path may let libjpeg shrink by 2-8 in the
IDCT, so it is the closer of the two).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpufeed.client import FeedClient, Field
from gpufeed.server.demo import synthetic_photo
from gpufeed.server.media import batch_jpeg, batch_resample, jpeg
from gpufeed.server.media.batch_jpeg import BatchDecoders, BatchJpegDecoder, Deferred
from gpufeed.server.media.batch_resample import (
    crop_taps,
    kernel_crops,
    resample,
    resample_weights,
)
from gpufeed.server.media.draws import sample_draws
from gpufeed.server.media.output import OutputTransform
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2

pytest.importorskip("nvidia.nvimgcodec", reason="nvImageCodec is not installed (dev extra)")

SIZE = (40, 48)
SEED, EPOCH = 4, 1
_LEVELS = 2  # the largest difference from Pillow on the same box, per pixel


def _jpeg(rng, height: int, width: int, **options) -> bytes:
    pixels = synthetic_photo(rng, height, width).astype(np.int16)
    pixels += rng.integers(-10, 11, pixels.shape, dtype=np.int16)  # detail a wrong box shows
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, "JPEG", quality=90, **options)
    return out.getvalue()


def _pillow(data: bytes, box, flip: bool, size=SIZE) -> np.ndarray:
    top, left, h, w = box
    with Image.open(io.BytesIO(data)) as image:
        ref = image.convert("RGB").resize(size[::-1], Image.BILINEAR,
                                          box=(left, top, left + w, top + h))
    if flip:
        ref = ref.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(ref).transpose(2, 0, 1)


def test_the_weights_are_the_cpu_paths_filter():
    """Boxes that grow and shrink, touch the edges, or are under a pixel, weighed a batch
    at once: each output pixel's weights sum to 1 over pixels inside the image and inside
    the box's own reach, and a box's weights do not depend on the batch it is in."""
    cases = [(0.0, 100.0, 100), (10.3, 37.7, 60), (0.0, 5.0, 5), (99.2, 0.8, 100), (0.0, 1.0, 1)]
    starts, lengths, sizes = (np.array(column) for column in zip(*cases))
    for out in (3, 40, 224):
        taps = crop_taps(starts, lengths, sizes, out)
        span = int((taps.last - taps.first).max())
        weights = resample_weights(taps, span + 3, torch.device("cpu")).numpy()
        assert weights.shape == (len(cases), out, span + 3)
        np.testing.assert_allclose(weights.sum(axis=2), 1.0, rtol=1e-6)
        assert (weights >= 0).all()
        for k, size in enumerate(sizes):
            first, last = taps.first[k], taps.last[k]
            assert 0 <= first < last <= size
            assert not weights[k, :, last - first:].any()  # nothing past the box's reach
            alone = crop_taps(starts[k:k + 1], lengths[k:k + 1], sizes[k:k + 1], out)
            np.testing.assert_array_equal(
                resample_weights(alone, span + 3, torch.device("cpu")).numpy()[0], weights[k])


def test_a_batch_of_regions_is_pillows_crop_and_resize():
    """Random boxes over images of random sizes, flipped or not, 4:2:0 and 4:4:4: every
    pixel within 2 levels of Pillow's crop-and-resize of the same box, and within 1 of
    the CPU path's where it does not shrink in the IDCT."""
    rng = np.random.default_rng(0)
    decoder = BatchJpegDecoder(torch.device("cpu"))
    for round_ in range(6):
        height, width = int(rng.integers(60, 400)), int(rng.integers(60, 400))
        data = _jpeg(rng, height, width, subsampling=0 if round_ % 2 else 2)
        jobs = []
        for row in range(8):
            box_h, box_w = float(rng.uniform(4, height)), float(rng.uniform(4, width))
            box = (float(rng.uniform(0, height - box_h)), float(rng.uniform(0, width - box_w)),
                   box_h, box_w)
            jobs.append(Deferred(row, data, box, bool(rng.random() < 0.5), (height, width)))
        out = np.full((8, 3, *SIZE), 0xAB, np.uint8)  # poisoned: every pixel must be written
        assert decoder.decode(jobs, out) == []
        for job in jobs:
            got = out[job.row].astype(np.int16)
            assert np.abs(got - _pillow(data, job.box, job.flip)).max() <= _LEVELS, job.box
            full_scale = job.box[2] < 2 * SIZE[0] or job.box[3] < 2 * SIZE[1]  # no IDCT shrink
            if jpeg.AVAILABLE and full_scale:
                cpu = np.zeros((3, *SIZE), np.uint8)
                jpeg.decode_crop(data, cpu, job.box, job.flip)
                assert np.abs(got - cpu).max() <= 1, job.box


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):
    """_resample.cu built as plain C++ (its host entry point alone): the CUDA kernel's
    per-pixel code, run on the CPU."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    built = tmp_path_factory.mktemp("kernel") / "_resample.so"
    source = Path(batch_resample.__file__).with_name("_resample.cu")
    subprocess.run([compiler, "-O2", "-fPIC", "-shared", "-x", "c++", str(source), "-o",
                    str(built)], check=True, timeout=120)
    return batch_resample.load_kernel(built)


def test_the_resample_kernel_makes_the_batched_products_pixels(host_kernel):
    """The kernel's arithmetic (its host entry point) against the torch path, on boxes that
    shrink (one by 40x), grow, touch the edges or are under a pixel, flipped or not, over
    regions read in place from their images (rows farther apart than the region is wide):
    within one level (float sums in another order), nearly all equal."""
    rng = np.random.default_rng(8)
    images, boxes, sizes = [], [], []
    for k in range(24):
        height, width = int(rng.integers(1, 300)), int(rng.integers(1, 300))
        images.append(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        box_h = float(rng.uniform(0.3, height)) if k % 4 else float(height)
        box_w = float(rng.uniform(0.3, width)) if k % 4 else float(width)
        boxes.append((float(rng.uniform(0, height - box_h)), float(rng.uniform(0, width - box_w)),
                      box_h, box_w))
        sizes.append((height, width))
    wide = rng.integers(0, 256, (60, 2000, 3), dtype=np.uint8)  # ~90 taps a column: past
    images.append(wide)                                          # the kernel's cached 32
    boxes.append((0.0, 0.0, 60.0, 2000.0))
    sizes.append(wide.shape[:2])
    boxes, sizes = np.array(boxes), np.array(sizes)
    flips = rng.random(len(images)) < 0.5
    ys = crop_taps(boxes[:, 0], boxes[:, 2], sizes[:, 0], SIZE[0])
    xs = crop_taps(boxes[:, 1], boxes[:, 3], sizes[:, 1], SIZE[1])
    regions = [torch.from_numpy(image)[ys.first[k]:ys.last[k], xs.first[k]:xs.last[k]]
               for k, image in enumerate(images)]
    padded = torch.zeros((len(regions), int((ys.last - ys.first).max()),
                          int((xs.last - xs.first).max()), 3), dtype=torch.uint8)
    for k, region in enumerate(regions):
        padded[k, :region.shape[0], :region.shape[1]] = region
    want = resample(padded, ys, xs, flips).numpy()

    crops = kernel_crops(regions, ys, xs, boxes, sizes, flips)
    got = np.full_like(want, 0xAB)  # poisoned: every pixel must be written
    assert host_kernel.gpufeed_resample_host(crops.ctypes.data, len(crops), got.ctypes.data,
                                             *SIZE) == 0
    diff = np.abs(got.astype(np.int16) - want)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99, (diff.max(), (diff == 0).mean())


def test_shared_decoders_give_each_batch_its_own_pixels():
    """The server's decoders, shared by its decode threads, each refilling one buffer with
    a batch's files: batches that grow and shrink, decoded from four threads at once,
    come out as each decoded alone by a decoder of its own."""
    rng = np.random.default_rng(3)
    batches = []
    for count, side in [(2, 60), (6, 300), (2, 80), (4, 200), (1, 120), (5, 260)]:
        jobs = []
        for row in range(count):
            height, width = side + int(rng.integers(0, 40)), side + int(rng.integers(0, 40))
            box_h, box_w = float(rng.uniform(8, height)), float(rng.uniform(8, width))
            box = (float(rng.uniform(0, height - box_h)), float(rng.uniform(0, width - box_w)),
                   box_h, box_w)
            jobs.append(Deferred(row, _jpeg(rng, height, width), box, row % 2 == 1,
                                 (height, width)))
        batches.append(jobs)
    alone = []
    for jobs in batches:
        out = np.zeros((len(jobs), 3, *SIZE), np.uint8)
        assert BatchJpegDecoder(torch.device("cpu")).decode(jobs, out) == []
        alone.append(out)
    shared = BatchDecoders(torch.device("cpu"), threads=2)

    def decode(k: int) -> np.ndarray:
        out = np.full((len(batches[k]), 3, *SIZE), 0xAB, np.uint8)
        assert shared.decode(batches[k], out) == []
        return out

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(decode, list(range(len(batches))) * 3))
    for k, out in enumerate(got):
        np.testing.assert_array_equal(out, alone[k % len(batches)], f"batch {k}")


def test_what_nvimgcodec_cannot_read_is_handed_back():
    rng = np.random.default_rng(1)
    good = _jpeg(rng, 80, 90)
    # A thumbnail in an APP1 segment, as cameras write one, ends with an end-of-image
    # marker of its own: cut after it, the file still lacks the end of its own scan.
    thumbnail = _jpeg(rng, 8, 8)
    framed = (good[:2] + b"\xff\xe1" + (len(thumbnail) + 2).to_bytes(2, "big") + thumbnail
              + good[2:])
    whole = (0.0, 0.0, 80.0, 90.0)
    jobs = [Deferred(0, good, whole, False, (80, 90)),
            Deferred(1, b"\xff\xd8\xff" + b"junk" * 40, (0.0, 0.0, 10.0, 10.0), False, (10, 10)),
            Deferred(2, good[:len(good) // 3], whole, False, (80, 90)),
            Deferred(3, good, (0.0, 0.0, 40.0, 40.0), False, (40, 45)),  # a size that lies
            Deferred(4, framed[:len(thumbnail) + 40 + len(good) // 2], whole, False, (80, 90)),
            Deferred(5, framed + b"\0" * 64, whole, False, (80, 90))]  # padded after its end
    out = np.zeros((6, 3, *SIZE), np.uint8)
    left = BatchJpegDecoder(torch.device("cpu")).decode(jobs, out)
    assert {job.row for job in left} == {1, 2, 3, 4}  # junk, cut short, a size that lies
    assert np.array_equal(out[5], out[0])
    assert np.abs(out[0].astype(np.int16) - _pillow(good, jobs[0].box, False)).max() <= _LEVELS


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """JPEGs (4:2:0 and 4:4:4, small and large), a PNG, a CMYK JPEG, a corrupt and a cut
    JPEG, and a JPEG bomb (its header declares 60000 x 60000)."""
    root = tmp_path_factory.mktemp("batchjpeg")
    rng = np.random.default_rng(2)
    files = {}
    for i in range(10):
        files[f"j{i}.jpg"] = _jpeg(rng, int(rng.integers(50, 500)), int(rng.integers(50, 500)),
                                   subsampling=0 if i % 3 == 0 else 2)
    photo = Image.fromarray(synthetic_photo(rng, 90, 120))
    png, cmyk = io.BytesIO(), io.BytesIO()
    photo.save(png, "PNG")
    photo.convert("CMYK").save(cmyk, "JPEG", quality=95)
    files["p.png"], files["cmyk.jpg"] = png.getvalue(), cmyk.getvalue()
    gray = io.BytesIO()
    photo.convert("L").save(gray, "JPEG", quality=90)  # one channel: this path, as RGB
    files["gray.jpg"] = gray.getvalue()
    files["corrupt.jpg"] = b"\xff\xd8\xff\xe0" + bytes(rng.integers(0, 256, 3000, dtype=np.uint8))
    files["cut.jpg"] = files["j1.jpg"][:len(files["j1.jpg"]) // 2]
    bomb = bytearray(files["j2.jpg"])
    at = bomb.index(b"\xff\xc0")  # the frame header: height and width after 5 bytes
    bomb[at + 5:at + 9] = (60000).to_bytes(2, "big") * 2
    files["bomb.jpg"] = bytes(bomb)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root, sorted(files)


def _batches(address: str, names: list[str], **options) -> tuple[dict, dict]:
    with FeedClient(address) as feed:
        loader = feed.loader(files=names, batch_size=4, size=SIZE, resize="random_resized_crop",
                             flip=0.5, seed=SEED, epoch=EPOCH, failure_budget=len(names),
                             **options)
        rows = {i: image.numpy().copy() for batch in loader
                for i, image in zip(batch["index"].tolist(), batch["image"])}
        failures = {f.index: f.category for f in loader.failures}
    return rows, failures


def test_a_server_decoding_a_batch_at_a_time_serves_what_the_cpu_path_serves(mixed):
    root, names = mixed
    with ServerProcess(["--data-root", str(root), "--threads", "2", "--decoder",
                        "nvimgcodec"]) as batched, \
            ServerProcess(["--data-root", str(root), "--threads", "2"]) as cpu:
        log = "".join(batched.log)
        assert "JPEG decoder: nvImageCodec" in log and "CPU backend" in log, log
        got, failed = _batches(batched.address, names)
        want, cpu_failed = _batches(cpu.address, names)
    # Every sample once: the same ones delivered, the same ones failed, alike.
    assert failed == cpu_failed and set(got) == set(want)
    assert set(got) | set(failed) == set(range(len(names)))
    assert {names[i] for i in failed} == {"corrupt.jpg", "cut.jpg", "bomb.jpg"}
    assert failed[names.index("bomb.jpg")] == "too_large"
    transform = OutputTransform(feed_pb2.OutputSpec(height=SIZE[0], width=SIZE[1],
                                                    resize=feed_pb2.RESIZE_RANDOM_RESIZED_CROP),
                                SEED, EPOCH)
    for i, image in got.items():
        data = (root / names[i]).read_bytes()
        if names[i] in ("p.png", "cmyk.jpg"):  # the decode threads' path: the CPU's rows
            assert np.array_equal(image, want[i]), names[i]
            continue
        with Image.open(io.BytesIO(data)) as im:
            box = transform.box(i, im.height, im.width)
        flip = sample_draws(SEED, EPOCH, i, 1).random() < 0.5
        diff = np.abs(image.astype(np.int16) - _pillow(data, box, flip)).max()
        assert diff <= _LEVELS, (names[i], diff)


def test_fields_and_sample_transforms_keep_the_cpu_path(mixed):
    """They need each row's pixels as it is read: such requests are decoded by the threads,
    so their rows are the CPU server's exactly."""
    root, names = mixed
    jpegs = [n for n in names if n.startswith("j")]
    with ServerProcess(["--data-root", str(root), "--threads", "2", "--decoder",
                        "nvimgcodec"]) as batched, \
            ServerProcess(["--data-root", str(root), "--threads", "2"]) as cpu:
        for options in (dict(transforms=[("random_erasing", {"p": 0.5})]),
                        dict(fields={"meta": Field(".json")})):
            if "fields" in options:
                for name in jpegs:
                    (root / name.replace(".jpg", ".json")).write_text('{"ok": 1}')
            got, _ = _batches(batched.address, jpegs, **options)
            want, _ = _batches(cpu.address, jpegs, **options)
            assert got.keys() == want.keys()
            assert all(np.array_equal(got[i], want[i]) for i in got), options


def test_without_nvimgcodec_the_server_says_what_to_install(tmp_path):
    code = ("import sys\n"
            "sys.modules['nvidia.nvimgcodec'] = None\n"
            "from gpufeed.server.__main__ import main\n"
            f"sys.exit(main(['--data-root', {str(tmp_path)!r}, '--decoder', 'nvimgcodec']))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--decoder nvimgcodec: nvImageCodec is not installed" in result.stderr
    assert "gpufeed[gpu]" in result.stderr


@pytest.mark.cuda
def test_on_the_gpu_a_batch_of_regions_is_pillows_crop_and_resize():
    """The same rule on the GPU (hardware JPEG decoder or nvJPEG's CUDA decoder)."""
    rng = np.random.default_rng(5)
    decoder = BatchJpegDecoder(torch.device("cuda:0"))
    data = _jpeg(rng, 300, 400)
    jobs = [Deferred(row, data, (float(6 * row), float(9 * row), 200.0, 250.0), row % 2 == 1,
                     (300, 400)) for row in range(16)]  # boxes within the 300 x 400 image
    out = np.full((16, 3, *SIZE), 0xAB, np.uint8)
    assert decoder.decode(jobs, out) == []
    for job in jobs:
        diff = np.abs(out[job.row].astype(np.int16) - _pillow(data, job.box, job.flip)).max()
        assert diff <= _LEVELS, (job.box, diff)


@pytest.mark.cuda
def test_on_the_gpu_the_resample_kernel_makes_the_torch_paths_pixels():
    """Where bench/gpu/prepare.sh built the kernel (the device check), a batch of random
    crops of photos of random sizes, flipped or not, resampled by it and by torch."""
    if batch_resample.load_kernel() is None:
        pytest.skip("the resample kernel is not built here (bench/gpu/prepare.sh builds it)")
    rng = np.random.default_rng(9)
    jobs = []
    for row in range(24):
        height, width = int(rng.integers(20, 500)), int(rng.integers(20, 500))
        box_h, box_w = float(rng.uniform(2, height)), float(rng.uniform(2, width))
        box = (float(rng.uniform(0, height - box_h)), float(rng.uniform(0, width - box_w)),
               box_h, box_w)
        jobs.append(Deferred(row, _jpeg(rng, height, width), box, bool(row % 2), (height, width)))
    with_kernel, with_torch = (np.full((24, 3, *SIZE), 0xAB, np.uint8) for _ in range(2))
    assert BatchJpegDecoder(torch.device("cuda:0")).decode(jobs, with_kernel) == []
    assert BatchJpegDecoder(torch.device("cuda:0"), kernel=False).decode(jobs, with_torch) == []
    diff = np.abs(with_kernel.astype(np.int16) - with_torch)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99, (diff.max(), (diff == 0).mean())


@pytest.mark.cuda
def test_a_gpu_server_decoding_a_batch_at_a_time_serves_over_cuda_ipc(mixed):
    root, names = mixed
    with ServerProcess(["--data-root", str(root), "--device", "cuda:0", "--decoder",
                        "nvimgcodec"]) as server:
        assert "JPEG decoder: nvImageCodec" in "".join(server.log)
        with FeedClient(server.address) as feed:
            loader = feed.loader(files=names, batch_size=4, size=SIZE,
                                 resize="random_resized_crop", flip=0.5, seed=SEED,
                                 epoch=EPOCH, failure_budget=len(names), transport="cuda_ipc")
            got = {i: image.cpu().numpy() for batch in loader
                   for i, image in zip(batch["index"].tolist(), batch["image"])}
            failed = {names[f.index] for f in loader.failures}
    assert failed == {"corrupt.jpg", "cut.jpg", "bomb.jpg"}
    assert set(got) | {names.index(n) for n in failed} == set(range(len(names)))
    transform = OutputTransform(feed_pb2.OutputSpec(height=SIZE[0], width=SIZE[1],
                                                    resize=feed_pb2.RESIZE_RANDOM_RESIZED_CROP),
                                SEED, EPOCH)
    for i, image in got.items():
        if names[i] in ("p.png", "cmyk.jpg"):
            continue
        data = (root / names[i]).read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            box = transform.box(i, im.height, im.width)
        flip = sample_draws(SEED, EPOCH, i, 1).random() < 0.5
        assert np.abs(image.astype(np.int16) - _pillow(data, box, flip)).max() <= _LEVELS


def test_the_module_knows_a_jpeg():
    assert batch_jpeg.takes(b"\xff\xd8\xff\xe0rest") and not batch_jpeg.takes(b"\x89PNG")
