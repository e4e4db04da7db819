"""An SPDL pipeline, as SPDL's own ImageNet example builds one.

Paths are grouped into batches; ``spdl.io.load_image_batch`` demuxes,
decodes and scales each batch with FFmpeg into one rgb24 [N, H, W, 3] buffer,
in ``threads`` concurrent tasks, and the trainer gets it as a torch tensor.
"""

from __future__ import annotations

from . import Unavailable


def run(config, meter) -> str:
    try:
        import spdl.io
        from spdl.pipeline import PipelineBuilder
    except ImportError:
        raise Unavailable("spdl is not installed (pip install spdl)") from None
    _probe(spdl.io, config.paths[0])
    height, width = config.size

    def load(paths: list[str]):
        buffer = spdl.io.load_image_batch(paths, width=width, height=height, pix_fmt="rgb24")
        return spdl.io.to_torch(buffer)

    # One pipeline over every pass; a pass boundary never splits a batch.
    batches = [config.paths[i:i + config.batch_size]
               for i in range(0, len(config.paths), config.batch_size)] * config.passes
    pipeline = (PipelineBuilder()
                .add_source(batches)
                .pipe(load, concurrency=config.threads)
                .add_sink(4)
                .build(num_threads=config.threads))
    with pipeline.auto_stop():
        for batch in pipeline:
            meter.batch(int(batch.shape[0]))
    meter.stop()
    return f"{config.threads} concurrent batch loads, NHWC rgb24"


def _probe(io, path: str) -> None:
    """SPDL's wheel links FFmpeg's shared libraries from the system; say so if they are missing."""
    try:
        io.demux_image(path)
    except Exception as e:
        if "libspdl" in str(e):
            raise Unavailable("spdl is installed but finds no FFmpeg shared libraries (Debian: "
                              "apt-get install libavutil57 libavcodec59 libavformat59 "
                              "libavfilter8 libswscale6 libavdevice59)") from None
        raise
