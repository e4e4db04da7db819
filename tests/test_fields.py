"""Samples with several fields: an image with its mask, boxes and metadata, through the server.

The reference for each sample recomputes its crop box with the server's own
function from (seed, epoch, index), as tests/test_crops.py does, then crops
the mask with Pillow (NEAREST resize on that box) and moves the boxes with
plain torch arithmetic.
"""

from __future__ import annotations

import io
import json
import os
import tarfile

import grpc
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from gpufeed.client import FeedError, Field, metadata, split
from gpufeed.server.demo import synthetic_photo
from gpufeed.server.media.decode import DecodeError, OverLimit, SourceWindow
from gpufeed.server.media.draws import sample_draws
from gpufeed.server.media.fields import SampleFields, Sidecar
from gpufeed.server.media.output import OutputTransform
from gpufeed.v1 import feed_pb2
from support import psnr, reset_peak_mb, status_mb

SIZE = (40, 48)
SEED, EPOCH = 5, 1
NUM = 12
_TRANSFORM = OutputTransform(feed_pb2.OutputSpec(
    height=SIZE[0], width=SIZE[1], resize=feed_pb2.RESIZE_RANDOM_RESIZED_CROP), SEED, EPOCH)
FIELDS = {"mask": Field(".png", tree=("images", "masks")),
          "boxes": Field(".txt", tree=("images", "labels"), max_items=8),
          "meta": ".json"}


def _write_sample(root, name: str, rng, palette: bool = False) -> None:
    """An image, a mask whose class-id rectangles are exactly its boxes, the boxes as a
    txt sidecar in labels/, and JSON metadata beside the image."""
    height, width = int(rng.integers(90, 260)), int(rng.integers(90, 260))
    pixels = synthetic_photo(rng, height, width)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=92)
    (root / "images" / "train" / f"{name}.jpg").write_bytes(out.getvalue())
    mask = Image.new("P" if palette else "L", (width, height), 0)
    if palette:
        mask.putpalette([v for c in range(256) for v in (c, 255 - c, c // 2)])
    draw = ImageDraw.Draw(mask)
    boxes = []
    for k in range(int(rng.integers(1, 6))):  # side by side, never overlapping
        x0 = k * width // 5 + int(rng.integers(0, 5))
        x1 = x0 + int(rng.integers(width // 10, width // 5 - 4))
        y0 = int(rng.integers(0, height // 2))
        y1 = int(rng.integers(y0 + 20, height))
        cls = int(rng.integers(1, 20))
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=cls)  # pixels x0..x1-1: box x0..x1
        boxes.append((x0, y0, x1, y1, cls))
    mask.save(root / "masks" / "train" / f"{name}.png")
    (root / "labels" / "train" / f"{name}.txt").write_text(
        "# x0 y0 x1 y1 class\n" + "".join(" ".join(map(str, b)) + "\n" for b in boxes))
    (root / "images" / "train" / f"{name}.json").write_text(
        json.dumps({"name": name, "boxes": len(boxes), "caption": "café"}))


def _tree(root, names, rng) -> None:
    for part in ("images", "masks", "labels"):
        (root / part / "train").mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        _write_sample(root, name, rng, palette=i % 4 == 3)


@pytest.fixture(scope="module")
def field_root(data_dir):
    root = data_dir / "fields"
    _tree(root, [f"s{i:02d}" for i in range(NUM)], np.random.default_rng(7))
    return root


def _reference(root, name: str, box, flip: bool):
    """Pillow's nearest crop of the mask on ``box``; the boxes moved in torch."""
    lines = (root / "labels" / "train" / f"{name}.txt").read_text().splitlines()[1:]
    source = torch.tensor([[float(v) for v in line.split()] for line in lines], dtype=torch.float64)
    with Image.open(root / "masks" / "train" / f"{name}.png") as mask:
        return (*_moved(mask, source, box, flip), source)


def _moved(mask: Image.Image, source: torch.Tensor, box, flip: bool):
    """(mask, boxes kept, boxes dropped) after the crop ``box``, resize and flip."""
    top, left, h, w = box
    ref = mask.resize(SIZE[::-1], Image.NEAREST, box=(left, top, left + w, top + h))
    if flip:
        ref = ref.transpose(Image.FLIP_LEFT_RIGHT)
    height, width = SIZE
    boxes = source.clone()
    boxes[:, [0, 2]] = ((source[:, [0, 2]] - left) * width / w).clamp(0, width)
    boxes[:, [1, 3]] = ((source[:, [1, 3]] - top) * height / h).clamp(0, height)
    inside = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    if flip:
        boxes[:, [0, 2]] = width - boxes[:, [2, 0]]
    return np.asarray(ref), boxes[inside], len(source) - int(inside.sum())


def _check_sample(root, name: str, index: int, batch, row: int, boxes: torch.Tensor,
                  transform: OutputTransform = _TRANSFORM, flip_probability: float = 0.5):
    """Assert the row's mask and boxes equal the reference on the sample's crop box (the
    server's own function from (seed, epoch, index)) and flip; returns (box, flip, the
    reference boxes, how many were dropped, the source boxes)."""
    with Image.open(root / "images" / "train" / f"{name}.jpg") as image:
        box = transform.box(index, image.height, image.width)
    flip = sample_draws(SEED, EPOCH, index, 1).random() < flip_probability
    ref_mask, ref_boxes, lost, source = _reference(root, name, box, flip)
    assert np.array_equal(batch["mask"][row].numpy(), ref_mask), name
    assert torch.allclose(boxes.double(), ref_boxes, atol=1e-4), (name, boxes)
    return box, flip, ref_boxes, lost, source


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_mask_and_boxes_follow_the_flipped_random_crop(feed, data_dir, field_root, transport):
    """Every sample once; its mask equals Pillow's nearest crop of the same box (flipped
    alike), its boxes equal the reference arithmetic, and each kept box still sits on
    mask pixels of its class: image, mask and boxes moved together."""
    loader = feed.loader(files="fields/images/train/", batch_size=5, size=SIZE,
                         resize="random_resized_crop", flip=0.5, seed=SEED, epoch=EPOCH,
                         transport=transport, fields=FIELDS)
    seen, flipped, dropped, clipped = [], 0, 0, 0
    for batch in loader:
        rows = len(batch["index"])
        assert batch["mask"].dtype == torch.uint8 and batch["mask"].shape == (rows, *SIZE)
        assert batch["boxes"].dtype == torch.float32 and batch["boxes"].shape[1] == 5
        assert batch["boxes_offsets"].tolist()[0] == 0 and len(batch["boxes_offsets"]) == rows + 1
        assert batch["boxes_offsets"][-1] == len(batch["boxes"])
        boxes, metas = split(batch, "boxes"), metadata(batch)
        for row, i in enumerate(batch["index"].tolist()):
            name = f"s{i:02d}"
            seen.append(i)
            box, flip, ref_boxes, lost, source = _check_sample(field_root, name, i, batch, row,
                                                               boxes[row])
            for x0, y0, x1, y1, cls in boxes[row].tolist():
                if x1 - x0 >= 2 and y1 - y0 >= 2:
                    centre = batch["mask"][row, int((y0 + y1) / 2), int((x0 + x1) / 2)]
                    assert centre == cls, (name, x0, y0, x1, y1, cls)
            assert metas[row] == {"name": name, "boxes": len(source), "caption": "café"}
            with Image.open(field_root / "images" / "train" / f"{name}.jpg") as image:
                top, left, h, w = box
                ref = image.convert("RGB").resize(SIZE[::-1], Image.BILINEAR,
                                                  box=(left, top, left + w, top + h))
            ref = np.asarray(ref.transpose(Image.FLIP_LEFT_RIGHT) if flip else ref)
            assert psnr(batch["image"][row].numpy(), ref.transpose(2, 0, 1)) >= 25, name
            flipped += flip
            dropped += lost
            clipped += int((ref_boxes[:, :4] == 0).any() or (ref_boxes[:, [0, 2]] == SIZE[1]).any()
                           or (ref_boxes[:, [1, 3]] == SIZE[0]).any())
    assert sorted(seen) == list(range(NUM))
    assert not loader.failures
    assert 0 < flipped < NUM and dropped > 0 and clipped > 0  # the cases the test is for


def test_squash_moves_boxes_by_the_scale_alone(feed, field_root):
    """A squash keeps the whole image: boxes are only scaled, none dropped; masks resized."""
    batch = next(iter(feed.loader(files=["fields/images/train/s00.jpg"], batch_size=1, size=SIZE,
                                  fields=FIELDS)))
    ref_mask, ref_boxes, lost, source = _reference(
        field_root, "s00", (0, 0, *Image.open(field_root / "masks/train/s00.png").size[::-1]),
        False)
    assert lost == 0 and len(batch["boxes"]) == len(source)
    assert torch.allclose(batch["boxes"].double(), ref_boxes, atol=1e-4)
    assert np.array_equal(batch["mask"][0].numpy(), ref_mask)


def test_a_centre_crop_box_between_pixels_moves_the_fields_too(feed, field_root):
    """A centre crop's box falls between source pixels: the mask still picks Pillow's
    nearest pixels on it, and the boxes follow the same box."""
    names = [f"s{i:02d}" for i in range(NUM)]
    loader = feed.loader(files=[f"fields/images/train/{n}.jpg" for n in names], batch_size=6,
                         size=SIZE, resize="center_crop", fields=FIELDS)
    transform = OutputTransform(feed_pb2.OutputSpec(
        height=SIZE[0], width=SIZE[1], resize=feed_pb2.RESIZE_SHORTER_CENTER_CROP), SEED, EPOCH)
    seen, between = [], 0
    for batch in loader:
        for row, (i, boxes) in enumerate(zip(batch["index"].tolist(), split(batch, "boxes"))):
            box, *_ = _check_sample(field_root, names[i], i, batch, row, boxes, transform, 0)
            between += box[0] != int(box[0]) or box[1] != int(box[1])
            seen.append(i)
    assert sorted(seen) == list(range(NUM))
    assert between > 0  # the case the test is for


def test_the_tree_rule_renames_below_the_data_root_only():
    """The last directory of that name below the root is renamed; the root's own name is
    not; a sample without one fails."""
    rule = Sidecar("mask", ".png", "images", "masks")
    assert rule.path("/srv/images/coco/images/train/x.jpg", "/srv/images") == \
        "/srv/images/coco/masks/train/x.png"
    assert rule.path("/srv/d/images/a/images/x.1.jpg", "/srv/d") == "/srv/d/images/a/masks/x.1.png"
    with pytest.raises(DecodeError, match="no directory 'images'"):
        rule.path("/srv/images/train/x.jpg", "/srv/images")


def test_a_bad_sidecar_fails_its_sample_only(feed, data_dir, tmp_path):
    """A missing mask, boxes that are not boxes, metadata that is not JSON, a mask of the
    wrong size and a mask symlinked outside the data roots each fail their sample, saying
    which field; every other sample arrives once."""
    root = data_dir / "fields_bad"
    names = [f"b{i:02d}" for i in range(8)]
    _tree(root, names, np.random.default_rng(11))
    (root / "masks" / "train" / "b01.png").unlink()
    (root / "labels" / "train" / "b02.txt").write_text("1 2 3\n")
    (root / "images" / "train" / "b03.json").write_text("{not json")
    Image.new("L", (7, 5)).save(root / "masks" / "train" / "b04.png")
    outside = tmp_path / "secret.png"
    Image.new("L", (8, 8)).save(outside)
    (root / "masks" / "train" / "b05.png").unlink()
    os.symlink(outside, root / "masks" / "train" / "b05.png")
    loader = feed.loader(files="fields_bad/images/train/", batch_size=3, size=SIZE,
                         resize="random_resized_crop", flip=0.5, seed=SEED, epoch=EPOCH,
                         fields=FIELDS, failure_budget=6)
    indices = []
    for batch in loader:  # the rows left after failed ones are closed up keep their own fields
        for row, (i, boxes) in enumerate(zip(batch["index"].tolist(), split(batch, "boxes"))):
            _check_sample(root, names[i], i, batch, row, boxes)
            indices.append(i)
    failures = dict(loader.failures)
    assert sorted(failures) == [1, 2, 3, 4, 5]
    assert sorted(indices) == [0, 6, 7]
    assert "mask: sidecar" in failures[1] and "not found" in failures[1], failures[1]
    assert "boxes: box 0 is not x0 y0 x1 y1 class" in failures[2], failures[2]
    assert "meta: not JSON" in failures[3], failures[3]
    assert "mask: 7x5, but the image is" in failures[4], failures[4]
    assert "outside the data roots" in failures[5], failures[5]
    categories = {f.index: f.category for f in loader.failures}
    assert categories[1] == "not_found" and categories[2] == "undecodable"


@pytest.mark.parametrize("fields, at", [
    ({"depth": ".png"}, "fields[0].name"),
    (["boxes", "boxes"], "fields[1].name"),
    ({"mask": Field(".png", tree=("images", ""))}, "fields[0].tree_from/tree_to"),
    ({"mask": Field(".png", tree=("images", "../x"))}, "fields[0].tree_to"),
    ({"mask": "png"}, "fields[0].suffix"),
    ({"mask": "/etc/passwd"}, "fields[0].suffix"),
    ({"meta": ".json", "boxes": Field(max_items=1 << 20)}, "fields[1].max_items"),
    ({"mask": Field(max_items=3)}, "fields[0].max_items"),
    # 65536 boxes x 20 bytes x 1024 samples: over the default --max-batch-bytes of 1 GiB
    ({"mask": ".png", "boxes": Field(max_items=1 << 16)}, "fields[1].max_items"),
])
def test_a_bad_field_declaration_is_refused_naming_it(feed, field_root, fields, at):
    with pytest.raises(FeedError) as error:
        feed.loader(files="fields/images/train/", batch_size=1024, size=SIZE, fields=fields)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert at in str(error.value), str(error.value)


def test_fields_need_image_samples(feed, data_dir):
    np.save(data_dir / "fields_array.npy", np.zeros(3, np.float32))
    with pytest.raises(FeedError) as error:
        feed.loader(files=["fields_array.npy"], batch_size=1, fields=["meta"])
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "fields: only image samples take fields" in str(error.value)


def _shard(root, names: list[str], skip_mask: str) -> bytes:
    """The loose samples as one tar shard: ``key.jpg``, ``key.seg.png`` (class ids),
    ``key.boxes.json`` (a JSON list) and ``key.json`` (metadata) per sample."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in names:
            lines = (root / "labels" / "train" / f"{name}.txt").read_text().splitlines()[1:]
            members = {
                "jpg": (root / "images" / "train" / f"{name}.jpg").read_bytes(),
                "seg.png": (root / "masks" / "train" / f"{name}.png").read_bytes(),
                "boxes.json": json.dumps([[float(v) for v in line.split()]
                                          for line in lines]).encode(),
                "json": (root / "images" / "train" / f"{name}.json").read_bytes()}
            if name == skip_mask:
                del members["seg.png"]
            for suffix, data in members.items():
                info = tarfile.TarInfo(f"{name}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_tar_shard_members_are_fields(feed, data_dir, field_root):
    """In a tar shard a field is a member extension: the same crop, nearest mask and boxes
    as loose files give; a sample without its mask member fails alone."""
    names = [f"s{i:02d}" for i in range(NUM)]
    (data_dir / "fields-0000.tar").write_bytes(_shard(field_root, names, skip_mask="s03"))
    loader = feed.loader(files=["fields-0000.tar"], batch_size=4, size=SIZE,
                         resize="random_resized_crop", flip=0.5, seed=SEED, epoch=EPOCH,
                         fields={"mask": ".seg.png", "boxes": ".boxes.json", "meta": ".json"},
                         failure_budget=1)
    seen = []
    for batch in loader:
        boxes, metas = split(batch, "boxes"), metadata(batch)
        for row, i in enumerate(batch["index"].tolist()):
            seen.append(i)
            _check_sample(field_root, names[i], i, batch, row, boxes[row])
            assert metas[row]["name"] == names[i]
    assert sorted(seen) == [i for i in range(NUM) if i != 3]
    assert list(dict(loader.failures)) == [3]
    assert "mask: sample 3 has no .seg.png member" in loader.failures[0][1]


@pytest.mark.parametrize("fields, at", [
    ({"boxes": ".txt"}, "fields[0].suffix"),
    ({"mask": ".png"}, "fields[0].suffix"),
    ({"mask": Field(".seg.png", tree=("images", "masks"))}, "fields[0].tree_from"),
])
def test_a_shard_field_must_name_its_own_member(feed, data_dir, field_root, fields, at):
    (data_dir / "fields-0001.tar").write_bytes(_shard(field_root, ["s00"], skip_mask=""))
    with pytest.raises(FeedError) as error:
        feed.loader(files=["fields-0001.tar"], batch_size=1, size=SIZE, fields=fields)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert at in str(error.value), str(error.value)


def test_a_saved_position_belongs_to_its_fields(feed, field_root):
    """Fields decide a pass's content: a state saved with other fields is refused."""
    with_fields = feed.loader(files="fields/images/train/", batch_size=4, size=SIZE,
                              fields=["meta"])
    without = feed.loader(files="fields/images/train/", batch_size=4, size=SIZE)
    with pytest.raises(ValueError, match="labels differs"):
        without.load_state_dict(with_fields.state_dict())


def _still_exact(feed, field_root) -> None:
    """Info answers, and a pass of the good samples is exact: every sample once, each mask
    and boxes equal to the reference."""
    assert feed.info().version
    seen = []
    loader = feed.loader(files="fields/images/train/", batch_size=5, size=SIZE,
                         resize="random_resized_crop", flip=0.5, seed=SEED, epoch=EPOCH,
                         fields=FIELDS)
    for batch in loader:
        for row, (i, boxes) in enumerate(zip(batch["index"].tolist(), split(batch, "boxes"))):
            _check_sample(field_root, f"s{i:02d}", i, batch, row, boxes)
            seen.append(i)
    assert sorted(seen) == list(range(NUM)) and not loader.failures


def _pass(feed, folder: str, fields, names: list[str], root) -> tuple[list[int], dict]:
    """A pass of ``folder``'s samples with ``fields``: the indices delivered (each checked
    against the reference) and the failures by index."""
    loader = feed.loader(files=folder, batch_size=3, size=SIZE, resize="random_resized_crop",
                         flip=0.5, seed=SEED, epoch=EPOCH, fields=fields, failure_budget=len(names))
    metas = {}
    for batch in loader:
        for row, (i, boxes, meta) in enumerate(zip(batch["index"].tolist(), split(batch, "boxes"),
                                                   metadata(batch))):
            _check_sample(root, names[i], i, batch, row, boxes)
            metas[i] = meta
    for i, meta in metas.items():  # a sample's own metadata (what is not a dict: checked after)
        assert not isinstance(meta, dict) or meta["name"] == names[i], (i, meta)
    return sorted(metas), {f.index: f for f in loader.failures}


def test_sidecars_over_their_bound_fail_alone_before_they_are_read(server, feed, data_dir,
                                                                   field_root):
    """Boxes and metadata sidecars are bounded by their field's max_items: a 20 MB box file
    (2M boxes) is refused by its size unread, one box over max_items is refused, metadata
    nested 2,000 or 40 deep fails as undecodable (not a server bug); every other sample
    arrives exactly, the server's memory does not grow, and it serves on."""
    root = data_dir / "fields_bounds"
    names = [f"h{i:02d}" for i in range(8)]
    _tree(root, names, np.random.default_rng(13))
    labels, images = root / "labels" / "train", root / "images" / "train"
    (labels / "h01.txt").write_text("0 0 1 1 0\n" * 2_000_000)
    (labels / "h02.txt").write_text("1 1 2 2 0\n" * 9)
    (images / "h03.json").write_text("[" * 2000 + "]" * 2000)  # under 4096 bytes
    (images / "h04.json").write_text("[" * 100_000 + "]" * 100_000)
    (images / "h05.json").write_text("[" * 40 + "]" * 40)
    before = reset_peak_mb(server.proc.pid)
    indices, failures = _pass(feed, "fields_bounds/images/train/", FIELDS, names, root)
    assert status_mb(server.proc.pid, "VmHWM") - before < 100  # MB: 2M boxes are never parsed
    assert indices == [0, 6, 7] and sorted(failures) == [1, 2, 3, 4, 5]
    expected = {
        1: ("too_large", "boxes: sidecar fields_bounds/labels/train/h01.txt is larger than the "
                         "5120 bytes that 8 boxes may take (fields[1].max_items"),
        2: ("too_large", "boxes: more than the 8 boxes per sample that fields[1].max_items "
                         "allows"),
        3: ("undecodable", "meta: not JSON: nested deeper than 32 levels"),
        4: ("too_large", "meta: sidecar fields_bounds/images/train/h04.json is larger than the "
                         "4096 bytes per sample that fields[2].max_items allows"),
        5: ("undecodable", "meta: not JSON: nested deeper than 32 levels"),
    }
    for index, (category, words) in expected.items():
        assert failures[index].category == category, failures[index]
        assert words in failures[index].reason, failures[index].reason
    _still_exact(feed, field_root)


def test_a_json_box_list_is_bounded_before_it_is_parsed(server, feed, data_dir, field_root):
    """The JSON form: a 24 MB list of 2M boxes is refused by its size unread (its parse
    would hold the GIL for seconds), nine boxes for max_items 8 by their count, a list
    nested 40 deep or not JSON as undecodable; the rest arrives exactly, memory does not
    grow, and the server serves on."""
    root = data_dir / "fields_json_bounds"
    names = [f"j{i:02d}" for i in range(7)]
    _tree(root, names, np.random.default_rng(17))
    labels = root / "labels" / "train"
    for name in names:
        lines = (labels / f"{name}.txt").read_text().splitlines()[1:]
        (labels / f"{name}.json").write_text(json.dumps([[float(v) for v in line.split()]
                                                         for line in lines], indent=2))
    (labels / "j01.json").write_text("[" + ",".join(["[0, 0, 1, 1, 0]"] * 2_000_000) + "]")
    (labels / "j02.json").write_text(json.dumps([[1, 1, 2, 2, 0]] * 9))
    (labels / "j03.json").write_text("[" * 40 + "]" * 40)
    (labels / "j04.json").write_text("[[1, 2, 3, 4, 5]")
    fields = {**FIELDS, "boxes": Field(".json", tree=("images", "labels"), max_items=8)}
    before = reset_peak_mb(server.proc.pid)
    indices, failures = _pass(feed, "fields_json_bounds/images/train/", fields, names, root)
    assert status_mb(server.proc.pid, "VmHWM") - before < 100  # MB, at its peak
    assert indices == [0, 5, 6] and sorted(failures) == [1, 2, 3, 4]
    expected = {
        1: ("too_large", "boxes: sidecar fields_json_bounds/labels/train/j01.json is larger "
                         "than the 6144 bytes that 8 boxes may take (fields[1].max_items; 256 "
                         "bytes a box"),
        2: ("too_large", "boxes: more than the 8 boxes per sample that fields[1].max_items"),
        3: ("undecodable", "boxes: not JSON: nested deeper than 32 levels"),
        4: ("undecodable", "boxes: not JSON: Expecting"),
    }
    for index, (category, words) in expected.items():
        assert failures[index].category == category, failures[index]
        assert words in failures[index].reason, failures[index].reason
    _still_exact(feed, field_root)


def test_a_shard_members_fields_are_bounded_before_they_are_parsed():
    """A tar shard's members arrive read (by the shard's own bound): their field's byte
    bound is checked before they are parsed, and parsing stops past max_items."""
    specs = [feed_pb2.FieldSpec(name="boxes", suffix=".boxes.json", max_items=8),
             feed_pb2.FieldSpec(name="meta", suffix=".json", max_items=64)]
    fields = SampleFields(specs, *SIZE)
    image = np.zeros((3, *SIZE), np.uint8)
    window = SourceWindow(SIZE[0], SIZE[1], (0, 0, SIZE[0], SIZE[1]))
    many = ("[" + ",".join(["[0, 0, 1, 1, 0]"] * 2_000_000) + "]").encode()
    with pytest.raises(OverLimit, match=r"boxes: \d+ bytes, over the 6144 bytes that 8 boxes"):
        fields.convert({"boxes": many, "meta": b"{}"}, image, window, False, 1 << 20)
    with pytest.raises(OverLimit, match="meta: 65 bytes, over the 64 bytes per sample"):
        fields.convert({"boxes": b"[]", "meta": b'"' + b"x" * 63 + b'"'}, image, window, False,
                       1 << 20)
    nine = json.dumps([[1, 1, 2, 2, 0]] * 9).encode()
    with pytest.raises(OverLimit, match="more than the 8 boxes"):
        fields.convert({"boxes": nine, "meta": b"{}"}, image, window, False, 1 << 20)
    eight = json.dumps([[1, 1, 2, 2, 0]] * 8).encode()
    sample = fields.convert({"boxes": eight, "meta": b"{}"}, image, window, False, 1 << 20)
    assert sample["boxes"].shape == (8, 5)
