"""``python -m bench.gpu.stages``: where a batch's time goes after nvImageCodec decodes it.

The device check's probe finds nvImageCodec's batched region decode alone at
10,000-15,000 images/s on an H100, at 0.1-0.3 CPU s per 1000 images, while the
server's ``--decoder nvimgcodec`` row makes 1500-2300 images/s. So the time is in
what follows the decode, or around it. This times, on the bench's JPEGs, a batch of
random crops through:

- ``server``: the server's own ``BatchJpegDecoder.decode`` (regions, the batch's
  resampling, the batch copied to pinned host memory), on one thread and on 2, 4
  and 16 at once, each with its decoder (the server shares two); resampled by the
  CUDA kernel where prepare.sh built it, and, on one thread, by torch
  (``server-torch``); and on one thread into rows on the GPU, as a cuda_ipc batch of
  JPEGs alone is decoded into the slot the trainer reads (``server into the device``);
- ``server x2 beside readers``: two of them while 14 (or 2) more threads read and
  parse the files as the server's decode threads do, with Python's default GIL
  switch interval and with 0.5 ms;
- ``interpolate``: the ceiling row's per-image ``interpolate(antialias=True)``;

and prints torch.profiler's busiest operations for each, CPU and GPU.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

__all__ = ["main"]


def _jobs(files, sizes, boxes, at: int, batch: int):
    from gpufeed.server.media.batch_jpeg import Deferred

    picked = [(at + i) % len(files) for i in range(batch)]
    return [Deferred(row, files[i], boxes[i], row % 2 == 1, sizes[i])
            for row, i in enumerate(picked)]


def _output(batch: int, size):
    """A batch's rows in host memory, pinned where there is CUDA, as the served cuda_ipc
    row's host ring is (the decode writes every row)."""
    import torch

    return torch.empty((batch, 3, *size), dtype=torch.uint8,
                       pin_memory=torch.cuda.is_available()).numpy()


def _server(decoder, files, sizes, boxes, batches: int, batch: int, size, at: int = 0,
            out=None, device_out=None) -> float:
    if out is None:
        out = _output(batch, size)
    began = time.perf_counter()
    for k in range(at, at + batches):
        left = decoder.decode(_jobs(files, sizes, boxes, k * batch, batch), out, device_out)
        assert not left, f"{len(left)} handed back"
    return time.perf_counter() - began


def _together(decoders, files, sizes, boxes, seconds: float, batch: int, size) -> str:
    """Every decoder on a thread of its own, batch after batch for ``seconds``: the rate
    of the batches they finished together, or the first error."""
    done = [0] * len(decoders)
    errors: list[str] = []
    deadline = time.perf_counter() + seconds

    def one(k: int) -> None:
        out = _output(batch, size)
        try:
            while time.perf_counter() < deadline:
                _server(decoders[k], files, sizes, boxes, 1, batch, size, at=done[k] + 97 * k,
                        out=out)
                done[k] += 1
        except Exception as e:  # reported, not raised in a thread nobody joins for it
            errors.append(f"{type(e).__name__}: {e}")

    began = time.perf_counter()
    workers = [threading.Thread(target=one, args=(k,)) for k in range(len(decoders))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        return f"error: {errors[0]}"
    return f"{sum(done) * batch / (time.perf_counter() - began):.0f} img/s ({sum(done)} batches)"


def _beside_readers(decoders, paths, files, sizes, boxes, seconds: float, batch: int, size,
                    readers: int) -> str:
    """``_together`` while ``readers`` more threads read and parse the bench's files the
    way the server's decode threads do in this path (the bytes, then the header's
    size), as fast as they can: whether the readers, contending for the GIL, slow the
    batch decode that the served row waits on."""
    from gpufeed.server.media.headers import declared_size

    stop = threading.Event()
    read = [0] * readers
    errors: list[str] = []

    def one(k: int) -> None:
        try:
            while not stop.is_set():
                declared_size(paths[(read[k] * readers + k) % len(paths)].read_bytes())
                read[k] += 1
        except Exception as e:  # reported: a reader gone would make the test milder
            errors.append(f"{type(e).__name__}: {e}")

    workers = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(readers)]
    began = time.perf_counter()
    for w in workers:
        w.start()
    try:
        rate = _together(decoders, files, sizes, boxes, seconds, batch, size)
    finally:
        stop.set()
        for w in workers:
            w.join()
    reads = sum(read) / (time.perf_counter() - began)
    if errors:
        return f"error in a reader: {errors[0]}"
    return f"{rate}, {readers} readers reading {reads:.0f} files/s"


def _interpolate(nvimgcodec, decoder, files, boxes, batches: int, batch: int, size) -> float:
    import torch

    from bench.peers.gpu import resize_flip

    params = nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                     color_spec=nvimgcodec.ColorSpec.SRGB)
    stream = torch.cuda.current_stream()
    began = time.perf_counter()
    for k in range(batches):
        codes = []
        for i in range(k * batch, (k + 1) * batch):
            i %= len(files)
            top, left, h, w = (int(v) for v in boxes[i])
            codes.append(nvimgcodec.CodeStream(files[i]).get_sub_code_stream(
                region=nvimgcodec.Region(top, left, top + h, left + w)))
        out = torch.empty((batch, 3, *size), dtype=torch.uint8, device="cuda")
        for j, image in enumerate(decoder.decode(codes, params=params,
                                                 cuda_stream=stream.cuda_stream)):
            out[j] = resize_flip(torch.from_dlpack(image).permute(2, 0, 1), size, j % 2 == 1)
        stream.synchronize()
    return time.perf_counter() - began


def _profiled(name: str, run) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    table = prof.key_averages()
    for by, key, rows in (("CPU", "self_cpu_time_total", 16),
                          ("GPU", "self_device_time_total", 10)):
        shown = table.table(sort_by=key, row_limit=rows, max_name_column_width=48)
        print(f"--- {name}: by {by} time\n{shown}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.stages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="a bench data set (bench.dataset)")
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--seconds", type=float, default=3.0,
                   help="how long the decoders decode together, at each thread count")
    p.add_argument("--cpu", action="store_true",
                   help="the server's path on nvImageCodec's CPU backend, to try this script "
                        "where there is no GPU (no interpolate row, no profile)")
    args = p.parse_args(argv)
    import torch

    from bench import jobs
    from gpufeed.server.media.batch_jpeg import BatchJpegDecoder, load
    from gpufeed.server.media.headers import declared_size

    if not torch.cuda.is_available() and not args.cpu:
        print("stages: no CUDA device")
        return 0
    nvimgcodec = load()
    names = (args.data / "bench.flist").read_text().split()
    files = [(args.data / n).read_bytes() for n in names]
    sizes = [declared_size(f)[::-1] for f in files]
    torch.manual_seed(0)
    boxes = []
    for height, width in sizes:
        left, top, w, h = jobs.random_box(width, height)
        boxes.append((float(top), float(left), float(h), float(w)))
    batch, size = 32, (224, 224)
    device = torch.device("cpu" if args.cpu else "cuda:0")

    decoder = BatchJpegDecoder(device)
    kernel = "resample kernel" if decoder.uses_kernel else "torch (no kernel built)"
    for name, one_decoder in (("server", decoder),
                              ("server-torch", BatchJpegDecoder(device, kernel=False))):
        _server(one_decoder, files, sizes, boxes, 3, batch, size)  # warm-up
        seconds = _server(one_decoder, files, sizes, boxes, args.batches, batch, size)
        how = kernel if name == "server" else "torch"
        print(f"stages {name} x1 ({how}): {args.batches * batch / seconds:.0f} img/s",
              flush=True)
    rows = torch.empty((batch, 3, *size), dtype=torch.uint8, device=device)
    seconds = _server(decoder, files, sizes, boxes, args.batches, batch, size, device_out=rows)
    print(f"stages server into the device x1 ({kernel}): "
          f"{args.batches * batch / seconds:.0f} img/s", flush=True)

    # How the rate holds up as more decoders decode at once, each on its thread: what
    # the server's count of shared decoders (batch_jpeg.CONCURRENT) was chosen by.
    decoders = [BatchJpegDecoder(device) for _ in range(16)]
    for d in decoders:
        _server(d, files, sizes, boxes, 1, batch, size)
    for threads in (2, 4, 16):
        rate = _together(decoders[:threads], files, sizes, boxes, args.seconds, batch, size)
        print(f"stages server x{threads}: {rate}", flush=True)
    # The served row makes about half of what two decoders make alone, with its 16
    # threads mostly idle: are the threads reading beside the decode what slows it?
    paths = [args.data / n for n in names]
    for readers, interval in ((14, None), (14, 0.0005), (2, None)):
        default = sys.getswitchinterval()
        if interval is not None:
            sys.setswitchinterval(interval)
        try:
            rate = _beside_readers(decoders[:2], paths, files, sizes, boxes, args.seconds,
                                   batch, size, readers)
        finally:
            sys.setswitchinterval(default)
        switch = f", GIL switch interval {interval * 1000:g} ms" if interval else ""
        print(f"stages server x2 beside readers{switch}: {rate}", flush=True)

    if args.cpu:
        return 0
    plain = nvimgcodec.Decoder()
    _interpolate(nvimgcodec, plain, files, boxes, 3, batch, size)
    seconds = _interpolate(nvimgcodec, plain, files, boxes, args.batches, batch, size)
    print(f"stages interpolate x1: {args.batches * batch / seconds:.0f} img/s", flush=True)

    _profiled("server", lambda: _server(decoder, files, sizes, boxes, 10, batch, size))
    _profiled("interpolate",
              lambda: _interpolate(nvimgcodec, plain, files, boxes, 10, batch, size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
