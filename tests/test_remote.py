"""A trainer on another host: inline batches across a real network hop.

The server runs in one network namespace and the trainer (a subprocess with
the real client) in another, joined by a veth pair shaped to 1 Gbit/s
(bench/netns.py). Skipped, saying why, where namespaces cannot be made.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import textwrap
import threading

import pytest

from bench import netns
from gpufeed.server.process import ServerProcess

_WHY_NOT = netns.unavailable_reason()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no veth link: {_WHY_NOT}")

# Prints each batch's indices as a JSON line; after `pause_after` batches prints
# "paused" and reads a line from stdin before going on.
_TRAINER = textwrap.dedent("""
    import json, sys
    from gpufeed.client import FeedClient
    address, pause_after, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    with FeedClient(address) as feed:
        loader = feed.loader(files=files, batch_size=8, size=(64, 64), shuffle=True, seed=7,
                             transport="inline", prefetch=2)
        for n, batch in enumerate(loader, 1):
            print(json.dumps(batch["index"].tolist()), flush=True)
            if n == pause_after:
                print("paused", flush=True)
                sys.stdin.readline()
    print("done", flush=True)
""")


@pytest.fixture()
def link():
    with netns.VethLink(rate="1gbit") as veth:
        yield veth


@pytest.fixture()
def remote_server(link, data_dir):
    args = ["--data-root", str(data_dir), "--threads", "2",
            "--listen", f"{netns.SERVER_ADDRESS}:0"]
    with ServerProcess(args, prefix=link.server_command([])) as server:
        yield server


class _Trainer:
    """The trainer subprocess in the link's other namespace; its lines as they come."""

    def __init__(self, link, address: str, files: list[str], pause_after: int = 0):
        self.proc = subprocess.Popen(
            link.client_command([sys.executable, "-c", _TRAINER, address, str(pause_after),
                                 *files]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines.put),
                         daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self._err),
                         daemon=True).start()
        self.interrupted = threading.Event()

    @staticmethod
    def _read(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))

    def _err(self, line: str) -> None:
        self.stderr.append(line)
        if "interrupted" in line:
            self.interrupted.set()

    def batches_until(self, marker: str, timeout: float = 120.0) -> list[list[int]]:
        """Batches printed before the line ``marker``."""
        batches = []
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {marker!r} from the trainer; its stderr:\n"
                                     + "\n".join(self.stderr)) from None
            if line == marker:
                return batches
            batches.append(json.loads(line))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _one_pass(link, address: str, files: list[str]) -> list[list[int]]:
    trainer = _Trainer(link, address, files)
    try:
        batches = trainer.batches_until("done")
        assert trainer.proc.wait(30) == 0, "\n".join(trainer.stderr)
        return batches
    finally:
        trainer.close()


def test_a_pass_over_the_link_delivers_every_sample_once(link, remote_server, image_names):
    batches = _one_pass(link, remote_server.address, image_names)
    indices = [i for batch in batches for i in batch]
    assert sorted(indices) == list(range(len(image_names)))
    assert link.server_tx_bytes() > len(image_names) * 3 * 64 * 64  # it did cross the link


def test_a_link_down_mid_stream_reconnects_and_resumes_exactly(link, remote_server,
                                                               image_names):
    """The cable pulled (veth down) mid-pass: keepalive notices, the loader reconnects
    once the link is back and resumes where it was; same order as an unbroken pass."""
    reference = _one_pass(link, remote_server.address, image_names)
    trainer = _Trainer(link, remote_server.address, image_names, pause_after=5)
    try:
        before = trainer.batches_until("paused")
        link.set_up(False)
        trainer.proc.stdin.write("go\n")
        trainer.proc.stdin.flush()
        # Keepalive (client: ping every 2 s, 3 s to answer) ends the dead connection; the
        # loader says so and keeps reconnecting (reconnect_timeout 30 s) until the link is up.
        assert trainer.interrupted.wait(60), "\n".join(trainer.stderr)
        link.set_up(True)
        after = trainer.batches_until("done")
        assert trainer.proc.wait(30) == 0, "\n".join(trainer.stderr)
    finally:
        trainer.close()
    assert before + after == reference
