"""A trainer in its own process, for the rows and the soak that need several of them.

``python -m bench.trainer ADDRESS LIST_FILE [options]`` opens a loader on the
server at ADDRESS, prints ``ready`` and waits for a line on its standard input
(so several trainers start streaming together), then reads ``--passes`` epochs
back to back (0: until its standard input closes) and prints one line per batch,
``b <images> <time.monotonic()>`` (CLOCK_MONOTONIC, comparable across processes
on one host), and a last line ``done <json>`` with its totals. It does nothing
with a batch but count it and drop it, so it measures what the service delivers.
An error ends the process with ``error <message>`` and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.trainer", description=__doc__)
    p.add_argument("address")
    p.add_argument("files", help="a list file on the server, relative to its data root")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=_size, default=(224, 224), help="N or HxW (default 224)")
    p.add_argument("--transport", default="shm")
    p.add_argument("--passes", type=int, default=1, help="epochs to read; 0: until stdin closes")
    return p


def _size(text: str) -> tuple[int, int]:
    height, _, width = text.partition("x")
    return int(height), int(width or height)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from gpufeed.client import FeedClient

    stop = threading.Event()
    out = sys.stdout
    with FeedClient(args.address) as feed:
        loader = feed.loader(files=args.files, batch_size=args.batch_size,
                             size=args.size, transport=args.transport)
        print("ready", file=out, flush=True)
        if not sys.stdin.readline():  # closed before "go": nothing to do
            return 0
        if args.passes == 0:
            # Read stdin to its end in the background: its closing is the signal to stop.
            threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        images = batches = epoch = 0
        started = time.monotonic()
        try:
            while not stop.is_set() and (args.passes == 0 or epoch < args.passes):
                loader.set_epoch(epoch)
                for batch in loader:
                    n = int(batch["image"].shape[0])
                    del batch
                    images += n
                    batches += 1
                    out.write(f"b {n} {time.monotonic():.6f}\n")
                    out.flush()
                    if stop.is_set():
                        break
                epoch += 1
        except Exception as e:  # reported to the parent, which decides what it means
            print(f"error {type(e).__name__}: {e}", file=out, flush=True)
            return 1
        print("done " + json.dumps({"images": images, "batches": batches, "epochs": epoch,
                                    "seconds": time.monotonic() - started,
                                    "transport": loader.transport}), file=out, flush=True)
    return 0


class TrainerProcess:
    """A ``bench.trainer`` child, read as it goes: its batches, then its totals or its error.

    ``passes`` 0 streams until ``stop()`` closes its standard input.
    """

    def __init__(self, address: str, list_file: str, *, transport: str = "shm", passes: int = 1,
                 batch_size: int = 32, size: str = "224"):
        self.transport = transport
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.trainer", address, list_file, "--transport", transport,
             "--passes", str(passes), "--batch-size", str(batch_size), "--size", size],
            cwd=_REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.batches: list[tuple[int, float]] = []  # (images, monotonic time) per batch
        self.on_batch = lambda images: None
        self.ready = threading.Event()
        self.done: dict | None = None
        self.error = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def images(self) -> int:
        return sum(n for n, _ in self.batches)

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self, timeout: float = 60.0) -> int:
        """Close its standard input and wait; killed (and said so in ``error``) past ``timeout``."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            self.error = self.error or f"did not stop within {timeout:g} s; killed"
        self._reader.join(10)
        return code

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("b "):
                _, n, t = line.split()
                self.batches.append((int(n), float(t)))
                self.on_batch(int(n))
            elif line.startswith("ready"):
                self.ready.set()
            elif line.startswith("done "):
                self.done = json.loads(line[5:])
            elif line.startswith("error "):
                self.error = line[6:].strip()
        self.ready.set()  # ended, whether or not it got ready


if __name__ == "__main__":
    sys.exit(main())
