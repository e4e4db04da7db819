"""bench/open_scale.py run tiny, so it never rots: 2 rank processes a side (gpufeed, and
DataLoader + DistributedSampler with 1 worker a rank) on a list of 2000 lines.

No speed or memory figure is asserted (bench/RESULTS.md has them); the run must finish,
write its JSON with every field bench/RESULTS.md's table is made of, and the DataLoader
peer's ImageFolder index must hold the very samples of the list file gpufeed reads.
"""

from __future__ import annotations

import json
import mmap
import os

import pytest

from bench import open_scale
from bench.open_scale_rank import ImageFolderIndex, per_class

_LINES = 2000


@pytest.mark.slow
def test_open_scale_tiny(tmp_path):
    root, out = tmp_path / "data", tmp_path / "results"
    report = open_scale.main([
        "--ranks", "2", "--lines", str(_LINES), "--pool", "4", "--root", str(root),
        "--workers", "1", "--more", "1", "--settle", "0", "--pause", "0", "--timeout", "120",
        "--out", str(out), "--json", str(tmp_path / "open-scale.json"),
    ])
    written = json.loads((out / "open-scale-latest.json").read_text())
    assert written == json.loads((tmp_path / "open-scale.json").read_text())
    assert written["rows"] == report["rows"]
    rows = {row["side"]: row for row in written["rows"]}
    assert set(rows) == {"gpufeed", "dataloader"}
    for side, row in rows.items():
        assert row["status"] == "ok", (side, row.get("note"))
        assert row["ranks"] == 2 and row["batches_per_rank"] == 2
        assert len(row["firsts_s"]) == 2
        assert 0 < row["first_batch_s"] <= row["every_first_batch_s"] <= row["all_held_s"]
        assert row["load_before"] >= 0 and row["load_after"] >= 0
        memory = row["memory"]
        assert memory["total_pss_mb"] > 0 and memory["shm_mb"] > 0
        assert memory["total_pss_mb"] == round(sum(memory["roles_mb"].values())
                                               + memory["shm_mb"], 1)
    # gpufeed: the server and two ranks; its rings are shared memory.
    assert set(rows["gpufeed"]["memory"]["roles_mb"]) == {"rank", "server"}
    assert rows["gpufeed"]["memory"]["processes"] == 3
    assert {"rss_before_mb", "rss_growth_mb", "peak_growth_mb",
            "rss_growth_parts_mb"} <= set(rows["gpufeed"])
    # DataLoader: two ranks and one worker each; its batches in /dev/shm.
    assert set(rows["dataloader"]["memory"]["roles_mb"]) == {"rank", "worker"}
    assert rows["dataloader"]["memory"]["processes"] == 4

    (entry,) = written["summary"]
    assert entry["ranks"] == 2 and entry["pss_ratio"] > 0
    assert entry["gpufeed"]["rounds"] == entry["dataloader"]["rounds"] == 1
    assert len(written["targets"]) == 3
    assert all(line.startswith("target: ") for line in written["targets"])
    assert "| 2 |" in open_scale.table(written["summary"])


def test_the_peer_indexes_the_list_files_samples(tmp_path):
    list_file = open_scale.build(tmp_path, _LINES, pool=4)
    index = ImageFolderIndex(str(tmp_path / "train"), per_class(_LINES))
    listed = [line.split("\t") for line in list_file.read_text().splitlines()]
    assert [(os.path.relpath(path, tmp_path), label) for path, label in index.samples] == \
        [(path, int(label)) for path, label in listed]
    assert index.targets == [label for _, label in index.samples]
    assert len(index.classes) == 1000 and index.imgs is index.samples


def test_shared_memory_counts_once_and_whole(tmp_path):
    """A segment mapped twice and held open counts once, at its allocated size, however
    little of it is touched (PSS would count only the touched pages)."""
    path = f"/dev/shm/open-scale-test-{os.getpid()}"
    before = open_scale.memory_of({"me": [os.getpid()]})
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, 8 << 20)
        first, second = mmap.mmap(fd, 8 << 20), mmap.mmap(fd, 8 << 20)
        first[:1] = b"x"
        os.unlink(path)
        memory = open_scale.memory_of({"me": [os.getpid()]})
        first.close()
        second.close()
    finally:
        os.close(fd)
        if os.path.exists(path):
            os.unlink(path)
    assert memory["processes"] == 1
    assert memory["shm_objects"] == before["shm_objects"] + 1
    assert memory["shm_mb"] == round(before["shm_mb"] + 8, 1)
