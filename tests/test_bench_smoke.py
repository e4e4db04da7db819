"""The benchmark, run tiny, so it never rots: every row it can run delivers every image.

No speed is asserted (bench/RESULTS.md has the figures); the run must
finish, write its JSON, and each row must either have delivered exactly the
images (or array samples) it was asked for at a positive rate, or be a peer
that is not installed here (SPDL and TensorFlow are optional). The soak
benchmark runs for a few seconds, half of them with its adversarial mix, and must stop
cleanly.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench import run, soak

# Rows that need only gpufeed's own dependencies (server + dev extras): they must run.
# One row per code path; the other rows reuse these runners with other arguments (the
# inline transport is streamed by the soak below). Every row is a few fresh processes that
# import torch: that, not the images, is what this test's time goes on.
_REQUIRED = {"ceiling", "gpufeed-shm", "gpufeed-shm-rrc", "torch-2", "torch-2-rrc",
             "trainers-2", "npy-gpufeed", "npz-numpy", "shards-local"}
# Peers that are optional (the bench extra), one row per module (and tf.data's tar shards).
# tf-service is left out: its two TensorFlow processes alone took ~8 s of this test's budget.
_OPTIONAL = {"spdl", "tf-rrc", "dali-rrc", "wds-torch-2-local", "tf-shards-local"}
_IMAGES, _ARRAYS = 48, 40


@pytest.mark.slow
def test_bench_and_soak_smoke(tmp_path):
    # The soak runs beside the rows (speed is not what this checks): the two together take
    # about as long as the rows alone, which leave the second core idle now and then.
    with ThreadPoolExecutor(1) as pool:
        soaking = pool.submit(_soak, tmp_path / "soak")
        _check_bench(tmp_path / "bench")
        _check_soak(tmp_path / "soak", soaking.result())


def _check_bench(tmp_path):
    report = run.main([
        "--images", str(_IMAGES), "--passes", "1", "--batch-size", "8", "--size", "64",
        "--arrays", str(_ARRAYS), "--array-passes", "1",
        "--warmup", "1", "--psnr-images", "4", "--row-timeout", "120",
        "--jobs", "3",  # rows overlap: speed is not what this checks
        "--prefetch", "2",  # the gpufeed rows ask for it, as a rerun with --prefetch does
        "--rows", ",".join(sorted(_REQUIRED | _OPTIONAL)),
        "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "results"),
    ])
    written = json.loads((tmp_path / "results" / "latest.json").read_text())
    assert written["rows"] == report["rows"]
    assert written["data_set"]["count"] == _IMAGES
    assert written["array_set"]["count"] == _ARRAYS
    assert written["config"]["prefetch"] == 2
    assert written["decoder_accuracy"]["min_db"] >= 30.0

    rows = {r["row"]: r for r in written["rows"]}
    assert set(rows) == _REQUIRED | _OPTIONAL
    for name, row in rows.items():
        if name in _OPTIONAL and row["status"] == "unavailable":
            continue
        assert row["status"] == "ok", (name, row.get("note"))
        expected = _ARRAYS if name.startswith(("npy-", "npz-")) else _IMAGES
        expected *= row.get("trainers", 1)
        assert row["images"] == row["expected"] == expected, name
        assert row["measured_images"] > 0 and row["images_per_second"] > 0, name
        assert row["cpu_seconds_per_1000"] >= 0, name  # a tiny window may round to 0 ticks
        if not name.startswith("trainers-"):  # start-up and teardown are reported apart
            assert row["startup_seconds"] > 0 and row["teardown_seconds"] >= 0, name
    # Each concurrent trainer received the whole set once, and has its own rate.
    assert rows["trainers-2"]["per_trainer_delivered"] == [_IMAGES, _IMAGES]
    assert len(rows["trainers-2"]["per_trainer_images_per_second"]) == 2
    assert set(written["server_overhead"]) == {"gpufeed-shm"}
    table = run.format_table(written)
    assert "gpufeed -> trainer process, shm" in table and "1.00x" in table
    # One table per job, each with gpufeed's row of that job and the targets against it.
    for title in ("squash:", "training: random-resized-crop + flip, normalised float16:"):
        assert title in table, title
    assert "target: gpufeed's CPU s / 1000 images at or below the best peer's" in table
    assert "| 2 |" in table and ".npz: numpy.load in a thread pool" in table
    assert "3 at a time" in table


def _soak(tmp_path) -> dict:
    return soak.main(["--minutes", "0.05", "--interval", "1", "--images", str(_IMAGES),
                      "--size", "64", "--batch-size", "8",
                      "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "results")])


def _check_soak(tmp_path, report: dict) -> None:
    written = json.loads((tmp_path / "results" / "soak-latest.json").read_text())
    assert written["verdict"] == report["verdict"]
    assert not written["stopped_early"], written["stopped_early"]
    assert len(written["samples"]) >= 2
    assert all(s["rss_kb"] > 0 and s["fds"] > 0 for s in written["samples"])
    # Both trainers streamed, stopped cleanly, and the server drained leaving nothing behind.
    for transport in ("shm", "inline"):
        trainer = written["trainers"][transport]
        assert trainer["exit_code"] == 0 and not trainer["error"], (transport, trainer)
        assert trainer["totals"]["images"] > 0 and trainer["totals"]["transport"] == transport
    assert written["server_exit_code"] == 0
    assert written["shm_left_behind"] == []
    assert written["verdict"]["line"].startswith("verdict: ")
    # Its second half ran the adversarial mix beside the trainers: every oversized request
    # was refused, and the trainers went on (above).
    attacks = written["adversary"]
    assert any(what.startswith("17.9 GB ring") for what in attacks), attacks
    assert not any(what.endswith("ACCEPTED") for what in attacks), attacks
