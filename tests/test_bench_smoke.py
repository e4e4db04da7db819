"""The benchmark, run tiny, so it never rots: every row it can run delivers every image.

No speed is asserted (that is what bench/README.md is for); the run must
finish, write its JSON, and each row must either have delivered exactly the
images it was asked for at a positive rate, or be a peer that is not
installed here (SPDL and TensorFlow are optional).
"""

from __future__ import annotations

import json

from bench import run

# Rows that need only gpufeed's own dependencies (server + dev extras): they must run.
_REQUIRED = {"ceiling", "gpufeed-shm", "gpufeed-inline", "torch-2"}
_OPTIONAL = {"spdl", "tf", "tf-service"}


def test_bench_smoke_run(tmp_path):
    report = run.main([
        "--images", "48", "--passes", "1", "--batch-size", "8", "--size", "64",
        "--warmup", "1", "--psnr-images", "4", "--row-timeout", "120",
        "--rows", ",".join(sorted(_REQUIRED | _OPTIONAL)),
        "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "results"),
    ])
    written = json.loads((tmp_path / "results" / "latest.json").read_text())
    assert written["rows"] == report["rows"]
    assert written["data_set"]["count"] == 48
    assert written["decoder_accuracy"]["min_db"] >= 30.0

    rows = {r["row"]: r for r in written["rows"]}
    assert set(rows) == _REQUIRED | _OPTIONAL
    for name, row in rows.items():
        if name in _OPTIONAL and row["status"] == "unavailable":
            continue
        assert row["status"] == "ok", (name, row.get("note"))
        assert row["images"] == row["expected"] == 48, name
        assert row["measured_images"] > 0 and row["images_per_second"] > 0, name
        assert row["cpu_seconds_per_1000"] >= 0, name  # a tiny window may round to 0 ticks
    assert set(written["server_overhead"]) == {"gpufeed-shm", "gpufeed-inline"}
    table = run.format_table(written)
    assert "gpufeed -> trainer process, shm" in table and "1.00x" in table
