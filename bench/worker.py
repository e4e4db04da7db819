"""One row of the table in a fresh process: ``python -m bench.worker ROW CONFIG_JSON``.

A fresh process per row means no row inherits another's threads, imports or
warm caches of its own making. Progress goes to stderr as the row runs; the
result is the last line of stdout, as JSON (nothing is pickled).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .measure import Meter
from .peers import Unavailable

__all__ = ["ROWS", "Config"]


@dataclass
class Config:
    """What every row shares: the files, the output, how much to read, how many threads."""

    root: str
    list_file: str  # relative to root
    names: list[str] = field(repr=False)
    batch_size: int = 32
    size: tuple[int, int] = (224, 224)
    passes: int = 2
    threads: int = 2
    warmup: int = 3

    @property
    def paths(self) -> list[str]:
        return [str(Path(self.root) / name) for name in self.names]

    @property
    def expected(self) -> int:
        return len(self.names) * self.passes


def _ceiling(c, m):
    from .peers import ceiling
    return ceiling.run(c, m)


def _gpufeed(transport):
    def run(c, m):
        from .peers import gpufeed
        return gpufeed.run(c, m, transport)
    return run


def _torch(workers):
    def run(c, m):
        from .peers import torch_loader
        return torch_loader.run(c, m, workers)
    return run


def _spdl(c, m):
    from .peers import spdl_pipeline
    return spdl_pipeline.run(c, m)


def _tf(service):
    def run(c, m):
        from .peers import tfdata
        return tfdata.run(c, m, service)
    return run


# Row id -> (label in the table, runner). Imports stay inside the runners so a
# row pays only for its own packages.
ROWS = {
    "ceiling": ("gpufeed decoder ceiling (threads, no service)", _ceiling),
    "gpufeed-shm": ("gpufeed -> trainer process, shm", _gpufeed("shm")),
    "gpufeed-inline": ("gpufeed -> trainer process, inline", _gpufeed("inline")),
    "torch-2": ("torch DataLoader, 2 workers (Pillow)", _torch(2)),
    "torch-4": ("torch DataLoader, 4 workers (Pillow)", _torch(4)),
    "spdl": ("SPDL pipeline", _spdl),
    "tf": ("tf.data, in-process", _tf(False)),
    "tf-service": ("tf.data service -> trainer process", _tf(True)),
}


def main(argv: list[str]) -> int:
    row, raw = argv
    config = Config(**json.loads(raw))
    label, runner = ROWS[row]
    meter = Meter(row, config.expected, warmup=config.warmup)
    try:
        result = meter.result(runner(config, meter))
        out = {"row": row, "label": label, "status": "ok", **result.to_json()}
        if result.images != result.expected:
            out["status"] = "failed"
            out["note"] = f"delivered {result.images} of {result.expected} images"
    except Unavailable as e:
        out = {"row": row, "label": label, "status": "unavailable", "note": str(e)}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
