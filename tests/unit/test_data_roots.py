"""Data roots confine every name: no `..`, no absolute path elsewhere, no symlink out."""

from __future__ import annotations

import pytest

from gpufeed.server.storage.paths import DataRoots, OutsideDataRoots


def test_data_roots_confine_names(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (b / "only-in-b.jpg").write_bytes(b"x")
    roots = DataRoots([str(a), str(b)])
    assert roots.locate("x/y.jpg") == str(a / "x/y.jpg")
    assert roots.locate("only-in-b.jpg") == str(b / "only-in-b.jpg")
    assert roots.locate(str(b / "z.jpg")) == str(b / "z.jpg")
    for bad in ("../a/x.jpg", "x/../../etc/passwd", "/etc/passwd", str(tmp_path / "ab")):
        with pytest.raises(OutsideDataRoots):
            roots.locate(bad)
    (a / "escape").symlink_to("/etc")
    with pytest.raises(OutsideDataRoots):
        roots.read(roots.locate("escape/hostname"))
