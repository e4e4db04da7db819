"""Dealing by pace, measured: two servers of unequal speed behind a network hop.

Servers A and B run in the server namespace of a veth link (netns.py), each
pinned to a core of its own; B's core also runs a busy loop, so B decodes at
about half A's pace. The trainer, in the other namespace, reads inline batches
of random-resized crops of the bench's JPEGs: from A alone, from B alone, then
from both in one loader, which deals the pass by pace (client/dealing.py).
Each row is steady state: its first ``--warmup`` batches are not timed; a
pass over both first warms the servers, and the rows run in ``--rounds``. The
pass over both should run at 0.9x or more of the sum of the two solo rates;
dealing in turn (server p making batches p, p + 2, ...) would run it at twice
the slower one's, printed beside as a computed figure.

    sudo .venv/bin/python -m bench.pace [--images 2000] [--batch-size 32]

Needs root (the namespaces) and two cores; prints each row's progress, then a
table of img/s, the trainer's and the servers' CPU per image, and each
server's share of the pass's batches (from its log).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from gpufeed.client import FeedClient
from gpufeed.server.process import ServerProcess

from . import netns
from .dataset import build
from .measure import tree_cpu_seconds

_DATA = Path(__file__).resolve().parent / "data"


def _server(link: netns.VethLink, root: Path, core: int) -> ServerProcess:
    """A server of ``root`` on core ``core`` of the server namespace, one decode thread."""
    return ServerProcess(["--data-root", str(root), "--threads", "1",
                          "--listen", f"{netns.SERVER_ADDRESS}:0"],
                         prefix=[*link.server_command(["taskset", "-c", str(core)])])


def _ends(server: ServerProcess) -> list[int]:
    """The batch count of each stream the server has logged the end of."""
    return [int(m.group(1)) for line in list(server.log)
            if (m := re.search(r"stream end: .* batches=(\d+)", line))]


def _batches_sent(server: ServerProcess) -> int:
    return sum(_ends(server))


def _stream_ends(server: ServerProcess) -> int:
    return len(_ends(server))


def _row(name: str, addresses: list[str], servers: list[ServerProcess], args) -> dict:
    """One pass of ``--images`` over ``addresses``, timed after the warm-up batches."""
    options = dict(batch_size=args.batch_size, size=(args.size, args.size),
                   resize="random_resized_crop", shuffle=True, seed=7, transport="inline",
                   prefetch=args.prefetch)
    before = [_batches_sent(s) for s in servers]
    ends_before = [_stream_ends(s) for s in servers]
    with FeedClient(addresses) as feed:
        loader = feed.loader(args.list_file, **options)
        images, start, cpu = 0, None, None
        server_cpu = None
        for k, batch in enumerate(loader):
            if k == args.warmup:
                start, cpu = time.perf_counter(), time.process_time()
                server_cpu = sum(tree_cpu_seconds(s.proc.pid) for s in servers if s.proc)
            elif k > args.warmup:
                images += batch["index"].shape[0]
                if k % 20 == 0:
                    rate = images / (time.perf_counter() - start)
                    print(f"  [{name}] batch {k}: {rate:.0f} img/s", flush=True)
        elapsed = time.perf_counter() - start
        trainer_ms = (time.process_time() - cpu) / images * 1e3
        servers_ms = (sum(tree_cpu_seconds(s.proc.pid) for s in servers if s.proc)
                      - server_cpu) / images * 1e3
    # Each server logs its stream's end as the stream closes: wait for those lines.
    deadline = time.monotonic() + 30
    while (time.monotonic() < deadline
           and any(_stream_ends(s) <= n for s, n in zip(servers, ends_before))):
        time.sleep(0.05)
    shares = [_batches_sent(s) - b for s, b in zip(servers, before)]
    return {"row": name, "img_s": images / elapsed, "trainer_ms": trainer_ms,
            "servers_ms": servers_ms, "batches": shares}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--size", type=int, default=160)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data-dir", type=Path, default=_DATA)
    args = parser.parse_args(argv)
    why = netns.unavailable_reason()
    if why or (os.cpu_count() or 1) < 2:
        print(f"unavailable: {why or 'needs two cores'}")
        return 1
    data = build(args.data_dir / f"jpeg{args.images}", args.images)
    args.list_file = str(data.list_file)
    hog = None
    with netns.VethLink() as link:
        a, b = _server(link, data.root, 0), _server(link, data.root, 1)
        with a, b:
            # The competing load on B's core: B decodes at about half A's pace.
            hog = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c",
                                    "while True: pass"])
            try:
                netns.enter(link.client_ns)
                _row("warm-up (not counted)", [a.address, b.address], [a, b], args)
                rounds = [[_row("A alone", [a.address], [a], args),
                           _row("B alone (busy core)", [b.address], [b], args),
                           _row("A + B, dealt by pace", [a.address, b.address], [a, b], args)]
                          for _ in range(args.rounds)]
            finally:
                hog.kill()
                hog.wait()
    print(f"\n{'round':<6} {'row':<24} {'img/s':>8} {'trainer ms/img':>15} "
          f"{'servers ms/img':>15}  batches")
    for number, rows in enumerate(rounds, 1):
        for row in rows:
            print(f"{number:<6} {row['row']:<24} {row['img_s']:>8.0f} {row['trainer_ms']:>15.2f} "
                  f"{row['servers_ms']:>15.2f}  {row['batches']}")
    for number, (alone_a, alone_b, both) in enumerate(rounds, 1):
        solo = alone_a["img_s"] + alone_b["img_s"]
        in_turn = 2 * min(alone_a["img_s"], alone_b["img_s"])
        print(f"round {number}: both / (A alone + B alone) = {both['img_s'] / solo:.2f}x "
              f"(target >= 0.90x); dealt in turn, 2 x the slower = {in_turn / solo:.2f}x "
              f"(computed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
