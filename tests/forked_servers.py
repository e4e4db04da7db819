"""Start the tests' gpufeed-server processes by forking one that has imported torch.

Most of a server start is ``import torch`` (about 3 CPU-s on a slow core), and the
suite starts a hundred servers on 2 cores. So each test process starts one *fork
server* that imports torch and numpy and waits; a server is a fork of it that
then runs ``gpufeed.server`` as ``python -m`` would (``runpy``, its own
arguments, environment, working directory and stderr pipe), and exits through
the interpreter's normal shutdown. gpufeed itself is imported afresh in each
server. What differs from ``python -m gpufeed.server`` is only that torch and
numpy were imported before the server's environment was set, so a server whose
environment sets ``PYTHON*`` or ``LD_*`` variables (read at start-up) is started
the plain way, as is one with a ``prefix`` (another network namespace).

Servers are still started the way users start them where that is what is
tested: tests/test_package.py, test_demo.py, test_compose.py, test_container.py,
the bench rows and every script a test runs in a Python process of its own.
``GPUFEED_TEST_FORK_SERVERS=0`` starts every server plainly; so does a machine
without ``os.pidfd_open`` (Linux before 5.3).

The fork server is this file run as a script. A request is one JSON line (argv,
environment, working directory) sent over a Unix socket with the write end of
the server's stderr pipe; the fork server answers the child's pid, and its exit
code when it ends, on that connection.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

__all__ = ["ForkServer"]

_PLAIN_ONLY = ("PYTHON", "LD_")  # environment read at interpreter start-up


class ForkServer:
    """One per test process: its ``spawn`` stands in for ``ServerProcess.spawn``, and
    starts the fork server at its first call."""

    def __init__(self, plain: Callable[..., subprocess.Popen[str]]):
        self._plain = plain  # ServerProcess's own spawn
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = ""
        self._ready = False

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None,
              prefix: Sequence[str]):
        """A running ``python -m gpufeed.server ARGV``: a ``Popen``, or a ``_Forked``
        that behaves as one, with its stderr a text pipe."""
        plain = prefix or any(k.startswith(_PLAIN_ONLY) and os.environ.get(k) != v
                              for k, v in env.items())
        socket_path = "" if plain else self._socket()
        if not socket_path:
            return self._plain(argv, env, cwd, prefix)
        return _Forked(socket_path, argv, env, cwd)

    def _socket(self) -> str:
        """The fork server's socket, started at the first call; "" if it cannot run."""
        if self._proc is None:
            self._dir = tempfile.mkdtemp(prefix="gpufeed-forks-")
            self._proc = subprocess.Popen(
                [sys.executable, __file__, os.path.join(self._dir, "socket")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert self._proc.stdout is not None
            self._ready = self._proc.stdout.readline() == b"ready\n"
        return os.path.join(self._dir, "socket") if self._ready else ""

    def close(self) -> None:
        if self._proc is not None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # its cue to exit
            self._proc.wait(30)
            if os.path.exists(os.path.join(self._dir, "socket")):
                os.unlink(os.path.join(self._dir, "socket"))
            os.rmdir(self._dir)


class _Forked:
    """The parts of ``subprocess.Popen`` that ServerProcess and the tests use, for a
    child of the fork server: its exit code arrives on the request's connection."""

    def __init__(self, path: str, argv: list[str], env: dict[str, str], cwd: str | None):
        self.args = ["gpufeed.server", *argv]
        self.returncode: int | None = None
        self._conn = socket.socket(socket.AF_UNIX)
        self._conn.connect(path)
        read, write = os.pipe()
        try:
            request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode() + b"\n"
            socket.send_fds(self._conn, [request], [write])
        finally:
            os.close(write)
        self.stderr = open(read, encoding="utf-8", errors="replace")  # noqa: SIM115
        self._reply = self._conn.makefile("r")
        self.pid = int(self._reply.readline())

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._ended()
        assert self.returncode is not None
        return self.returncode

    def _ended(self) -> None:
        line = self._reply.readline()
        self.returncode = int(line) if line else -signal.SIGKILL  # the fork server died
        self._reply.close()
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped, so the pid is still the child's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# -- the fork server --

def _serve(path: str) -> dict:
    """Fork a child per request; returns only in a child, with its request."""
    if not hasattr(os, "pidfd_open"):
        os._exit(1)  # ForkServer starts servers plainly
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        os._exit(1)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    poller.register(0, select.POLLIN)  # the test process: its end closing means exit
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    os.write(1, b"ready\n")
    while True:
        for fd, _ in poller.poll():
            if fd == 0:
                os._exit(0)
            if fd == listener.fileno():
                conn, _ = listener.accept()
                request, write = _receive(conn)
                pid = os.fork()
                if pid == 0:
                    for pidfd, (_, other) in children.items():
                        os.close(pidfd)
                        other.close()
                    listener.close()
                    conn.close()
                    _become_child(write)
                    return request
                os.close(write)
                conn.sendall(f"{pid}\n".encode())
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn)
                poller.register(pidfd, select.POLLIN)
            else:  # a child ended: reap it and say how
                pid, conn = children.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the test process let go of it
                conn.close()


def _receive(conn: socket.socket) -> tuple[dict, int]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise ConnectionError("a request ended early")
        data += more
    return json.loads(data), fds[0]


def _become_child(stderr: int) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # ServerProcess sends a server's stdout to /dev/null
    os.dup2(stderr, 2)
    os.close(devnull)
    os.close(stderr)


def _main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the test process's ^C is not for it
    import numpy  # noqa: F401  (what every server imports first, and the slowest)
    import torch  # noqa: F401

    request = _serve(sys.argv[1])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    if request["cwd"]:
        os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as ``python -m`` sets it
    sys.argv = ["gpufeed.server", *request["argv"]]
    import runpy

    runpy.run_module("gpufeed.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main()
