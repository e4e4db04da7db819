"""What an operator sets: the server's configuration and the limits a request is held to.

``ServerConfig`` is what ``gpufeed-server``'s flags fill (src/gpufeed/server/__main__.py) and
what an embedding program passes to ``FeedServer``; ``Limits`` is the part a
request is checked against (serving/planning/checks.py). Each default is stated once,
here. This module imports nothing heavy (no torch, PyAV or gRPC), so that the
command line, the data roots and the plugins are checked, and a mistake
refused, before the seconds the server's other imports take.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .memory.budget import default_memory_bytes
from .storage.paths import DEFAULT_MAX_FILE_BYTES
from .storage.s3 import S3_CONNECT_TIMEOUT, S3_READ_TIMEOUT

__all__ = ["DEFAULT_MAX_PIXELS", "Limits", "ServerConfig", "default_threads"]

# Images over this many pixels are refused before decoding (gpufeed-server --max-pixels).
DEFAULT_MAX_PIXELS = 100_000_000


@dataclass(frozen=True)
class Limits:
    """What a request is checked against (plan_stream, the servicer). The server's other
    limits are enforced where the bytes are, so they are ServerConfig's: the
    decoders' --max-pixels, the storage's --max-file-bytes, gRPC's --max-request-bytes."""

    # A request that sets no failure budget tolerates this many bad samples, or
    # this fraction of its samples if that is more: a few bad files in a large
    # data set are normal, a directory of them is a mistake worth stopping for.
    default_max_failures: int = 10
    default_max_failure_fraction: float = 0.001
    default_prefetch: int = 4
    # A stream whose trainer releases nothing for this long while every slot is
    # leased is ended (UNAVAILABLE; the client library resumes it).
    lease_timeout: float = 300.0
    max_prefetch: int = 16
    max_batch_bytes: int = 1 << 30
    max_samples: int = 10_000_000
    # Tar shards one request may name, refused before any is indexed (each costs a
    # HEAD or an open even when missing, and its index). --max-samples' 10M samples fill
    # 100,000 shards of 100 samples, where WebDataset shards hold thousands each; a
    # request naming more is a mistake or an attack, not a data set.
    max_shards: int = 100_000
    # A list file larger than this is refused before it is read (~12M lines of 40 bytes).
    max_list_bytes: int = 512 << 20
    # Every open stream's ring and plan together (serving/edge/service.py, memory/budget.py).
    max_memory_bytes: int = field(default_factory=default_memory_bytes)



def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class ServerConfig:
    data_roots: list[str]
    listen: str = "0.0.0.0:50051"
    threads: int = field(default_factory=default_threads)
    # "cpu", or "cuda:N" to assemble batches on that GPU and offer cuda_ipc.
    device: str = "cpu"
    metrics_port: int = 0
    max_streams: int = 64
    # Calls that have not sent their first message (a Stream its `open`), each
    # ended after open_timeout seconds; as many health Watch / reflection calls.
    max_waiting_calls: int = 16
    open_timeout: float = 10.0
    limits: Limits = field(default_factory=Limits)
    # Largest client message (requests with long inline file lists).
    max_request_bytes: int = 64 << 20
    # Images declaring more pixels are refused before decoding (decompression bombs).
    max_pixels: int = DEFAULT_MAX_PIXELS
    # Sample files larger than this (or not regular files) fail before they are read.
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    # On SIGTERM, open streams get this long to finish before they end UNAVAILABLE.
    drain_seconds: float = 5.0
    # TLS (cert + key; client_ca also demands client certificates) and a bearer token.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    token: str | None = None
    # Endpoint of S3-compatible storage for s3:// data roots (None: boto3's own settings).
    s3_endpoint: str | None = None
    # Seconds to connect to S3, and that a response may go silent (storage/s3.py says why).
    s3_connect_timeout: float = S3_CONNECT_TIMEOUT
    s3_read_timeout: float = S3_READ_TIMEOUT
    # The I/O stage for S3 reads: its threads, and the bytes it may hold ahead (0: off).
    io_threads: int = 16
    read_ahead_bytes: int = 256 << 20
    # How JPEGs are decoded: "cpu" (libjpeg-turbo on the decode threads) or
    # "nvimgcodec" (a batch at a time by nvImageCodec, on --device: media/batch_jpeg.py).
    decoder: str = "cpu"
    # Modules whose registered sample transforms requests may name (media/transforms/registry.py),
    # besides the built-in ones.
    plugins: list[str] = field(default_factory=list)
