"""The ceiling: gpufeed's own decoder in a tight loop, one thread per core, no service.

Each thread reads its share of the files and decodes them with
``ImageDecoder`` into the rows of its own batch buffer, as the server's decode
pool does, but with no queue, stream, gRPC or transport. The service can only
approach this; how close it gets is what the server costs.
"""

from __future__ import annotations

import threading

import numpy as np


def run(config, meter) -> str:
    from gpufeed.server.decode import ImageDecoder

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
