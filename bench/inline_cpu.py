"""``python -m bench.inline_cpu``: inline's extra CPU per batch over shm, by process and
user/system.

The goal for remote trainers is inline's extra CPU over shm <= 2 ms per 4.8 MB
batch (bench/RESULTS.md, "Inline's extra CPU, the transport alone"). The
bench rows' CPU column sums the whole process tree, where decoding (~30 ms of
CPU per batch of JPEGs) swamps a few ms of transport. This measures the
transport alone: a real server subprocess serves .npy files of uint8
[3, 224, 224] (a 4.8 MB batch of 32, the size of a decoded image batch, for the
price of a page-cache read), and this process reads them as a trainer does
(counts each batch and drops it), over shm and over inline in turn, on one
server and one client, ``--rounds`` times alternating the order. A pass holds
every warm-up and measured batch (``--samples`` defaults to that many files),
so each measurement is one stream: a new stream maps and faults in a new shm
ring, which is set-up, not what moving a batch costs. CPU is each
process's user and system time from /proc (the server with its descendants,
the client this process) over the batches after ``--warmup``, and their minor
page faults; the table gives the median per batch and inline's extra over
shm. A CPU measurement: other programs' load changes it little, where
images/s move a lot.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from .measure import tree_usage

__all__ = ["main", "measure", "write_samples"]

_SHAPE = (3, 224, 224)
_TRANSPORTS = ("shm", "inline")
_CPU = ("server user", "server system", "client user", "client system")


def _client_user_system() -> tuple[float, float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # this process: the server is not waited for
    return usage.ru_utime, usage.ru_stime, usage.ru_minflt


def write_samples(folder: Path, count: int) -> list[str]:
    """``count`` .npy files of random uint8 [3, 224, 224] in ``folder``; their names."""
    rng = np.random.default_rng(0)
    names = []
    for i in range(count):
        name = f"{i:05d}.npy"
        np.save(folder / name, rng.integers(0, 256, _SHAPE, dtype=np.uint8))
        names.append(name)
    return names


def measure(feed, server_pid: int, names: list[str], transport: str, batches: int,
            warmup: int, batch_size: int = 32) -> dict[str, float]:
    """CPU ms per batch (server/client x user/system) of ``batches`` batches after
    ``warmup``, read over ``transport``."""
    loader = feed.loader(files=names, batch_size=batch_size, transport=transport,
                         drop_last=True)
    seen = 0
    start = (tree_usage(server_pid), _client_user_system()) if warmup == 0 else None
    while start is None or seen < warmup + batches:
        for batch in loader:
            seen += 1
            del batch
            if seen == warmup:
                start = tree_usage(server_pid), _client_user_system()
            if seen == warmup + batches:
                break
    end = tree_usage(server_pid), _client_user_system()
    (su0, ss0, sf0), (cu0, cs0, cf0) = start
    (su1, ss1, sf1), (cu1, cs1, cf1) = end
    per = 1000 / batches
    return {"server user": (su1 - su0) * per, "server system": (ss1 - ss0) * per,
            "client user": (cu1 - cu0) * per, "client system": (cs1 - cs0) * per,
            "server faults": (sf1 - sf0) / batches, "client faults": (cf1 - cf0) / batches}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.inline_cpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=None,
                   help=".npy files served in a pass (default: 32 x (warm-up + batches))")
    p.add_argument("--batches", type=int, default=200, help="measured batches per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="the server's decode threads")
    p.add_argument("--transports", default=",".join(_TRANSPORTS),
                   help="which of shm, inline to read (default: both; one, e.g. to profile it)")
    args = p.parse_args(argv)
    samples = args.samples or 32 * (args.warmup + args.batches)
    transports = tuple(args.transports.split(","))
    if set(transports) - set(_TRANSPORTS):
        p.error(f"--transports: one or both of {', '.join(_TRANSPORTS)}")

    from gpufeed.client import FeedClient
    from gpufeed.server.process import ServerProcess

    results: dict[str, list[dict[str, float]]] = {t: [] for t in transports}
    with tempfile.TemporaryDirectory(prefix="inline-cpu-") as tmp:
        names = write_samples(Path(tmp), samples)
        with ServerProcess(["--data-root", tmp, "--threads", str(args.threads)]) as server, \
                FeedClient(server.address) as feed:
            for round_ in range(args.rounds):
                order = transports if round_ % 2 == 0 else transports[::-1]
                for transport in order:
                    cpu = measure(feed, server.proc.pid, names, transport, args.batches,
                                  args.warmup)
                    results[transport].append(cpu)
                    print(f"round {round_ + 1}, {transport}: " + ", ".join(
                        f"{who} {ms:.2f}" for who, ms in cpu.items() if who in _CPU) +
                        " CPU ms / batch; minor page faults / batch: server "
                        f"{cpu['server faults']:.0f}, client {cpu['client faults']:.0f}",
                        flush=True)
    median = {t: {who: statistics.median(r[who] for r in rounds) for who in rounds[0]}
              for t, rounds in results.items()}
    rows = list(median.items())
    if len(median) == 2:
        rows.append(("inline - shm", {who: median["inline"][who] - median["shm"][who]
                                      for who in median["shm"]}))
    columns = list(rows[0][1])
    print(f"\nCPU ms per batch of 32 x {list(_SHAPE)} uint8 (4.8 MB), median of {args.rounds}"
          f" rounds of {args.batches} batches\n")
    print("| transport | " + " | ".join(f"{c} ms" for c in _CPU) + " | total ms | "
          + " | ".join(c for c in columns if c not in _CPU) + " |")
    print("|---|" + "---:|" * (len(columns) + 1))
    for name, row in rows:
        print(f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in _CPU) +
              f" | {sum(row[c] for c in _CPU):.2f} | " +
              " | ".join(f"{row[c]:.0f}" for c in columns if c not in _CPU) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
