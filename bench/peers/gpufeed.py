"""gpufeed as a trainer sees it: a server process, and this process reading its batches.

The server is started with ``ServerProcess`` on the data set's folder (one
decode thread per core); this process is the trainer, reading the list file
over ``shm`` (zero-copy views of the server's slot ring) or ``inline`` (the
bytes inside the gRPC messages). Each pass over the files is one stream.
"""

from __future__ import annotations


def run(config, meter, transport: str) -> str:
    from gpufeed.client import FeedClient
    from gpufeed.server.process import ServerProcess

    args = ["--data-root", config.root, "--threads", str(config.threads)]
    with ServerProcess(args) as server, FeedClient(server.address) as feed:
        loader = feed.loader(files=config.list_file, batch_size=config.batch_size,
                             size=tuple(config.size), transport=transport)
        for epoch in range(config.passes):
            loader.set_epoch(epoch)
            for batch in loader:
                meter.batch(int(batch["image"].shape[0]))
        meter.stop()
        if loader.transport != transport:
            raise RuntimeError(f"asked for {transport}, the server chose {loader.transport}")
    return f"server: {config.threads} decode threads; trainer in another process"
