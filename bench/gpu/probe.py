"""``python -m bench.gpu.probe``: nvImageCodec's decode alone, in the configurations the
server could use, on the bench's JPEGs (the device check's fourth step).

The first device run found nvImageCodec's batched region decode far slower on an
H100 than a GPU decoder should be, and CPU-bound. Its knobs are not documented by
their effect on a data set like ours (457 x 395 photos, about 97 KB), so this
measures each: which backend decodes (the hardware JPEG decoder, nvJPEG's CUDA
decoder with the Huffman stage on the GPU or on the CPU), a region of interest
against the whole image, the batch size, and how many threads each decoder keeps
against how many decoders run at once (the server runs two), and whether the files
lie in pageable or pinned host memory (the server stages them in pinned memory).

Each configuration decodes batches of CodeStreams for about ``--seconds`` after
two warm-up batches and reports images/s and the process's CPU seconds per 1000
images, with the output left on the device (the wait for it is counted). A
configuration that fails says why, and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

__all__ = ["main"]

# name: (backend kinds or None for every backend, options, region, batch, decoders,
#        CPU threads per decoder or 0 for nvImageCodec's default: every core[, the files
#        in pinned host memory, as the server stages them (copied there once, so the
#        CPU figure leaves out the server's copy per batch): default pageable bytes])
_CONFIGS = {
    "default-full-b32": (None, "", False, 32, 1, 0),
    "default-roi-b32-pinned": (None, "", True, 32, 1, 0, True),
    "default-roi-b32-x2-t1": (None, "", True, 32, 2, 1),
    "default-roi-b32-x2-t1-pinned": (None, "", True, 32, 2, 1, True),
    "default-roi-b32": (None, "", True, 32, 1, 0),
    "default-roi-b128": (None, "", True, 128, 1, 0),
    "hw-full-b32": (["HW_GPU_ONLY"], "", False, 32, 1, 0),
    "hw-roi-b32": (["HW_GPU_ONLY"], "", True, 32, 1, 0),
    "hw-full-b128": (["HW_GPU_ONLY"], "", False, 128, 1, 0),
    "cuda-gpuhuff-roi-b32": (["GPU_ONLY"], "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0",
                             True, 32, 1, 0),
    "cuda-gpuhuff-roi-b128": (["GPU_ONLY"], "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0",
                              True, 128, 1, 0),
    "cuda-roi-b32": (["GPU_ONLY"], "", True, 32, 1, 0),
    "hybrid-roi-b32": (["HYBRID_CPU_GPU"], "", True, 32, 1, 0),
    "default-roi-b32-x16-t1": (None, "", True, 32, 16, 1),
    "default-roi-b32-x4-t4": (None, "", True, 32, 4, 4),
    "hw-roi-b32-x4-t2": (["HW_GPU_ONLY"], "", True, 32, 4, 2),
    "gpuhuff-roi-b32-x4-t2": (["GPU_ONLY"], "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0",
                              True, 32, 4, 2),
    "gpuhuff-roi-b32-x16-t1": (["GPU_ONLY"], "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0",
                               True, 32, 16, 1),
    "hw-full-b32-x4-t2": (["HW_GPU_ONLY"], "", False, 32, 4, 2),
}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _boxes(sizes: list[tuple[int, int]], seed: int) -> list[tuple[int, int, int, int]]:
    """A random-resized-crop box (top, left, bottom, right) per image, as bench.jobs draws."""
    import torch

    from bench import jobs

    torch.manual_seed(seed)
    found = []
    for height, width in sizes:
        left, top, w, h = jobs.random_box(width, height)
        found.append((top, left, top + h, left + w))
    return found


def _measure(nvimgcodec, torch, files: list[bytes], boxes, config, seconds: float) -> dict:
    kinds, options, roi, batch, decoders, threads, *pinned = config
    cuda = torch.cuda.is_available()
    if pinned and pinned[0]:
        files = _pinned(torch, files, cuda)
    made = []
    for _ in range(decoders):
        kwargs = {"max_num_cpu_threads": threads, "options": options}
        if kinds is not None:
            kwargs["backends"] = [nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, k))
                                  for k in kinds]
        if not cuda:  # a dry run: the CPU backend is all there is
            kwargs = {"device_id": nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY, "max_num_cpu_threads": 1,
                      "backends": [nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)]}
        made.append(nvimgcodec.Decoder(**kwargs))
    params = nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                     color_spec=nvimgcodec.ColorSpec.SRGB)
    counts = [0] * decoders
    failed = [0] * decoders
    stop = threading.Event()
    errors: list[str] = []

    def work(k: int, warm: threading.Barrier) -> None:
        decoder = made[k]
        stream = torch.cuda.Stream() if cuda else None
        handle = stream.cuda_stream if stream is not None else 0
        at = (k * 997) % len(files)
        done = 0
        try:
            while not stop.is_set() or done < 2:
                picked = [(at + i) % len(files) for i in range(batch)]
                at = (at + batch) % len(files)
                codes = []
                for i in picked:
                    code = nvimgcodec.CodeStream(files[i])
                    if roi:
                        code = code.get_sub_code_stream(region=nvimgcodec.Region(*boxes[i]))
                    codes.append(code)
                images = decoder.decode(codes, params=params, cuda_stream=handle)
                if stream is not None:
                    stream.synchronize()
                done += 1
                if done == 2:
                    warm.wait()
                elif done > 2:
                    counts[k] += batch
                    failed[k] += sum(image is None for image in images)
        except Exception as e:  # recorded; the barrier must not wait for this thread
            errors.append(f"{type(e).__name__}: {e}")
            warm.abort()

    warm = threading.Barrier(decoders + 1)
    workers = [threading.Thread(target=work, args=(k, warm), daemon=True)
               for k in range(decoders)]
    for w in workers:
        w.start()
    try:
        warm.wait(timeout=60)
    except threading.BrokenBarrierError:
        stop.set()
        return {"status": "error", "error": errors[0] if errors else "warm-up timed out"}
    began, cpu = time.monotonic(), _cpu_seconds()
    start_counts = sum(counts)
    time.sleep(seconds)
    images = sum(counts) - start_counts
    elapsed, used = time.monotonic() - began, _cpu_seconds() - cpu
    stop.set()
    for w in workers:
        w.join(timeout=30)
    if errors:
        return {"status": "error", "error": errors[0]}
    return {"status": "ok", "images_per_second": round(images / elapsed, 1),
            "cpu_seconds_per_1000": round(used / max(images, 1) * 1000, 3),
            "not_decoded": sum(failed)}


def _pinned(torch, files: list[bytes], cuda: bool) -> list:
    """The files copied into one pinned host buffer (where there is CUDA), as numpy views."""
    buffer = torch.empty(sum(len(f) for f in files), dtype=torch.uint8, pin_memory=cuda).numpy()
    views, at = [], 0
    for data in files:
        view = buffer[at:at + len(data)]
        view[:] = memoryview(data)
        views.append(view)
        at += len(data)
    return views


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="a bench data set (bench.dataset)")
    p.add_argument("--out", type=Path, help="a JSON of the results")
    p.add_argument("--seconds", type=float, default=2.0, help="steady state per configuration")
    p.add_argument("--configs", default=",".join(_CONFIGS), help="comma-separated names")
    args = p.parse_args(argv)
    import numpy as np
    import torch

    from gpufeed.server.media.batch_jpeg import load
    from gpufeed.server.media.headers import declared_size

    nvimgcodec = load()
    names = (args.data / "bench.flist").read_text().split()
    files = [(args.data / n).read_bytes() for n in names]
    sizes = [declared_size(f)[::-1] for f in files]
    boxes = _boxes(sizes, seed=0)
    print(f"probe: {len(files)} JPEGs, mean {np.mean([s[1] for s in sizes]):.0f}x"
          f"{np.mean([s[0] for s in sizes]):.0f}, {os.cpu_count()} CPUs, "
          f"{'CUDA' if torch.cuda.is_available() else 'no CUDA: the CPU backend'}", flush=True)
    results = {}
    for name in args.configs.split(","):
        began = time.monotonic()
        try:
            found = _measure(nvimgcodec, torch, files, boxes, _CONFIGS[name], args.seconds)
        except Exception as e:  # a configuration nvImageCodec refuses
            found = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        found["seconds"] = round(time.monotonic() - began, 1)
        results[name] = found
        print(f"probe {name}: {json.dumps(found)}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
