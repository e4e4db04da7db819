"""``python -m bench.s3_gets``: the CPU one ranged GET costs the reading process, by client
and chunk size, against SeaweedFS on loopback (docs/decisions/0107-boto3-for-s3-chunk-reads.md).

Two ways to fetch the same byte range of one object: boto3's ``get_object(Range=...)``
then ``Body.read()`` (what the server does for every S3 chunk), and an HTTP GET of a
presigned URL (made once by boto3's own signer, no network call) with a ``Range``
header on a urllib3 connection pool, the body read whole. Each GET reads the next
consecutive range of a 64 MiB object of random bytes, one thread, keep-alive. The
methods alternate within each round, ``--rounds`` rounds; the table has each
figure's median of CPU ms per GET (``time.process_time`` of this process: SeaweedFS
answers in its own) and, from the sizes, the fixed cost per GET and per MiB.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .seaweed import SeaweedS3

__all__ = ["main"]

_BUCKET, _KEY = "gets", "blob"
_OBJECT = 64 << 20


def _boto3_get(client):
    def get(start: int, size: int) -> int:
        reply = client.get_object(Bucket=_BUCKET, Key=_KEY,
                                  Range=f"bytes={start}-{start + size - 1}")
        return len(reply["Body"].read())
    return get


def _presigned_get(client, pool):
    url = client.generate_presigned_url("get_object", Params={"Bucket": _BUCKET, "Key": _KEY},
                                        ExpiresIn=3600)

    def get(start: int, size: int) -> int:
        reply = pool.request("GET", url, headers={"Range": f"bytes={start}-{start + size - 1}"},
                             preload_content=False)
        try:
            return len(reply.read())
        finally:
            reply.release_conn()
    return get


def _presigned_readinto(client, pool):
    """The same, the body read into one preallocated buffer through urllib3's readinto."""
    url = client.generate_presigned_url("get_object", Params={"Bucket": _BUCKET, "Key": _KEY},
                                        ExpiresIn=3600)
    buffer = bytearray(_OBJECT)  # as large as any range of the object

    def get(start: int, size: int) -> int:
        reply = pool.request("GET", url, headers={"Range": f"bytes={start}-{start + size - 1}"},
                             preload_content=False)
        try:
            view, got = memoryview(buffer)[:size], 0
            while got < size and (n := reply.readinto(view[got:])):
                got += n
            return got
        finally:
            reply.release_conn()
    return get


def _cpu_per_get(get, size: int, gets: int) -> float:
    """CPU ms per GET over ``gets`` consecutive ranges of ``size`` bytes."""
    starts = [(i * size) % (_OBJECT - size + 1) for i in range(gets)]
    get(0, size)  # the connection made, outside the figure
    begin = time.process_time()
    for start in starts:
        if get(start, size) != size:
            raise SystemExit("a GET came back short")
    return (time.process_time() - begin) * 1000 / gets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.s3_gets",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", default="4096,1048576,4194304,8388608,16777216")
    p.add_argument("--bytes-per-size", type=int, default=64 << 20,
                   help="bytes fetched per size and method in a round (20 to 200 GETs)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    import urllib3

    with tempfile.TemporaryDirectory() as folder, SeaweedS3(Path(folder)) as s3:
        client = s3.client()
        client.create_bucket(Bucket=_BUCKET)
        client.put_object(Bucket=_BUCKET, Key=_KEY,
                          Body=np.random.default_rng(0).bytes(_OBJECT))
        pool = urllib3.PoolManager(maxsize=1)
        methods = {"boto3": _boto3_get(client), "presigned": _presigned_get(client, pool),
                   "presigned-readinto": _presigned_readinto(client, pool)}
        results: dict[tuple[str, int], list[float]] = {}
        for round_ in range(args.rounds):
            for size in sizes:
                gets = min(200, max(20, args.bytes_per_size // size))
                for name, get in methods.items():
                    ms = _cpu_per_get(get, size, gets)
                    results.setdefault((name, size), []).append(ms)
                    print(f"round {round_ + 1}, {name}, {size} B: {ms:.3f} CPU ms per GET",
                          flush=True)
    print("\nCPU ms per GET (median of rounds)\n")
    print("| chunk | " + " | ".join(methods) + " |\n|---|" + "---:|" * len(methods))
    for size in sizes:
        print(f"| {size / 2**20:g} MiB | " + " | ".join(
            f"{statistics.median(results[name, size]):.3f}" for name in methods) + " |")
    print("\nFit: CPU ms per GET = fixed + per MiB x size\n")
    for name in methods:
        x = np.array([s / 2**20 for s in sizes])
        y = np.array([statistics.median(results[name, s]) for s in sizes])
        per_mib, fixed = np.polyfit(x, y, 1)
        print(f"- {name}: fixed {fixed:.3f} ms, {per_mib:.3f} ms per MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
