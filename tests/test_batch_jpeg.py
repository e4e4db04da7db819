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
from gpufeed.server.config import Limits
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
from gpufeed.server.media.samples import Decoders
from gpufeed.server.memory.cuda_ipc import _host_written_spans
from gpufeed.server.memory.heap import HeapSlots
from gpufeed.server.memory.slots import batch_fields
from gpufeed.server.process import ServerProcess
from gpufeed.server.serving.planning.plan import plan_stream
from gpufeed.server.serving.running.pool import DecodePool
from gpufeed.server.serving.running.stream import Stream
from gpufeed.server.storage.roots import Storage
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


def test_a_batch_decoded_whole_goes_to_the_device_rows_alone():
    """Offered the rows where the trainer reads the batch (cuda_ipc's device slot: here a
    CPU tensor stands in for it), the decoder writes them there when every row is a JPEG
    it decodes, and leaves the host rows as they were; when one is handed back, the
    pixels all go to the host rows, where the CPU path adds the rest. Rows that are not
    the jobs' are refused: pixels written there would be read as others'."""
    rng = np.random.default_rng(6)
    files = [_jpeg(rng, int(rng.integers(60, 200)), int(rng.integers(60, 200))) for _ in range(5)]
    sizes = [Image.open(io.BytesIO(data)).size[::-1] for data in files]
    jobs = [Deferred(row, data, (3.0, 5.0, size[0] - 9.5, size[1] - 7.25), row % 2 == 0, size)
            for row, (data, size) in enumerate(zip(files, sizes))]
    jobs = [jobs[k] for k in (3, 0, 4, 1, 2)]  # decode threads defer rows in any order
    decoder = BatchJpegDecoder(torch.device("cpu"))
    want = np.zeros((5, 3, *SIZE), np.uint8)
    assert decoder.decode(jobs, want) == []

    host = np.full((6, 3, *SIZE), 0xAB, np.uint8)  # a slot of 6 rows, for a batch of 5
    device = torch.full((5, 3, *SIZE), 0xAB, dtype=torch.uint8)
    assert decoder.decode(jobs, host, device) == []
    np.testing.assert_array_equal(device.numpy(), want)
    assert (host == 0xAB).all()

    junk = Deferred(5, b"\xff\xd8\xff" + b"junk" * 40, (0.0, 0.0, 9.0, 9.0), False, (10, 10))
    device = torch.full((6, 3, *SIZE), 0xAB, dtype=torch.uint8)
    assert decoder.decode([*jobs, junk], host, device) == [junk]
    np.testing.assert_array_equal(host[:5], want)
    assert (device.numpy() == 0xAB).all()

    for rows in (torch.zeros((6, 3, *SIZE), dtype=torch.uint8),  # a row not deferred
                 torch.zeros((5, 3, *SIZE[::-1]), dtype=torch.uint8),
                 torch.zeros((5, 3, *SIZE), dtype=torch.float32)):
        with pytest.raises(ValueError, match="device_out"):
            decoder.decode(jobs, host, rows)
    with pytest.raises(ValueError, match="not its rows"):
        decoder.decode(jobs[1:], host, torch.zeros((4, 3, *SIZE), dtype=torch.uint8))


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


class _CpuTwinSlots(HeapSlots):
    """cuda_ipc's slot memory with a CPU tensor for its ring on the GPU: the batch decode
    may write a slot's pixels there (``device_views``), and ``publish`` does what
    DeviceRing.publish does on a GPU, on the CPU: it copies the spans the host wrote
    (all but the pixels, for a batch decoded there) to the twin and runs the batch pass
    on the twin."""

    def __init__(self, plan):
        super().__init__(plan)
        self.twin = torch.zeros(len(self.host), dtype=torch.uint8)

    def twin_views(self, slot: int) -> dict[str, torch.Tensor]:
        size = self._plan.layout.slot_bytes
        return self._plan.layout.views(self.twin[slot * size:(slot + 1) * size])

    def device_views(self, slot: int) -> dict[str, torch.Tensor]:
        return self.twin_views(slot)

    def filled(self, slot, rows: int) -> None:
        pass  # the batch pass runs on the twin (publish)

    def publish(self, batch):
        size = self._plan.layout.slot_bytes
        host = torch.frombuffer(self.host, dtype=torch.uint8)[batch.slot * size:][:size]
        twin = self.twin[batch.slot * size:][:size]
        for begin, end in _host_written_spans(self._plan.layout, batch.pixels_on_device):
            twin[begin:end] = host[begin:end]
        if batch.rows and self._plan.transform is not None:
            self._plan.transform.finish_slot(self.twin_views(batch.slot), batch.rows)
        return batch_fields(batch, self._plan.layout), None


def _stream_rows(root: Path, names: list[str], output: feed_pb2.OutputSpec, batch_decode: bool,
                 name_room: int | None = None
                 ) -> tuple[dict[int, np.ndarray], set[int], list[bool]]:
    """A stream of ``names`` in batches of 4, in order, served from a ``_CpuTwinSlots``:
    (index: the row the trainer reads, the failed indices, each batch's pixels_on_device).
    ``name_room``: the stream sends names, and a name over so many bytes fails its sample
    (as one over PATH_MAX does) after the sample's read."""
    request = feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=names), batch_size=4,
                                     output=output, seed=SEED, epoch=EPOCH,
                                     max_failures=len(names), names=name_room is not None)
    storage = Storage([str(root)])
    plan = plan_stream(request, storage, Limits(), (feed_pb2.TRANSPORT_INLINE,),
                       batch_decode=batch_decode)
    if name_room is not None:
        assert plan.names is not None
        plan.names.room = name_room
    memory = _CpuTwinSlots(plan)
    shared = BatchDecoders(torch.device("cpu"), threads=2) if batch_decode else None
    pool = DecodePool(2, lambda: Decoders(batch=shared))
    stream = Stream(plan, storage, pool, memory)
    rows, failed, on_device = {}, set(), []
    try:
        stream.start()
        for batch in stream.published():
            memory.publish(batch)
            views = memory.twin_views(batch.slot)
            for i, image in zip(views["index"][:batch.rows].tolist(), views["image"][:batch.rows]):
                rows[i] = image.numpy().copy()
            failed |= {index for index, _, _ in batch.failures}
            on_device.append(batch.pixels_on_device)
            stream.release([batch.seq])
    finally:
        stream.close()
        pool.close()
    return rows, failed, on_device


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_a_batch_decoded_whole_is_read_from_the_device_slot(mixed, dtype):
    """With cuda_ipc the trainer reads the slot on the GPU (here a CPU twin of it): an
    all-JPEG batch is decoded straight into it, a batch with a PNG or a failed file goes
    through the host, and every row the trainer reads is right either way, also where
    the batch pass makes a float image of the decoded pixels."""
    root, names = mixed
    order = ["j0.jpg", "j1.jpg", "j2.jpg", "j3.jpg",  # JPEGs alone
             "j4.jpg", "p.png", "j5.jpg", "j6.jpg",  # a PNG: the decode threads' row
             "j7.jpg", "corrupt.jpg", "j8.jpg", "gray.jpg",  # a failure
             "j9.jpg", "cmyk.jpg", "cut.jpg", "bomb.jpg",
             "j5.jpg", "j1.jpg"]  # a last batch of 2 rows in a slot of 4
    normalise = dict(mean=[0.5, 0.4, 0.3], std=[0.2, 0.25, 0.3]) if dtype == "float32" else {}
    output = feed_pb2.OutputSpec(height=SIZE[0], width=SIZE[1], dtype=dtype, flip_probability=0.5,
                                 resize=feed_pb2.RESIZE_RANDOM_RESIZED_CROP, **normalise)
    got, failed, on_device = _stream_rows(root, order, output, batch_decode=True)
    want, cpu_failed, _ = _stream_rows(root, order, output, batch_decode=False)
    assert on_device == [True, False, False, False, True]
    assert failed == cpu_failed == {9, 14, 15} and set(got) == set(want)
    assert set(got) | failed == set(range(len(order)))
    _assert_rows(root, order, output, got, want)


def test_a_row_failed_after_its_read_is_not_left_in_the_device_slot(mixed):
    """A sample can fail after its read was left for the batch decode (its name over its
    room): its batch closes the gap on the host, so it must not be decoded into the
    device slot, where the rows after it would keep their places and labels would name
    the wrong images."""
    root, _ = mixed
    order = ["j0.jpg", "j1.jpg", "gray.jpg", "j3.jpg", "j4.jpg", "j5.jpg", "j6.jpg", "j7.jpg"]
    output = feed_pb2.OutputSpec(height=SIZE[0], width=SIZE[1])
    got, failed, on_device = _stream_rows(root, order, output, batch_decode=True, name_room=6)
    assert failed == {2} and set(got) == set(range(len(order))) - {2}
    assert on_device == [False, True]
    _assert_rows(root, order, output, got, {})


def _assert_rows(root: Path, order: list[str], output: feed_pb2.OutputSpec,
                 got: dict[int, np.ndarray], cpu: dict[int, np.ndarray]) -> None:
    """Each JPEG's row within ``_LEVELS`` of Pillow on its box (a float row's levels back
    from its normalisation); a PNG's or CMYK JPEG's, the CPU path's row in ``cpu``."""
    transform = OutputTransform(output, SEED, EPOCH)
    for i, image in got.items():
        if order[i] in ("p.png", "cmyk.jpg"):  # the decode threads' path: the CPU's rows
            np.testing.assert_array_equal(image, cpu[i], order[i])
            continue
        data = (root / order[i]).read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            box = transform.box(i, im.height, im.width)
        reference = _pillow(data, box, transform.choose(i)[1]).astype(np.float32)
        if output.mean:  # the levels back from (x / 255 - mean) / std
            image = (image * np.array(output.std)[:, None, None]
                     + np.array(output.mean)[:, None, None]) * 255
        assert np.abs(image - reference).max() <= _LEVELS + 1e-3, (order[i], i)


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
@pytest.mark.parametrize("normalise", [{}, dict(dtype="float32", mean=[0.5, 0.4, 0.3],
                                                std=[0.2, 0.25, 0.3])])
def test_a_gpu_server_decoding_a_batch_at_a_time_serves_over_cuda_ipc(mixed, normalise):
    """The batches the trainer reads on the GPU: those of JPEGs alone decoded straight
    into its slot there, the others through the host ring (test_a_batch_decoded_whole_..
    shows which goes where), a float image made there of either."""
    root, names = mixed
    with ServerProcess(["--data-root", str(root), "--device", "cuda:0", "--decoder",
                        "nvimgcodec"]) as server:
        assert "JPEG decoder: nvImageCodec" in "".join(server.log)
        with FeedClient(server.address) as feed:
            loader = feed.loader(files=names, batch_size=4, size=SIZE,
                                 resize="random_resized_crop", flip=0.5, seed=SEED,
                                 epoch=EPOCH, failure_budget=len(names), transport="cuda_ipc",
                                 **normalise)
            got = {i: image.cpu().numpy() for batch in loader
                   for i, image in zip(batch["index"].tolist(), batch["image"])}
            failed = {names[f.index] for f in loader.failures}
    assert failed == {"corrupt.jpg", "cut.jpg", "bomb.jpg"}
    assert set(got) | {names.index(n) for n in failed} == set(range(len(names)))
    output = feed_pb2.OutputSpec(height=SIZE[0], width=SIZE[1], flip_probability=0.5,
                                 resize=feed_pb2.RESIZE_RANDOM_RESIZED_CROP, **normalise)
    _assert_rows(root, names, output, {i: image for i, image in got.items()
                                       if names[i] not in ("p.png", "cmyk.jpg")}, {})


def test_the_module_knows_a_jpeg():
    assert batch_jpeg.takes(b"\xff\xd8\xff\xe0rest") and not batch_jpeg.takes(b"\x89PNG")
