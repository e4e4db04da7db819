"""The server process: gRPC server, decode pool, shared-memory namespace.

``FeedServer`` wires the pieces together and owns their lifetimes; the CLI in
``__main__`` only parses flags into a ``ServerConfig`` and handles signals.
"""

from __future__ import annotations

import logging
from concurrent import futures
from functools import partial

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gpufeed.v1 import feed_pb2

from .auth import TokenInterceptor, server_credentials
from .config import ServerConfig
from .media import batch_jpeg, jpeg
from .media.samples import Decoders
from .media.transforms import registry
from .media.transforms.runner import set_process_count, shutdown_processes
from .memory.shm import ShmNamespace
from .metrics import ServerMetrics
from .serving.edge.calls import CallGate, worker_threads
from .serving.edge.service import FeedServicer
from .serving.edge.watchdog import Watchdog
from .serving.edge.wire import add_feed_servicer
from .serving.running.pool import DecodePool
from .storage.roots import Storage

__all__ = ["FeedServer", "ServerConfig"]

_log = logging.getLogger(__name__)
_SERVICE = feed_pb2.DESCRIPTOR.services_by_name["Feed"].full_name


# Let clients ping every second or so (they do, to notice a dead server), and
# ping them, to notice a trainer whose host went away without closing its socket.
_GRPC_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.ping_timeout_ms", 5_000),  # gRPC's default (a minute) would hold keepalive back
]


def _load_plugins(modules: list[str], threads: int) -> None:
    """Import the built-in and the operator's transform modules; RuntimeError naming a
    module that cannot be imported."""
    for module in modules:
        try:
            registry.load([module])
        except Exception as e:  # ImportError, or the module's own error as it registers
            raise RuntimeError(f"--plugins {module}: cannot import it: "
                               f"{type(e).__name__}: {e}") from None
    _log.info("sample transforms: %s", ", ".join(registry.load()))
    set_process_count(threads)


def _batch_decoders(config: ServerConfig, device: torch.device
                    ) -> batch_jpeg.BatchDecoders | None:
    """The decoders that decode JPEGs a batch at a time (``--decoder nvimgcodec``: on the
    server's ``device``, a GPU as check_device names it, the one its cuda_ipc rings are
    on, or the CPU backend), saying so in the log; None for the CPU path. RuntimeError,
    saying what to install, without nvImageCodec."""
    if config.decoder == "cpu":
        _log.info(jpeg.describe())
        return None
    if config.decoder != "nvimgcodec":
        raise ValueError(f"--decoder {config.decoder!r}: use cpu or nvimgcodec")
    try:
        _log.info(batch_jpeg.describe(device))
    except ImportError as e:
        raise RuntimeError(str(e)) from None
    return batch_jpeg.BatchDecoders(device, config.threads)


class FeedServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        self._storage = Storage(config.data_roots, config.s3_endpoint, config.max_file_bytes,
                              connections=config.threads + 8, io_threads=config.io_threads,
                              read_ahead_bytes=config.read_ahead_bytes,
                              s3_connect_timeout=config.s3_connect_timeout,
                              s3_read_timeout=config.s3_read_timeout)
        device = None
        if config.device != "cpu":
            from .memory.cuda_ipc import check_device

            device = check_device(config.device)
        _load_plugins(config.plugins, config.threads)
        batch = _batch_decoders(config, device or torch.device("cpu"))
        self._shm = ShmNamespace()
        self._pool = DecodePool(config.threads, partial(Decoders, config.max_pixels, batch))
        self._watchdog = Watchdog()
        try:
            self._build(config, device)
        except BaseException:  # a taken port, say: leave no thread or /dev/shm name behind
            self._watchdog.close()
            self._pool.close()
            self._storage.close()
            self._shm.close()
            raise

    def _build(self, config: ServerConfig, device) -> None:
        self.metrics = ServerMetrics(self._pool)
        self._storage.register_metrics(self.metrics.registry)
        # Each call holds a handler thread: the gate bounds the calls that could hold
        # one for long, and the pool has a thread for each of them plus spares.
        gate = CallGate(config.max_waiting_calls, config.open_timeout, self._watchdog)
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=worker_threads(config.max_streams, config.max_waiting_calls),
                thread_name_prefix="gpufeed-rpc"),
            options=[*_GRPC_OPTIONS, ("grpc.max_receive_message_length", config.max_request_bytes)],
            # A wrong token is refused before the gate: it never waits for a message.
            interceptors=[TokenInterceptor(config.token), gate] if config.token else [gate],
        )
        self.servicer = FeedServicer(self._storage, self._pool, self._shm, config.limits,
                                     config.max_streams, self.metrics, device, self._watchdog,
                                     batch_decode=config.decoder == "nvimgcodec")
        add_feed_servicer(self.servicer, self._grpc)  # inline batches: wire.serialize
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(
            (_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc)
        if config.tls_cert or config.tls_key:
            if not (config.tls_cert and config.tls_key):
                raise ValueError("tls_cert and tls_key: give both (the certificate and its key)")
            credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
            self.port = self._grpc.add_secure_port(config.listen, credentials)
        else:
            self.port = self._grpc.add_insecure_port(config.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {config.listen}")
        if config.metrics_port:  # bound now, so a taken port fails start-up like --listen
            self.metrics.serve(config.listen.rsplit(":", 1)[0], config.metrics_port)

    @property
    def address(self) -> str:
        host = self.config.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def start(self) -> None:
        self._grpc.start()
        for name in ("", _SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    def stop(self) -> None:
        """Drain: refuse new streams, give open ones ``drain_seconds``, then free everything."""
        self._health.enter_graceful_shutdown()
        self.servicer.drain(self.config.drain_seconds)
        self._grpc.stop(1.0).wait()
        self._pool.close()
        shutdown_processes()
        self._storage.close()
        self._shm.close()
        self._watchdog.close()
        self.metrics.close()
