"""Start the tests' gpufeed-server processes by forking one that has imported torch.

Most of a server start is ``import torch`` (about 3 CPU-s on a slow core), and the
suite starts a hundred servers on 2 cores. So each test process starts one *fork
server* that imports numpy and torch and waits; a server is a fork of it that
then runs ``gpufeed.server`` as ``python -m`` would (``runpy``, its own
arguments, environment, working directory, stdin, stdout and stderr pipe), and
exits through the interpreter's normal shutdown. gpufeed itself is imported
afresh in each server.

What differs from ``python -m gpufeed.server``:

- numpy and torch were imported before the server's environment was set, and
  before gpufeed. So a server whose environment differs from the fork server's
  in what is read at start-up or at torch's import (``PYTHON*``, ``LD_*``,
  ``MALLOC_*``, ``OMP_*``, ``TORCH*``, the locale, ...) starts plainly, as does
  one with a ``prefix`` (another network namespace). ``PYTHONPATH`` (a plugin's
  folder) is the exception, unless it holds a ``sitecustomize``: the child puts
  its entries on ``sys.path`` where start-up would have, so only a module
  imported before the fork (numpy, torch) would not be looked up there;
- the servers forked by one test process share its string hash seed and its
  multiprocessing authentication key;
- what torch prints as it is imported goes to the fork server's log, not the
  server's.

Servers are still started the way users start them where that is what is
tested: tests/test_package.py, test_demo.py, test_compose.py, test_container.py,
the bench rows and every script a test runs in a Python process of its own.
``GPUFEED_TEST_FORK_SERVERS=0`` starts every server plainly; so does a machine
without ``os.pidfd_open`` (Linux before 5.3), or a fork server that has died.

The fork server is this file run as a script. A request is one JSON line (argv,
environment, working directory) sent over a Unix socket with the write end of
the server's stderr pipe; the fork server answers the child's pid, and its exit
code when it ends, on that connection. When the test process closes the fork
server's stdin (at the session's end, or by dying) it kills the servers still
running and exits.
"""

from __future__ import annotations

import gc
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence

__all__ = ["ForkServer"]

# Environment read at interpreter start-up, or as torch is imported.
_PLAIN_ONLY = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "OPENBLAS_", "MKL_", "KMP_",
               "TORCH", "PYTORCH_", "CUDA_", "LC_", "LANG")


class ForkServer:
    """One per test process: its ``spawn`` stands in for ``ServerProcess.spawn``, and
    starts the fork server at its first call."""

    def __init__(self, plain: Callable[..., subprocess.Popen[str]]):
        self._plain = plain  # ServerProcess's own spawn
        self._proc: subprocess.Popen[bytes] | None = None
        self._env: dict[str, str] = {}  # the fork server's
        self._dir = ""
        self._ready = False

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None,
              prefix: Sequence[str]):
        """A running ``python -m gpufeed.server ARGV``: a ``Popen``, or a ``_Forked``
        that behaves as one, with its stderr a text pipe."""
        path = "" if prefix else self._socket()
        if not path or _customizes(env, cwd) or any(
                k.startswith(_PLAIN_ONLY) and k != "PYTHONPATH" and self._env.get(k) != env.get(k)
                for k in env.keys() | self._env.keys()):
            return self._plain(argv, env, cwd, prefix)
        return _Forked(path, argv, env, os.path.abspath(cwd or os.getcwd()))

    def _socket(self) -> str:
        """The fork server's socket, started at the first call; "" if it cannot run."""
        if self._proc is None:
            self._dir = tempfile.mkdtemp(prefix="gpufeed-forks-")
            self._env = dict(os.environ)
            with open(os.path.join(self._dir, "log"), "wb") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, __file__, os.path.join(self._dir, "socket")],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self._env)
            assert self._proc.stdout is not None
            self._ready = self._proc.stdout.readline() == b"ready\n"
        if self._ready and self._proc.poll() is not None:
            self._ready = False  # it died: start plainly from now on, saying why
            with open(os.path.join(self._dir, "log"), errors="replace") as log:
                said = log.read()[-2000:]
            warnings.warn(f"the fork server exited ({self._proc.returncode}); servers start "
                          f"plainly from now on. Its log ends: {said}", stacklevel=2)
        return os.path.join(self._dir, "socket") if self._ready else ""

    def close(self) -> None:
        if self._proc is not None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # its cue to kill what still runs, and exit
            self._proc.wait(30)
            shutil.rmtree(self._dir)


def _customizes(env: dict[str, str], cwd: str | None) -> bool:
    """Whether ``env``'s PYTHONPATH holds a module that start-up runs (sitecustomize)."""
    return any(os.path.exists(os.path.join(cwd or "", entry, name))
               for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry
               for name in ("sitecustomize.py", "usercustomize.py"))


class _Forked:
    """The parts of ``subprocess.Popen`` that ServerProcess and the tests use, for a
    child of the fork server: its exit code arrives on the request's connection."""

    def __init__(self, path: str, argv: list[str], env: dict[str, str], cwd: str):
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
        line = self._reply.readline()
        if not line:
            self.stderr.close()
            self._conn.close()
            raise RuntimeError(f"the fork server did not start a server (its log: "
                               f"{os.path.join(os.path.dirname(path), 'log')})")
        self.pid = int(line)

    def poll(self) -> int | None:
        if self.returncode is None and self._readable(0):
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._readable(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._ended()
        assert self.returncode is not None
        return self.returncode

    def _readable(self, timeout: float | None) -> bool:
        poller = select.poll()  # not select.select: a busy test process has fds over 1024
        poller.register(self._conn, select.POLLIN)
        return bool(poller.poll(None if timeout is None else timeout * 1000))

    def _ended(self) -> None:
        line = self._reply.readline()
        self.returncode = int(line) if line else -signal.SIGKILL  # its fork server died
        self._reply.close()
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # its exit code has not arrived, so the pid is the child's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # reaped by the fork server, its exit code on the way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# -- the fork server --

def _serve(path: str) -> dict:
    """Fork a child per request; returns only in a child, with its request."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        os._exit(1)  # ForkServer starts servers plainly
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
                _kill_all(children)
                os._exit(0)
            if fd == listener.fileno():
                conn, _ = listener.accept()
                try:
                    request, write = _receive(conn)
                except (OSError, ValueError) as e:  # a test process stopped mid-request
                    print(f"fork server: a request failed: {e!r}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                try:
                    pid = os.fork()
                except OSError as e:
                    print(f"fork server: fork failed: {e!r}", file=sys.stderr, flush=True)
                    os.close(write)
                    conn.close()  # the test process reads no pid: its start fails
                    continue
                if pid == 0:
                    for pidfd, (_, other) in children.items():
                        os.close(pidfd)
                        other.close()
                    listener.close()
                    conn.close()
                    _become_child(write)
                    return request
                os.close(write)
                pidfd = os.pidfd_open(pid)  # a child already ended is a zombie until reaped
                children[pidfd] = (pid, conn)
                poller.register(pidfd, select.POLLIN)
                try:
                    conn.sendall(f"{pid}\n".encode())
                except OSError:
                    pass  # the test process is gone; the child is reaped when it ends
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


def _kill_all(children: dict[int, tuple[int, socket.socket]]) -> None:
    """What a failed test left running must not outlive the test process."""
    for pid, _ in children.values():
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass


def _receive(conn: socket.socket) -> tuple[dict, int]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)
    if len(fds) != 1:
        raise ValueError(f"a request came with {len(fds)} file descriptors, not 1")
    write = fds[0]
    os.set_inheritable(write, False)  # recv_fds does not ask for close-on-exec
    try:
        while not data.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                raise ConnectionError("the request ended early")
            data += more
        return json.loads(data), write
    except BaseException:
        os.close(write)
        raise


def _become_child(stderr: int) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # ServerProcess sends a server's stdout to /dev/null
    os.dup2(stderr, 2)
    os.close(devnull)
    os.close(stderr)


def _python_path() -> list[str]:
    """This environment's PYTHONPATH entries, absolute, as start-up puts them on sys.path."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return [os.path.abspath(entry) for entry in entries if entry]


def _main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the test process's ^C is not for it
    import numpy  # noqa: F401  (what every server imports first, and the slowest)
    import torch  # noqa: F401

    # Out of the collector's reach from here on: a child's collections would otherwise
    # touch every object it inherited, and so copy every page of them (about 1 CPU-s
    # and 0.5 s of start-up per server, most of its cost).
    gc.freeze()
    request = _serve(sys.argv[1])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    own = _python_path()  # the fork server's PYTHONPATH entries, on its sys.path
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # As ``python -m`` starts: the working directory, then PYTHONPATH, then the rest.
    sys.path = [os.getcwd(), *_python_path(), *(p for p in sys.path[1:] if p not in own)]
    sys.argv = ["gpufeed.server", *request["argv"]]
    import runpy

    runpy.run_module("gpufeed.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main()
