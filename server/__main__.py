"""``gpufeed-server``: serve decoded batches from files under the data roots."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from .app import FeedServer, ServerConfig, default_threads
from .request import Limits


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpufeed-server", description=__doc__)
    p.add_argument("--listen", default="0.0.0.0:50051",
                   help="HOST:PORT to serve gRPC on; port 0 picks a free one (default %(default)s)")
    p.add_argument("--data-root", action="append", required=True, metavar="DIR",
                   help="directory requests may read from (repeatable)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="decode threads shared by all streams (default: cores, %(default)s)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="port for Prometheus /metrics (0: off)")
    p.add_argument("--max-streams", type=int, default=64, help="concurrent streams (default %(default)s)")
    p.add_argument("--max-prefetch", type=int, default=Limits.max_prefetch,
                   help="largest prefetch a stream may ask for (default %(default)s)")
    p.add_argument("--max-batch-bytes", type=int, default=Limits.max_batch_bytes,
                   help="largest batch, in bytes (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads < 1:
        _parser().error("--threads must be at least 1")
    config = ServerConfig(
        data_roots=args.data_root, listen=args.listen, threads=args.threads,
        metrics_port=args.metrics_port, max_streams=args.max_streams,
        limits=Limits(max_prefetch=args.max_prefetch, max_batch_bytes=args.max_batch_bytes),
    )
    try:
        server = FeedServer(config)
    except (OSError, ValueError) as e:
        print(f"gpufeed-server: {e}", file=sys.stderr)
        return 2
    stopping = threading.Event()

    def _on_signal(signum, frame):
        stopping.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.start()
    logging.getLogger("gpufeed.server").info(
        "gpufeed-server ready on %s (data roots: %s; %d decode threads)",
        server.address, ", ".join(config.data_roots), config.threads)
    stopping.wait()
    logging.getLogger("gpufeed.server").info("stopping")
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
