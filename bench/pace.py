"""Several servers, measured: dealt by pace, and local first, over a network hop.

Servers A and B each run with two decode threads, held to a share of the CPU
by a cgroup (CFS quota: ``--cores``). By default both are remote: in the
server namespace of a veth link (netns.py), each with a /dev/shm of its own,
so the trainer in the other namespace reads them inline, as from other
hosts; A may use 0.6 of a core and B 0.3, so B runs at about half A's pace.
The pass over both should run at 0.9x or more of the sum of the two solo
rates; dealing in turn (server p making batches p, p + 2, ...) would run it
at twice the slower one's, printed beside as a computed figure.

``--local``: A is the trainer's local server (its namespace and /dev/shm:
shm), B a remote one, 0.6 of a core each. Adding B should raise the rate by
0.8x or more of what B makes alone, while A still makes batches at its own
full pace.

The trainer reads random-resized crops: A alone, B alone, then both in one
loader, in ``--rounds`` after a warm-up pass over both; each row is steady
state (its first ``--warmup`` batches are not timed).

    sudo .venv/bin/python -m bench.pace [--local] [--images 3000] [--rounds 3]

Needs root (namespaces, cgroups). Prints each row's progress, then a table of
img/s, the trainer's and the servers' CPU per image, and each server's
batches (from its log).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from gpufeed.client import FeedClient
from gpufeed.server.process import ServerProcess

from . import netns
from .dataset import build
from .measure import tree_cpu_seconds

_DATA = Path(__file__).resolve().parent / "data"


def _server(link: netns.VethLink, root: Path, *, local: bool = False) -> ServerProcess:
    """A server of ``root`` with two decode threads: in the server namespace, with a
    /dev/shm of its own (so the trainer reads it inline, as from another host), or
    ``local``: in the trainer's namespace, sharing its /dev/shm (shm)."""
    args = ["--data-root", str(root), "--threads", "2"]
    if local:
        return ServerProcess(args, prefix=link.client_command([]))
    private_shm = ["unshare", "--mount", "sh", "-c",
                   'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]
    return ServerProcess([*args, "--listen", f"{netns.SERVER_ADDRESS}:0"],
                         prefix=link.server_command(private_shm))


class _CpuLimit:
    """A CPU cgroup that holds a process to ``cores`` cores (CFS quota; cgroup v1's
    cpu controller, or v2's cpu.max), removed on exit."""

    def __init__(self, name: str, cores: float):
        v1 = Path("/sys/fs/cgroup/cpu")
        self.path = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"{name}-{os.getpid()}"
        self.path.mkdir()
        quota = int(cores * 100_000)
        if (self.path / "cpu.cfs_quota_us").exists():
            (self.path / "cpu.cfs_period_us").write_text("100000")
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{quota} 100000")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def __enter__(self) -> _CpuLimit:
        return self

    def __exit__(self, *exc) -> None:
        self.path.rmdir()


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
                   resize="random_resized_crop", shuffle=True, seed=7, prefetch=args.prefetch)
    before = [_batches_sent(s) for s in servers]
    ends_before = [_stream_ends(s) for s in servers]
    with FeedClient(addresses) as feed:
        loader = feed.loader(args.list_file, **options)
        if len(addresses) == 1:
            print(f"  [{name}] transport {loader.transport}", flush=True)
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


def unavailable_reason() -> str | None:
    """Why the bench cannot run here (no namespaces, no CPU cgroups), or None."""
    why = netns.unavailable_reason()
    if why:
        return why
    v1 = Path("/sys/fs/cgroup/cpu")
    where = v1 if v1.is_dir() else Path("/sys/fs/cgroup")
    if not os.access(where, os.W_OK) or not (
            (where / "cpu.cfs_quota_us").exists() or (where / "cgroup.controllers").exists()):
        return f"no writable CPU cgroup controller at {where}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--size", type=int, default=160)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data-dir", type=Path, default=_DATA)
    parser.add_argument("--cores", type=lambda text: tuple(map(float, text.split(","))),
                        help="CPU cores A and B may use (CFS quota), e.g. 0.6,0.3 (the "
                             "default; 0.6,0.6 with --local)")
    parser.add_argument("--local", action="store_true",
                        help="A is the trainer's local server (shm), B a remote one, no busy "
                             "loop: does adding B raise the rate by 0.8x of B's own?")
    args = parser.parse_args(argv)
    why = unavailable_reason()
    if why:
        print(f"unavailable: {why}")
        return 1
    data = build(args.data_dir / f"jpeg{args.images}", args.images)
    args.list_file = str(data.list_file)
    limits = args.cores or ((0.6, 0.6) if args.local else (0.6, 0.3))
    names = ([f"A, local shm {limits[0]:g} core", f"B, remote {limits[1]:g} core",
              "A + B, local first"] if args.local else
             [f"A alone, {limits[0]:g} core", f"B alone, {limits[1]:g} core",
              "A + B, dealt by pace"])
    with netns.VethLink() as link, _CpuLimit("gpufeed-pace-a", limits[0]) as limit_a, \
            _CpuLimit("gpufeed-pace-b", limits[1]) as limit_b:
        a, b = _server(link, data.root, local=args.local), _server(link, data.root)
        with a, b:
            for server, limit in ((a, limit_a), (b, limit_b)):
                assert server.proc is not None
                limit.add(server.proc.pid)
            netns.enter(link.client_ns)
            _row("warm-up (not counted)", [a.address, b.address], [a, b], args)
            rounds = [[_row(names[0], [a.address], [a], args),
                       _row(names[1], [b.address], [b], args),
                       _row(names[2], [a.address, b.address], [a, b], args)]
                      for _ in range(args.rounds)]
    print(f"\n{'round':<6} {'row':<24} {'img/s':>8} {'trainer ms/img':>15} "
          f"{'servers ms/img':>15}  batches")
    for number, rows in enumerate(rounds, 1):
        for row in rows:
            print(f"{number:<6} {row['row']:<24} {row['img_s']:>8.0f} {row['trainer_ms']:>15.2f} "
                  f"{row['servers_ms']:>15.2f}  {row['batches']}")
    for number, (alone_a, alone_b, both) in enumerate(rounds, 1):
        if args.local:
            gain = both["img_s"] - alone_a["img_s"]
            print(f"round {number}: adding B raised the rate by {gain:.0f} img/s, "
                  f"{gain / alone_b['img_s']:.2f}x of B alone (target >= 0.80x)")
            continue
        solo = alone_a["img_s"] + alone_b["img_s"]
        in_turn = 2 * min(alone_a["img_s"], alone_b["img_s"])
        print(f"round {number}: both / (A alone + B alone) = {both['img_s'] / solo:.2f}x "
              f"(target >= 0.90x); dealt in turn, 2 x the slower = {in_turn / solo:.2f}x "
              f"(computed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
