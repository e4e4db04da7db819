"""nvImageCodec's ceiling for the training crop: no service, one process.

The bytes are read by a thread pool; each batch's crop boxes are drawn from
the files' headers (``CodeStream`` reads the size without decoding), and the
batch's regions are decoded in one ``Decoder.decode`` call: on the GPU the
hardware JPEG decoder where the chip has one, nvJPEG's CUDA decoder where
not. Each decoded box is resized and flipped on the device (peers/gpu.py) into
the batch. This is what ``--decoder nvimgcodec`` can approach at best, so the
row tells how far the server's own path is from it.

Where there is no GPU it runs on nvImageCodec's CPU backend (libjpeg-turbo),
so that the row's code is exercised on any machine with the package.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .. import jobs
from . import Unavailable
from .gpu import count_when_done, resize_flip


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def run(config, meter, job: str) -> str:
    if job != "train-u8":
        raise ValueError(f"the nvImageCodec row does train-u8, not {job}")
    try:
        from nvidia import nvimgcodec
    except ImportError as e:
        raise Unavailable(f"nvImageCodec is not installed ({e})") from None
    cuda = torch.cuda.is_available()
    if cuda:
        decoder = nvimgcodec.Decoder()
    else:
        decoder = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                                     backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)])
    params = nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                     color_spec=nvimgcodec.ColorSpec.SRGB)
    size = tuple(config.size)
    height, width = size
    device = "cuda" if cuda else "cpu"

    def image(decoded) -> torch.Tensor:
        if cuda:
            return torch.from_dlpack(decoded).permute(2, 0, 1)
        return torch.from_numpy(np.asarray(decoded.cpu())).permute(2, 0, 1)

    def batches(pool: ThreadPoolExecutor):
        stream = torch.cuda.current_stream().cuda_stream if cuda else 0
        for _ in range(config.passes):
            files = pool.map(_read, config.paths)
            for start in range(0, len(config.paths), config.batch_size):
                count = min(config.batch_size, len(config.paths) - start)
                regions = []
                for _ in range(count):
                    code = nvimgcodec.CodeStream(next(files))
                    left, top, w, h = jobs.random_box(code.width, code.height)
                    regions.append(code.get_sub_code_stream(
                        region=nvimgcodec.Region(top, left, top + h, left + w)))
                decoded = decoder.decode(regions, params=params, cuda_stream=stream)
                out = torch.empty((count, 3, height, width), dtype=torch.uint8, device=device)
                for k, one in enumerate(decoded):
                    if one is None:
                        raise RuntimeError(f"nvImageCodec could not decode image {start + k}")
                    out[k] = resize_flip(image(one), size, bool(torch.rand(()) < jobs.FLIP))
                yield out

    with ThreadPoolExecutor(config.threads) as pool:
        count_when_done(meter, batches(pool), size)
    where = "the GPU" if cuda else "its CPU backend (no GPU here)"
    return f"nvImageCodec batched region decode on {where}; {config.threads} reader threads"
