"""Many ranks opening one ImageNet-sized list together: seconds to each rank's first batch,
and what the server grows by.

Run from the repository root (the data set is built on the first run, ~20 s)::

    .venv/bin/python -m bench.open_scale                 # 8 ranks, 1,281,167 lines
    .venv/bin/python -m bench.open_scale --ranks 1,4,8   # one server per row

Each row starts a fresh server on the data set, opens one small warm-up stream
(imports, thread stacks, the decoders), then starts ``--ranks`` trainer threads
in this process that open ``rank=r, world_size=ranks, shuffle=True`` loaders on
the list together and take one batch each. It prints each rank's first batch
as it comes, then the row: the seconds to the first and to every rank's first
batch, and the server's resident memory (RSS) after the warm-up, once every
rank has its batch (every stream still open), and its peak in between.

1.28M valid paths without 1.28M files: ``pool/`` holds ``--pool`` small JPEGs
and ``train/`` 1000 class folders that are symbolic links to it, so the list's
lines are ``train/n01440764/ILSVRC2012_img_0001.JPEG<TAB>0`` (40 bytes of
path), the label the class's number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

__all__ = ["build", "main", "open_ranks"]

_LINES = 1_281_167  # ImageNet-1k's training set
_CLASSES = 1000
_LIST = "train.flist"


def build(root: Path, lines: int = _LINES, pool: int = 1300, side: int = 64) -> Path:
    """The data set under ``root`` (reused when its list has ``lines`` lines); its list file."""
    listed = root / f"train-{lines}.flist"
    if listed.exists():
        return listed
    from gpufeed.server.demo import encode_jpeg, synthetic_photo

    (root / "pool").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = [f"ILSVRC2012_img_{i:04d}.JPEG" for i in range(pool)]
    for name in names:
        if not (root / "pool" / name).exists():
            (root / "pool" / name).write_bytes(encode_jpeg(synthetic_photo(rng, side, side)))
    (root / "train").mkdir(exist_ok=True)
    classes = [f"n{1440764 + 7 * c:08d}" for c in range(_CLASSES)]
    for wnid in classes:
        link = root / "train" / wnid
        if not link.is_symlink():
            link.symlink_to("../pool", target_is_directory=True)
    per_class = np.full(_CLASSES, lines // _CLASSES)
    per_class[:lines % _CLASSES] += 1
    if per_class.max() > pool:
        raise SystemExit(f"--pool {pool} is fewer than the {per_class.max()} images a class needs")
    text = "".join(f"train/{wnid}/{names[i]}\t{c}\n" for c, (wnid, count)
                   in enumerate(zip(classes, per_class.tolist())) for i in range(count))
    tmp = listed.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(listed)
    return listed


def _rss_mb(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for {pid}")


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as clear:
        clear.write("5")


def open_ranks(address: str, files: str, ranks: int, *, batch_size: int = 32, size: int = 224,
               labels: str | None = "list_file", progress=print,
               while_open=lambda: None) -> list[float]:
    """``ranks`` trainer threads open rank r of ``ranks`` on ``files`` at one moment and each
    takes one batch; the seconds from that moment to each rank's first batch.
    ``while_open()`` runs once every rank has its batch, before any stream ends."""
    from gpufeed.client import FeedClient

    start = threading.Barrier(ranks + 1)
    held = threading.Barrier(ranks + 1)  # every rank has its batch, its stream still open
    done = threading.Event()
    firsts: list[float] = [float("nan")] * ranks
    errors: list[BaseException] = []

    def rank(r: int, feed: FeedClient) -> None:
        start.wait()
        began = time.monotonic()
        try:
            loader = feed.loader(files, batch_size=batch_size, size=size, labels=labels,
                                 shuffle=True, seed=1, rank=r, world_size=ranks)
            batches = iter(loader)  # kept: a dropped iterator ends its stream
            batch = next(batches)
            assert batch["image"].shape[0] == batch_size
            firsts[r] = time.monotonic() - began
            progress(f"  rank {r}: first batch after {firsts[r]:.1f} s")
        except BaseException as e:  # reported by the caller
            errors.append(e)
            held.abort()
            return
        try:
            held.wait()
        except threading.BrokenBarrierError:
            return
        done.wait()
        del batch, batches, loader

    feeds = [FeedClient(address) for _ in range(ranks)]  # one per trainer, as processes have
    try:
        threads = [threading.Thread(target=rank, args=(r, feeds[r]), daemon=True)
                   for r in range(ranks)]
        for thread in threads:
            thread.start()
        start.wait()
        try:
            held.wait()
            while_open()
        except threading.BrokenBarrierError:
            pass
        finally:
            done.set()
        for thread in threads:
            thread.join()
    finally:
        for feed in feeds:
            feed.close()
    if errors:
        raise errors[0]
    return firsts


def _row(root: Path, list_file: Path, ranks: int, threads: int, progress=print) -> dict:
    from gpufeed.server.process import ServerProcess

    warm = root / "warm.flist"
    warm.write_text("".join(f"pool/ILSVRC2012_img_{i:04d}.JPEG\t0\n" for i in range(64)))
    with ServerProcess(["--data-root", str(root), "--threads", str(threads)]) as server:
        pid = server.proc.pid
        open_ranks(server.address, warm.name, 1, progress=lambda _: None)  # imports, decoders
        time.sleep(1.0)  # the warm-up stream's end settles
        before = _rss_mb(pid)
        _reset_peak(pid)
        progress(f"{ranks} ranks: server RSS {before:.0f} MB before opening")
        memory: dict[str, float] = {}

        def measure() -> None:
            memory["after"], memory["peak"] = _rss_mb(pid), _rss_mb(pid, "VmHWM")

        firsts = open_ranks(server.address, list_file.name, ranks, progress=progress,
                            while_open=measure)
        after, peak = memory["after"], memory["peak"]
    row = {"ranks": ranks, "lines": sum(1 for _ in open(list_file, "rb")),
           "first_batch_s": round(min(firsts), 2), "every_first_batch_s": round(max(firsts), 2),
           "rss_before_mb": round(before), "rss_growth_mb": round(after - before),
           "peak_growth_mb": round(peak - before)}
    progress(f"{ranks} ranks: first batch {row['first_batch_s']} s, every rank's "
             f"{row['every_first_batch_s']} s; server RSS +{row['rss_growth_mb']} MB "
             f"(peak +{row['peak_growth_mb']} MB)")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="8", help="comma-separated rank counts, one row each")
    parser.add_argument("--lines", type=int, default=_LINES, help="lines of the list file")
    parser.add_argument("--root", type=Path, default=Path("bench/data/open-scale"),
                        help="where the data set is built (and reused)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                        help="the server's decode threads")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    print(f"building or reusing the data set in {args.root} ...", flush=True)
    list_file = build(args.root, args.lines)
    rows = [_row(args.root, list_file, int(n), args.threads, progress=_print)
            for n in args.ranks.split(",")]
    print("\n| ranks | first batch s | every rank's first batch s | server RSS growth MB "
          "| peak growth MB |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['ranks']} | {row['first_batch_s']} | {row['every_first_batch_s']} | "
              f"{row['rss_growth_mb']} | {row['peak_growth_mb']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _print(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
