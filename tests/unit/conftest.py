"""The unit tier: tests that start no process (no server, no tool), so the whole
folder runs in seconds while you work: ``python -m pytest tests/unit``.

A test here that starts a process fails, naming the tier's rule: move it to tests/.
"""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a test in tests/unit starts no process (no server, no tool): "
                             "move it to tests/")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
