"""The server process: gRPC server, decode pool, shared-memory namespace.

``FeedServer`` wires the pieces together and owns their lifetimes; the CLI in
``__main__`` only parses flags into a ``ServerConfig`` and handles signals.
"""

from __future__ import annotations

import logging
import os
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gpufeed.v1 import feed_pb2, feed_pb2_grpc

from .paths import DataRoots
from .pool import DecodePool
from .request import Limits
from .service import FeedServicer
from .shm import ShmNamespace

__all__ = ["FeedServer", "ServerConfig"]

_log = logging.getLogger(__name__)
_SERVICE = feed_pb2.DESCRIPTOR.services_by_name["Feed"].full_name


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class ServerConfig:
    data_roots: list[str]
    listen: str = "0.0.0.0:50051"
    threads: int = field(default_factory=default_threads)
    metrics_port: int = 0
    max_streams: int = 64
    limits: Limits = field(default_factory=Limits)
    # Largest client message (requests with long inline file lists).
    max_request_bytes: int = 64 << 20


class FeedServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        self._roots = DataRoots(config.data_roots)
        self._shm = ShmNamespace()
        self._pool = DecodePool(config.threads)
        # Each stream holds a handler thread; keep a few workers for Info and health.
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_streams + 8,
                                       thread_name_prefix="gpufeed-rpc"),
            options=[("grpc.max_send_message_length", -1),
                     ("grpc.max_receive_message_length", config.max_request_bytes)],
        )
        self.servicer = FeedServicer(self._roots, self._pool, self._shm, config.limits,
                                     config.max_streams)
        feed_pb2_grpc.add_FeedServicer_to_server(self.servicer, self._grpc)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(
            (_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc)
        self.port = self._grpc.add_insecure_port(config.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {config.listen}")

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

    def stop(self, grace: float = 5.0) -> None:
        """Refuse new calls, give open ones ``grace`` seconds, then free everything."""
        self._health.enter_graceful_shutdown()
        self._grpc.stop(grace).wait()
        self._pool.close()
        self._shm.close()
