"""gpufeed as a trainer sees it: a server process, and trainer processes reading its batches.

The server is started with ``ServerProcess`` on the data set's folder (one
decode thread per core). In ``run`` this process is the trainer, reading the
list file over ``shm`` (zero-copy views of the server's slot ring) or
``inline`` (the bytes inside the gRPC messages), with the loader options of
the row's job (``bench.jobs``): squash; ``resize="random_resized_crop"`` with
the recipe's scale and ratio, ``flip=0.5``, uint8 or float16 normalised; or
``resize="center_crop"`` with the evaluation's shorter side. Each pass over
the files is one stream.

``run_gpu`` is the trainer on a GPU host: over shm, copying each batch to the
GPU itself (``.cuda(non_blocking=True)``, as the README's loop does with
``.to(device, non_blocking=True)``),
or over cuda_ipc from a server started with ``--device cuda:0``, its batches
already on the GPU; with ``--decoder nvimgcodec`` too where the server has it.

``run_trainers`` starts ``count`` trainer processes (``bench.trainer``), each
with its own loader over the same files, over shm, on one server, and
releases them together. Each reports every batch with a CLOCK_MONOTONIC time
stamp; the aggregate rate is taken over the window in which every trainer was
past its warm-up and none had finished yet, so it is the rate of ``count``
trainers really streaming at once (not diluted by the start-up of the
slowest or the tail of the last).
"""

from __future__ import annotations

import threading
import time

from .. import jobs
from ..trainer import TrainerProcess


def _options(job: str, size: tuple[int, int], transform: str = "", prefetch: int = 0) -> dict:
    """The loader options that make gpufeed do ``job`` (``transform``: train-pyloop's;
    ``prefetch``: batches ahead, 0 for the server's default)."""
    if prefetch:
        return {"prefetch": prefetch, **_options(job, size, transform)}
    if job == "squash":
        return {}
    if job == "eval":
        return dict(resize="center_crop", shorter_side=jobs.shorter_side(size))
    crop = dict(resize="random_resized_crop", scale=jobs.SCALE, ratio=jobs.RATIO, flip=jobs.FLIP)
    if job == "train-f16":
        crop.update(dtype="float16", mean=jobs.MEAN, std=jobs.STD)
    if job == "train-aug":
        crop.update(transforms=jobs.AUGMENT)
    if job == "train-pyloop":
        crop.update(transforms=[transform])
    return crop


def measure(loader, config, meter, job: str = "squash", to_gpu: bool = False) -> None:
    """Meter ``config.passes`` passes of a gpufeed loader, its first batch checked
    to be the job's output (every gpufeed row reads its batches this way);
    ``to_gpu``: each batch's image copied to the GPU as a trainer would."""
    for epoch in range(config.passes):
        loader.set_epoch(epoch)
        for batch in loader:
            image = batch["image"]
            if to_gpu:
                image = image.cuda(non_blocking=True)
            if meter.images == 0:
                jobs.check_batch(image.shape, image.dtype, tuple(config.size), job)
                if to_gpu and not image.is_cuda:
                    raise RuntimeError("the row's batches are not on the GPU")
            meter.batch(int(image.shape[0]))
    meter.stop()


def run(config, meter, job: str, transport: str, transform: str = "") -> str:
    from gpufeed.client import FeedClient
    from gpufeed.server.process import ServerProcess

    size = tuple(config.size)
    args = ["--data-root", config.root, "--threads", str(config.threads)]
    if transform:
        args += ["--plugins", "bench.gil_plugin"]
    with ServerProcess(args) as server, FeedClient(server.address) as feed:
        loader = feed.loader(files=config.list_file, batch_size=config.batch_size,
                             size=size, transport=transport,
                             **_options(job, size, transform, config.prefetch))
        measure(loader, config, meter, job)
        if loader.transport != transport:
            raise RuntimeError(f"asked for {transport}, the server chose {loader.transport}")
    return f"server: {config.threads} decode threads; trainer in another process"


def run_gpu(config, meter, job: str, how: str) -> str:
    """``how``: "shm-h2d" (shm, then the trainer's copy to the GPU), "cuda_ipc" (the server
    assembles batches on the GPU) or "nvimgcodec" (cuda_ipc, decoded on the GPU)."""
    import torch

    from gpufeed.client import FeedClient
    from gpufeed.server.process import ServerProcess

    from . import Unavailable

    if not torch.cuda.is_available():
        raise Unavailable("no CUDA device")
    size = tuple(config.size)
    args = ["--data-root", config.root, "--threads", str(config.threads)]
    if how != "shm-h2d":
        args += ["--device", "cuda:0"]
    if how == "nvimgcodec":
        args += ["--decoder", "nvimgcodec"]
    transport = "shm" if how == "shm-h2d" else "cuda_ipc"
    try:
        server = ServerProcess(args).start()
    except RuntimeError as e:
        if how == "nvimgcodec" and "--decoder" in str(e):
            raise Unavailable("this server has no --decoder nvimgcodec yet") from None
        raise
    with server, FeedClient(server.address) as feed:
        loader = feed.loader(files=config.list_file, batch_size=config.batch_size,
                             size=size, transport=transport,
                             **_options(job, size, prefetch=config.prefetch))
        measure(loader, config, meter, job, to_gpu=how == "shm-h2d")
        if loader.transport != transport:
            raise RuntimeError(f"asked for {transport}, the server chose {loader.transport}")
    decoder = "nvImageCodec on the GPU" if how == "nvimgcodec" else (
        f"{config.threads} decode threads")
    return f"server: {decoder}, {transport}; trainer in another process"


def run_trainers(config, meter, count: int):
    from gpufeed.server.process import ServerProcess

    from ..measure import tree_cpu_seconds

    meter.expected = count * config.expected
    lock = threading.Lock()
    cpu: list[tuple[float, float]] = []  # (monotonic, CPU s of this process tree)
    sampling = threading.Event()

    def sample_cpu() -> None:
        while not sampling.is_set():
            cpu.append((time.monotonic(), tree_cpu_seconds()))
            sampling.wait(0.2)
        cpu.append((time.monotonic(), tree_cpu_seconds()))

    def counted(n: int) -> None:
        with lock:
            meter.images += n

    args = ["--data-root", config.root, "--threads", str(config.threads)]
    with ServerProcess(args) as server:
        height, width = config.size
        children = [TrainerProcess(server.address, config.list_file, passes=config.passes,
                                   batch_size=config.batch_size, size=f"{height}x{width}")
                    for _ in range(count)]
        try:
            for child in children:
                child.on_batch = counted
                if not child.ready.wait(120) or child.proc.poll() is not None:
                    raise RuntimeError(f"a trainer did not start: {child.error or 'no message'}")
            sampler = threading.Thread(target=sample_cpu, daemon=True)
            sampler.start()
            for child in children:
                child.go()
            for child in children:
                code = child.stop(600)  # its passes are done by then; stop() only waits
                if code != 0 or child.done is None:
                    raise RuntimeError(f"a trainer failed (exit {code}): "
                                       f"{child.error or 'no message'}")
        finally:
            sampling.set()
            for child in children:
                if child.proc.poll() is None:
                    child.proc.kill()
                    child.proc.wait()
    sampler.join(5)

    # The window in which all trainers streamed: after the last one's warm-up, before the
    # first one's end. (A run too small for such a window falls back to first to last.)
    warm = max(1, config.warmup)
    starts = [c.batches[min(warm, len(c.batches)) - 1][1] for c in children]
    ends = [c.batches[-1][1] for c in children]
    t0, t1 = max(starts), min(ends)
    if t1 <= t0:
        t0, t1 = min(starts), max(ends)
    seconds = t1 - t0
    per_trainer = [sum(n for n, t in c.batches if t0 < t <= t1) for c in children]
    measured = sum(per_trainer)
    meter.window((t0, _at(cpu, t0), 0), (t1, _at(cpu, t1), measured))
    rates = [n / seconds if seconds > 0 else 0.0 for n in per_trainer]
    extra = {
        "trainers": count,
        "per_trainer_images_per_second": rates,
        "per_trainer_delivered": [sum(n for n, _ in c.batches) for c in children],
        "per_trainer_expected": config.expected,
        "all_streaming_seconds": seconds,
    }
    note = (f"{count} trainer process{'es' if count > 1 else ''} x {config.expected} images, "
            f"shm; server: {config.threads} decode threads")
    return note, extra


def _at(samples: list[tuple[float, float]], t: float) -> float:
    """CPU seconds at time ``t``, interpolated between the samples around it."""
    before = max((s for s in samples if s[0] <= t), default=samples[0], key=lambda s: s[0])
    after = min((s for s in samples if s[0] >= t), default=samples[-1], key=lambda s: s[0])
    if after[0] <= before[0]:
        return before[1]
    return before[1] + (after[1] - before[1]) * (t - before[0]) / (after[0] - before[0])
