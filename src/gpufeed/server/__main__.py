"""gpufeed-server: serve decoded batches from files under the data roots."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import signal
import sys
import threading

import gpufeed

from .config import Limits, ServerConfig, default_threads
from .memory.budget import default_memory_bytes
from .storage.paths import DataRoots
from .storage.s3 import is_s3

# What a trainer image lacks when it installs gpufeed alone (no server extra).
_SERVER_EXTRA = ("av", "prometheus_client", "grpc_health", "grpc_reflection")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpufeed-server", description=__doc__)
    p.add_argument("--version", action="version", version=f"gpufeed-server {gpufeed.__version__}")
    p.add_argument("--listen", default=ServerConfig.listen,
                   help="HOST:PORT to serve gRPC on; port 0 picks a free one (default %(default)s)")
    p.add_argument("--data-root", action="append", required=True, metavar="DIR",
                   help="directory, or s3://bucket/prefix, requests may read from (repeatable)")
    p.add_argument("--s3-endpoint", metavar="URL",
                   help="S3-compatible endpoint for s3:// data roots (default: boto3's "
                        "AWS_ENDPOINT_URL or config, else AWS)")
    p.add_argument("--s3-connect-timeout", type=float, default=ServerConfig.s3_connect_timeout,
                   help="seconds to wait for a connection to S3 (default %(default)s)")
    p.add_argument("--s3-read-timeout", type=float, default=ServerConfig.s3_read_timeout,
                   help="seconds an S3 response may go silent before the read fails "
                        "(its samples: category timeout; default %(default)s)")
    p.add_argument("--io-threads", type=int, default=ServerConfig.io_threads,
                   help="threads reading S3 objects ahead of the decode threads "
                        "(default %(default)s)")
    p.add_argument("--read-ahead-bytes", type=int, default=ServerConfig.read_ahead_bytes,
                   help="bytes S3 reads may hold ahead of the decode threads (0: no read-ahead; "
                        "default %(default)s)")
    p.add_argument("--plugins", action="append", default=[], metavar="MODULE",
                   help="import this module (e.g. mypkg.transforms; repeatable, or "
                        "comma-separated): the sample transforms it registers become "
                        "transforms requests may name (docs/guide/transforms.md)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="decode threads shared by all streams (default: cores, %(default)s)")
    p.add_argument("--device", default=ServerConfig.device,
                   help="cpu, or cuda:N to assemble batches on that GPU and offer cuda_ipc "
                        "(default %(default)s)")
    p.add_argument("--decoder", default=ServerConfig.decoder, choices=("cpu", "nvimgcodec"),
                   help="cpu: JPEGs decoded by libjpeg-turbo on the decode threads; nvimgcodec: "
                        "a batch at a time by nvImageCodec on --device (a GPU, or its CPU "
                        "backend), other formats on the decode threads (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=ServerConfig.metrics_port,
                   help="port for Prometheus /metrics, on the --listen host (0: off)")
    p.add_argument("--max-streams", type=int, default=ServerConfig.max_streams,
                   help="concurrent streams (default %(default)s)")
    p.add_argument("--max-waiting-calls", type=int, default=ServerConfig.max_waiting_calls,
                   help="calls that have not sent their first message (a Stream its request) "
                        "at once; past it the call waiting longest is ended; as many health "
                        "Watch / reflection calls "
                        "(default %(default)s)")
    p.add_argument("--open-timeout", type=float, default=ServerConfig.open_timeout,
                   help="seconds a call may take to send its first message before it is ended "
                        "(default %(default)s)")
    p.add_argument("--max-prefetch", type=int, default=Limits.max_prefetch,
                   help="largest prefetch a stream may ask for (default %(default)s)")
    p.add_argument("--max-batch-bytes", type=int, default=Limits.max_batch_bytes,
                   help="largest batch, in bytes (default %(default)s)")
    p.add_argument("--max-samples", type=int, default=Limits.max_samples,
                   help="longest sample list a request may name (default %(default)s)")
    p.add_argument("--max-shards", type=int, default=Limits.max_shards,
                   help="most tar shards a request may name, refused before any is indexed "
                        "(default %(default)s)")
    p.add_argument("--max-request-bytes", type=int, default=ServerConfig.max_request_bytes,
                   help="largest client message, i.e. request with its inline file list "
                        "(default %(default)s)")
    p.add_argument("--max-pixels", type=int, default=ServerConfig.max_pixels,
                   help="refuse images declaring more pixels, before decoding "
                        "(decompression bombs; default %(default)s)")
    p.add_argument("--max-file-bytes", type=int, default=ServerConfig.max_file_bytes,
                   help="refuse sample files larger than this, or not regular files, before "
                        "reading them; also bounds arrays' decompressed size "
                        "(default %(default)s)")
    p.add_argument("--max-list-bytes", type=int, default=Limits.max_list_bytes,
                   help="largest list file a request may name (default %(default)s)")
    p.add_argument("--max-memory-bytes", type=int, default=default_memory_bytes(),
                   help="memory all open streams' rings and sample lists may take together "
                        "(default: half of the host's or the cgroup's memory, here %(default)s)")
    p.add_argument("--lease-timeout", type=float, default=Limits.lease_timeout,
                   help="seconds a trainer may hold every slot before its stream is ended "
                        "(it can resume; default %(default)s)")
    p.add_argument("--drain-seconds", type=float, default=ServerConfig.drain_seconds,
                   help="on SIGTERM, how long open streams may go on (default %(default)s)")
    p.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    p.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    p.add_argument("--tls-client-ca", metavar="PEM",
                   help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument("--token-file", metavar="FILE",
                   help="require the header 'authorization: Bearer TOKEN' on every call (TOKEN "
                        "read from FILE; health checks are exempt)")
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="least severe log lines written to stderr; INFO has one line per "
                        "stream at open and end, WARNING only refusals and failures "
                        "(default %(default)s)")
    return p


def _check(args: argparse.Namespace, plugins: list[str]) -> None:
    """Refuse (exit 2, naming the flag) what can be told without the server's imports:
    values out of range, flags that go together, local data roots that are not
    directories, plugin modules that cannot be found, files that are not there."""
    error = _parser().error
    if args.threads < 1:
        error("--threads must be at least 1")
    if args.max_waiting_calls < 1 or not args.open_timeout > 0:
        error("--max-waiting-calls and --open-timeout must be positive")
    if not (args.s3_connect_timeout > 0 and args.s3_read_timeout > 0):
        error("--s3-connect-timeout and --s3-read-timeout must be positive")
    if bool(args.tls_cert) != bool(args.tls_key):
        error("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        error("--tls-client-ca needs --tls-cert and --tls-key")
    try:  # the check the server makes of them, done now
        DataRoots([root for root in args.data_root if not is_s3(root)] or ["/"])
    except OSError as e:
        error(f"--data-root: {e}")
    for module in plugins:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError) as e:  # a parent package that is missing or broken
            error(f"--plugins {module}: cannot import it: {type(e).__name__}: {e}")
        if not found:
            error(f"--plugins {module}: cannot import it: no module named {module!r} on the "
                  f"server's path")
    for flag in ("tls_cert", "tls_key", "tls_client_ca", "token_file"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            error(f"--{flag.replace('_', '-')}: {path!r} is not a file")


# Seconds a stop may take beyond --drain-seconds before the process exits regardless:
# the drain's own wait for the streams it ended (5 s), gRPC's stop (1 s), joining the
# threads and unlinking shared memory, with room to spare.
_STOP_SECONDS = 10.0


def _exit_by(seconds: float, log: logging.Logger) -> None:
    """End the process ``seconds`` from now if it has not ended by itself.

    A stop waits for the decode threads, and one may never return (a plugin's
    transform that loops, a read the kernel never answers): then the process
    exits anyway, saying so. A timer thread does it; should no Python thread get
    to run (a C call holding the GIL), SIGALRM's default action ends the
    process a few seconds later without one.
    """
    def _give_up() -> None:
        log.error("still stopping %.0f s after the signal (a thread that does not return); "
                  "exiting", seconds)
        logging.shutdown()
        os._exit(1)

    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(math.ceil(seconds + _STOP_SECONDS))
    timer = threading.Timer(seconds, _give_up)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    # Everything the command line alone can tell is checked first: torch, PyAV and
    # gRPC take seconds to import, and a mistake is refused before them.
    args = _parser().parse_args(argv)
    plugins = [m.strip() for arg in args.plugins for m in arg.split(",") if m.strip()]
    _check(args, plugins)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The metrics, ready and stopping lines are written whatever --log-level says:
    # whoever starts the server waits for the ready line (process.py does).
    lifecycle = logging.getLogger("gpufeed.server.lifecycle")
    lifecycle.setLevel(logging.INFO)
    try:
        import torch

        from .app import FeedServer
        from .auth import read_token
    except ModuleNotFoundError as e:
        if e.name not in _SERVER_EXTRA:
            raise
        # A trainer image installs gpufeed alone; say what is missing rather than a traceback.
        print(f"gpufeed-server: the server's dependencies are not installed ({e.name} is "
              f"missing); install gpufeed[server], e.g. pip install 'gpufeed[server]'",
              file=sys.stderr)
        return 1
    # The decode threads are the parallelism: a torch op inside one (the batch pass,
    # a sample transform) that also fans out over every core only makes the threads
    # fight for them, as in a DataLoader worker, which sets the same.
    torch.set_num_threads(1)
    try:
        config = ServerConfig(
            data_roots=args.data_root, listen=args.listen, threads=args.threads, device=args.device,
            metrics_port=args.metrics_port, max_streams=args.max_streams,
            max_waiting_calls=args.max_waiting_calls, open_timeout=args.open_timeout,
            limits=Limits(max_prefetch=args.max_prefetch, max_batch_bytes=args.max_batch_bytes,
                          max_samples=args.max_samples, lease_timeout=args.lease_timeout,
                          max_shards=args.max_shards,
                          max_list_bytes=args.max_list_bytes,
                          max_memory_bytes=args.max_memory_bytes),
            max_request_bytes=args.max_request_bytes, max_pixels=args.max_pixels,
            max_file_bytes=args.max_file_bytes,
            drain_seconds=args.drain_seconds, tls_cert=args.tls_cert, tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca, s3_endpoint=args.s3_endpoint,
            io_threads=args.io_threads, read_ahead_bytes=args.read_ahead_bytes,
            s3_connect_timeout=args.s3_connect_timeout, s3_read_timeout=args.s3_read_timeout,
            plugins=plugins, token=read_token(args.token_file) if args.token_file else None,
            decoder=args.decoder,
        )
        server = FeedServer(config)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"gpufeed-server: {e}", file=sys.stderr)
        return 2
    stopping = threading.Event()

    def _on_signal(signum, frame):
        if not stopping.is_set():
            _exit_by(config.drain_seconds + _STOP_SECONDS, lifecycle)
        stopping.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.start()
    if server.metrics.address:  # before the ready line, so whoever waits for it has both
        lifecycle.info(
            "gpufeed-server metrics on http://%s/metrics", server.metrics.address)
    lifecycle.info(
        "gpufeed-server ready on %s (data roots: %s; %d decode threads)",
        server.address, ", ".join(config.data_roots), config.threads)
    # Timed waits: the kernel may hand SIGTERM to any of the server's threads, and
    # Python runs the handler only when the main thread next runs Python code.
    while not stopping.wait(0.5):
        pass
    lifecycle.info("stopping")
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
