"""The ceiling: gpufeed's own decoder in a tight loop, one thread per core, no service.

Each thread reads its share of the files and decodes them with
``ImageDecoder`` into the rows of its own batch buffer, as the server's decode
pool does, but with no queue, stream, gRPC or transport. The service can only
approach this; how close it gets is what the server costs.

``python -m bench.peers.ceiling`` measures the decoder's CPU time per image in
one thread for each resize (squash, random-resized crop, centre crop), with
the per-sample choice of crop and flip included: what the JPEG path costs,
read from ``time.thread_time`` so other programs' load moves it little.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

RESIZES = ("squash", "random_resized_crop", "center_crop")


def run(config, meter) -> str:
    from gpufeed.server.media.decode import ImageDecoder

    paths = config.paths * config.passes
    size = config.batch_size
    batches = [paths[i:i + size] for i in range(0, len(paths), size)]
    lock = threading.Lock()
    cursor = iter(batches)

    def work() -> None:
        decoder = ImageDecoder()
        out = np.empty((size, 3, *config.size), np.uint8)
        while True:
            with lock:
                batch = next(cursor, None)
            if batch is None:
                return
            for row, path in enumerate(batch):
                with open(path, "rb") as f:
                    decoder.decode_into(f.read(), out[row])
            with lock:
                meter.batch(len(batch))

    threads = [threading.Thread(target=work) for _ in range(config.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    meter.stop()
    return f"{config.threads} decode threads"


def cpu_ms_per_image(datas: list[bytes], size: tuple[int, int], resize: str) -> float:
    """One thread's CPU ms per image to choose each sample's crop and flip and decode it."""
    from gpufeed.server.media.decode import ImageDecoder
    from gpufeed.server.media.output import OutputTransform
    from gpufeed.v1 import feed_pb2

    spec = feed_pb2.OutputSpec(height=size[0], width=size[1], flip_probability=0.5,
                               resize=getattr(feed_pb2, "RESIZE_" + {
                                   "center_crop": "SHORTER_CENTER_CROP",
                               }.get(resize, resize.upper())))
    transform = OutputTransform(spec, seed=0, epoch=0)
    decoder = ImageDecoder()
    out = np.empty((3, *size), np.uint8)
    started = time.thread_time()
    for index, data in enumerate(datas):
        crop, _ = transform.choose(index)
        decoder.decode_into(data, out, crop)
    return (time.thread_time() - started) / len(datas) * 1000


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.peers.ceiling", description=__doc__)
    p.add_argument("--data", type=Path,
                   default=Path(__file__).resolve().parents[1] / "data" / "jpeg2000",
                   help="a built JPEG set (python -m bench.run builds bench/data/jpeg2000)")
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3, help="rounds per resize; the best is kept")
    p.add_argument("--size", type=int, default=224)
    args = p.parse_args(argv)
    paths = sorted(args.data.glob("*.jpg"))[:args.images]
    if not paths:
        p.error(f"no JPEGs in {args.data}")
    datas = [path.read_bytes() for path in paths]
    from gpufeed.server.media import jpeg
    print(jpeg.describe())
    for resize in RESIZES:
        times = [cpu_ms_per_image(datas, (args.size, args.size), resize)
                 for _ in range(args.rounds)]
        print(f"{resize:>20}: {min(times):.3f} ms CPU / image (rounds: "
              f"{', '.join(f'{t:.3f}' for t in times)}; {len(datas)} images)")


if __name__ == "__main__":
    main()
