"""ImageFolder trees: a directory as samples, and folder labels numbered from the class folders.

The reference order and classes are computed here the way torchvision's
ImageFolder documents them (sorted class folders; within one, ``os.walk``
sorted by directory, files sorted), without calling gpufeed's listing.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from gpufeed.client import FeedClient, FeedError, names
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess

CLASSES = ["cat", "dog", "fish"]
MAX_SAMPLES = 40


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """root/train/{cat,cat-x,dog,fish}/..., root/val/ with only cat and fish files, odd entries."""
    root = tmp_path_factory.mktemp("tree")
    rng = np.random.default_rng(7)

    def image(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_jpeg(synthetic_photo(rng, 24, 32)))

    for c, name in enumerate(CLASSES):
        for i in range(3 + c):
            image(root / "train" / name / f"{name}{i}.jpg")
    image(root / "train" / "cat" / "more" / "deep.JPEG")  # nested, upper-case suffix
    image(root / "train" / "cat-x" / "sorted.jpg")  # "cat-x" < "cat/more" as strings
    (root / "train" / "dog" / "notes.txt").write_text("not a sample")
    for name in ("cat", "fish"):
        image(root / "val" / name / f"{name}.jpg")
    (root / "val" / "dog").mkdir()
    (root / "val" / "cat-x").mkdir()
    outside = tmp_path_factory.mktemp("outside")
    image(outside / "secret" / "s.jpg")
    (root / "escape").mkdir()
    (root / "escape" / "link").symlink_to(outside / "secret")
    for i in range(MAX_SAMPLES + 1):
        image(root / "big" / "c" / f"{i:03d}.jpg")
    return root


@pytest.fixture(scope="module")
def feed(tree):
    with ServerProcess(["--data-root", str(tree), "--threads", "2",
                        "--max-samples", str(MAX_SAMPLES)]) as server, \
            FeedClient(server.address) as client:
        yield client


def _imagefolder(directory: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """(classes, [(path relative to directory, label)]) as ImageFolder finds them."""
    extensions = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
    classes = sorted(e.name for e in os.scandir(directory) if e.is_dir())
    samples = []
    for label, name in enumerate(classes):
        for parent, _, files in sorted(os.walk(directory / name, followlinks=True)):
            for file in sorted(files):
                if file.lower().endswith(extensions):
                    samples.append((os.path.relpath(os.path.join(parent, file), directory), label))
    return classes, samples


def _labelled(loader) -> dict[int, int]:
    return {i: label for batch in loader
            for i, label in zip(batch["index"].tolist(), batch["label"].tolist())}


@pytest.mark.parametrize("files", ["train/", "train", ["train/"]])
def test_a_directory_lists_its_files_in_imagefolder_order(feed, tree, files):
    classes, expected = _imagefolder(tree / "train")
    loader = feed.loader(files=files, batch_size=4, size=(8, 8), labels="folder")
    got = _labelled(loader)
    assert loader.failures == []
    assert loader.classes == classes == ["cat", "cat-x", "dog", "fish"]
    assert sorted(got) == list(range(len(expected)))  # every file once, nothing else
    assert [got[i] for i in range(len(expected))] == [label for _, label in expected]


def test_a_directory_in_a_list_is_expanded_in_place(feed, tree):
    _, expected = _imagefolder(tree / "val")
    loader = feed.loader(files=["train/dog/dog0.jpg", "val/", "train/dog/dog1.jpg"],
                         batch_size=8, size=(8, 8))
    (batch,) = list(loader)
    assert batch["index"].tolist() == list(range(len(expected) + 2))


def test_a_validation_list_missing_a_class_keeps_the_training_labels(feed):
    train_files = ["train/cat/cat0.jpg", "train/cat-x/sorted.jpg", "train/dog/dog0.jpg",
                   "train/fish/fish0.jpg"]
    train = feed.loader(files=train_files, batch_size=4, size=(8, 8), labels="folder")
    assert _labelled(train) == {0: 0, 1: 1, 2: 2, 3: 3}
    # val/ has cat and fish files, and empty cat-x and dog folders: no number moves.
    val = feed.loader(files=["val/fish/fish.jpg", "val/cat/cat.jpg"], batch_size=2,
                      size=(8, 8), labels="folder")
    assert _labelled(val) == {0: 3, 1: 0}
    assert val.classes == train.classes == ["cat", "cat-x", "dog", "fish"]


def test_explicit_classes_number_the_labels(feed):
    files = ["val/fish/fish.jpg", "val/cat/cat.jpg"]
    loader = feed.loader(files=files, batch_size=2, size=(8, 8), labels="folder",
                         classes=["fish", "bird", "cat"])
    assert _labelled(loader) == {0: 0, 1: 2}
    assert loader.classes == ["fish", "bird", "cat"]


@pytest.mark.parametrize("kwargs, code, words", [
    # A file whose folder is not a class: named, whatever the classes' source.
    ({"files": ["val/cat/cat.jpg", "train/dog/dog0.jpg"], "classes": ["cat"]},
     grpc.StatusCode.INVALID_ARGUMENT, ["samples[1]", "train/dog/dog0.jpg", "'dog'"]),
    ({"files": ["val/cat/cat.jpg", "val/bird/b.jpg"]},
     grpc.StatusCode.INVALID_ARGUMENT, ["samples[1]", "val/bird/b.jpg", "'bird'", "not a class"]),
    ({"files": ["val/cat/cat.jpg", "train/cat/cat0.jpg"]},
     grpc.StatusCode.INVALID_ARGUMENT, ["different dataset directories", "'val'", "'train'"]),
    ({"files": ["nowhere/cat/x.jpg"]}, grpc.StatusCode.NOT_FOUND, ["'nowhere'"]),
    ({"files": ["val/"], "classes": ["cat", "cat"]}, grpc.StatusCode.INVALID_ARGUMENT,
     ["classes", "distinct"]),
])
def test_folder_labels_refuse_what_they_cannot_number(feed, kwargs, code, words):
    with pytest.raises(FeedError) as info:
        list(feed.loader(batch_size=2, size=(8, 8), labels="folder", **kwargs))
    assert info.value.code == code
    for word in words:
        assert word in str(info.value)


def test_a_file_directly_in_a_listed_directory_has_no_class(feed, tree):
    (tree / "flat").mkdir()
    (tree / "flat" / "a").mkdir()
    (tree / "flat" / "a" / "x.jpg").write_bytes((tree / "val" / "cat" / "cat.jpg").read_bytes())
    (tree / "flat" / "top.jpg").write_bytes((tree / "val" / "cat" / "cat.jpg").read_bytes())
    with pytest.raises(FeedError) as info:
        list(feed.loader(files="flat/", batch_size=2, size=(8, 8), labels="folder"))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "flat/top.jpg" in str(info.value) and "class folder" in str(info.value)
    # Without folder labels the same directory serves both files, top-level first.
    (batch,) = list(feed.loader(files="flat/", batch_size=2, size=(8, 8)))
    assert batch["index"].tolist() == [0, 1]


def test_a_failed_sample_of_a_directory_names_its_file(feed, tree):
    """A trainer that named a directory has no list to look a failed index up in: the
    failure says which file it was, as the request would name it."""
    (tree / "broken" / "cat").mkdir(parents=True)
    (tree / "broken" / "cat" / "a.jpg").write_bytes((tree / "val" / "cat" / "cat.jpg").read_bytes())
    (tree / "broken" / "cat" / "b.jpg").write_bytes(b"not a JPEG")
    loader = feed.loader(files="broken/", batch_size=2, size=(8, 8), labels="folder")
    assert [b["index"].tolist() for b in loader] == [[0]]
    ((index, reason),) = loader.failures
    assert index == 1 and reason.startswith("broken/cat/b.jpg: not a supported image format")


@pytest.mark.parametrize("files, code, words", [
    ("escape/", grpc.StatusCode.PERMISSION_DENIED, ["escape/link", "outside the data roots"]),
    ("big/", grpc.StatusCode.RESOURCE_EXHAUSTED, ["'big/'", "--max-samples"]),
    (["val/"] * 20 + ["big/c/000.jpg"] * 2, grpc.StatusCode.RESOURCE_EXHAUSTED,
     ["42 samples", "--max-samples"]),
    (["val/dog"], grpc.StatusCode.INVALID_ARGUMENT, ["val/dog", "no image"]),
    ("../", grpc.StatusCode.PERMISSION_DENIED, ["list_file"]),
])
def test_directories_stay_within_the_roots_and_limits(feed, files, code, words):
    with pytest.raises(FeedError) as info:
        list(feed.loader(files=files, batch_size=2, size=(8, 8)))
    assert info.value.code == code
    for word in words:
        assert word in str(info.value)


def test_a_symlink_loop_is_refused(feed, tree):
    (tree / "loop" / "a").mkdir(parents=True)
    (tree / "loop" / "a" / "x.jpg").write_bytes((tree / "val" / "cat" / "cat.jpg").read_bytes())
    (tree / "loop" / "a" / "again").symlink_to(tree / "loop" / "a")
    with pytest.raises(FeedError) as info:
        list(feed.loader(files="loop/", batch_size=2, size=(8, 8)))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "loop/a/again" in str(info.value) and "listed already" in str(info.value)


def test_file_names_that_are_not_utf8_are_served_and_named(tmp_path):
    """A file name need not be UTF-8 on Linux: such a file is listed and served like any
    other, named as os.listdir names it (surrogate escapes), and a failure naming one
    still reaches the trainer (the escape written out), the pass going on."""
    good = encode_jpeg(synthetic_photo(np.random.default_rng(3), 24, 32))
    folder = tmp_path / "tree" / "cls"
    folder.mkdir(parents=True)
    for name, data in ((b"ok.jpg", good), (b"caf\xe9.jpg", good), (b"bad\xff.jpg", b"junk")):
        with open(os.path.join(os.fsencode(folder), name), "wb") as f:
            f.write(data)
    with ServerProcess(["--data-root", str(tmp_path)]) as server, \
            FeedClient(server.address) as feed:
        loader = feed.loader(files="tree/", labels="folder", batch_size=3, size=(16, 16),
                             names=True, failure_budget=1)
        served = {name: index for batch in loader
                  for name, index in zip(names(batch), batch["index"].tolist())}
    on_disk = sorted(os.listdir(folder))  # str: surrogate escapes for the non-UTF-8 bytes
    assert sorted(served) == [f"tree/cls/{n}" for n in on_disk if n != "bad\udcff.jpg"]
    (failure,) = loader.failures
    assert failure.category == "undecodable" and "tree/cls/bad\\udcff.jpg" in failure.reason
