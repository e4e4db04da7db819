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
import sys
import threading
import time


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


if __name__ == "__main__":
    sys.exit(main())
