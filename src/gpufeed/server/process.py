"""Run ``gpufeed-server`` as a child process: for the demo, the benchmarks and the tests.

The child listens on a free loopback port (``--listen 127.0.0.1:0``) and logs
the address it got in its ready line, which ``ServerProcess`` waits for, so
there is no port race and no sleeping.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO

__all__ = ["ServerProcess"]

_READY = re.compile(r"gpufeed-server ready on (\S+)")


class ServerProcess:
    """``with ServerProcess(["--data-root", d]) as server: FeedClient(server.address)``."""

    def __init__(self, args: list[str], *, timeout: float = 60.0, env: dict | None = None,
                 cwd: str | None = None, prefix: Sequence[str] = ()):
        self.args = ["--listen", "127.0.0.1:0", *args]  # a later --listen in args wins
        self.prefix = list(prefix)  # e.g. ["ip", "netns", "exec", name]: where it runs
        self.timeout = timeout
        self.env = env
        self.cwd = cwd
        self.log: list[str] = []
        self.address = ""
        self.proc: subprocess.Popen[str] | None = None  # set by start

    @staticmethod
    def spawn(args: list[str], env: dict[str, str], cwd: str | None,
              prefix: Sequence[str]) -> subprocess.Popen[str]:
        """``python -m gpufeed.server ARGS``, its stderr a text pipe. The tests replace it
        with one that forks servers from a process that has imported torch
        (tests/forked_servers.py): a hundred imports of torch are most of their time."""
        return subprocess.Popen([*prefix, sys.executable, "-m", "gpufeed.server", *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=cwd)

    def start(self) -> ServerProcess:
        self.proc = proc = self.spawn(self.args, {**os.environ, **(self.env or {})}, self.cwd,
                                      self.prefix)
        assert proc.stderr is not None, "stderr=PIPE makes a pipe"
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(proc.stderr, ready), daemon=True).start()
        if not ready.wait(self.timeout) or not self.address:
            self.kill()
            raise RuntimeError("gpufeed-server did not become ready:\n" + "".join(self.log))
        return self

    def _drain(self, stderr: IO[str], ready: threading.Event) -> None:
        for line in stderr:
            self.log.append(line)
            match = _READY.search(line)
            if match and not self.address:
                self.address = match.group(1)
                ready.set()
        ready.set()  # the process ended

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; returns the exit code."""
        proc = self.proc
        if proc is None:
            raise RuntimeError("stop() before start()")
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        except subprocess.TimeoutExpired:
            self.kill()
