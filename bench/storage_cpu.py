"""``python -m bench.storage_cpu``: CPU seconds per 1000 images, by process, for gpufeed
reading local loose files, local tar shards, and tar shards from S3.

The tar shards' speed goal (tar shards from local S3 >= 0.9x local loose files, in
images/s) needs a quiet machine. CPU time is what a shared one can measure:
other programs' load slows a process but barely changes the CPU it spends per
image. The bench rows' CPU column sums the row's whole process tree, which for
the S3 rows includes SeaweedFS answering on the same cores; this splits it per
process: the gpufeed server, the trainer (this process: the client and the shm
reads), and SeaweedFS (``weed``: master, volume, filer and S3 gateway in one
process), over the same passes (after 3 warm-up batches) of the JPEG set of
``bench.run`` (built or reused in ``bench/data/``), 224x224 uint8, batch 32,
2 decode threads, unshuffled, over shm. Each source runs ``--rounds`` times
in turn; the table has the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from . import dataset
from .measure import tree_cpu_seconds
from .peers.shards import BUCKET, _pattern, pack, seaweed_shards
from .worker import Config

_HERE = Path(__file__).resolve().parent
_WARMUP = 3
_SOURCES = ("loose-local", "shards-local", "shards-s3")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.storage_cpu", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data-dir", type=Path, default=_HERE / "data")
    p.add_argument("--sources", default=",".join(_SOURCES),
                   help=f"which of {', '.join(_SOURCES)} to measure (default: all)")
    args = p.parse_args(argv)
    sources = args.sources.split(",")
    if unknown := set(sources) - set(_SOURCES):
        p.error(f"--sources: unknown {', '.join(sorted(unknown))}")
    data = dataset.build(args.data_dir / f"jpeg{args.images}", args.images)
    config = Config(root=str(data.root.resolve()), list_file=data.list_file.name,
                    names=data.names, passes=args.passes)
    results: dict[str, list[dict[str, float]]] = {s: [] for s in sources}
    for round_ in range(args.rounds):
        for source in sources:
            cpu = _measure(config, source)
            results[source].append(cpu)
            print(f"round {round_ + 1}, {source}: " + ", ".join(
                f"{who} {seconds:.2f}" for who, seconds in cpu.items()) +
                " CPU s / 1000 images", flush=True)
    print("\n| source | server | trainer | SeaweedFS | total |\n|---|---:|---:|---:|---:|")
    for source, rounds in results.items():
        median = {who: statistics.median(r[who] for r in rounds) for who in rounds[0]}
        print(f"| {source} | {median['server']:.2f} | {median['trainer']:.2f} | "
              f"{median['seaweedfs']:.2f} | {sum(median.values()):.2f} |")
    return 0


def _measure(config: Config, source: str) -> dict[str, float]:
    """CPU seconds per 1000 images of each process over the passes after the warm-up."""
    if source == "loose-local":
        return _read(config, source, ["--data-root", config.root], config.list_file, None)
    folder, shards = pack(config)
    if source == "shards-local":
        return _read(config, source, ["--data-root", str(folder)], [_pattern(shards)], None)
    with seaweed_shards(config) as (s3, shards):
        return _read(config, source, ["--data-root", f"s3://{BUCKET}/shards", "--s3-endpoint",
                              s3.endpoint], [_pattern(shards)], s3)


def _read(config: Config, source: str, args: list[str], files: str | list[str],
          s3) -> dict[str, float]:
    from gpufeed.client import FeedClient
    from gpufeed.server.process import ServerProcess

    env = s3.env if s3 is not None else None
    with ServerProcess(["--threads", str(config.threads), *args], env=env) as server, \
            FeedClient(server.address) as feed:
        def clocks() -> tuple[float, float, float]:
            return (tree_cpu_seconds(server.proc.pid), tree_cpu_seconds(),
                    tree_cpu_seconds(s3.proc.pid) if s3 is not None else 0.0)

        loader = feed.loader(files=files,
                             batch_size=config.batch_size, size=tuple(config.size),
                             transport="shm")
        images = batches = counted = 0
        start = None
        for _ in range(config.passes):
            for batch in loader:
                images, batches = images + len(batch["image"]), batches + 1
                if batches == _WARMUP:
                    start, counted = clocks(), images
        end = clocks()
    if start is None or images == counted:
        raise SystemExit(f"{source}: too few batches to measure past the warm-up")
    per = 1000 / (images - counted)
    server_cpu, whole, weed = (b - a for a, b in zip(start, end))
    # This process's tree holds the server and SeaweedFS too: the trainer is the rest.
    return {"server": server_cpu * per, "trainer": (whole - server_cpu - weed) * per,
            "seaweedfs": weed * per}


if __name__ == "__main__":
    sys.exit(main())
