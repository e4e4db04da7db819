"""``FeedClient``: channels to one or more gpufeed servers, and loaders over them."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from gpufeed.v1 import feed_pb2

from .loader import Loader
from .server import Server

__all__ = ["FeedClient"]

_TRANSPORTS = {"auto": feed_pb2.TRANSPORT_AUTO, "inline": feed_pb2.TRANSPORT_INLINE,
               "shm": feed_pb2.TRANSPORT_SHM, "cuda_ipc": feed_pb2.TRANSPORT_CUDA_IPC}


class FeedClient:
    """Connections to ``address`` ("host:port", or several). A context manager.

    With several addresses, a loader splits its shard statically over the
    servers and reassigns a server's part to the others if it goes away (see
    loader.py). ``credentials`` (e.g. ``grpc.ssl_channel_credentials(ca_pem)``)
    makes the channels TLS; ``token`` is sent as ``authorization: Bearer
    <token>`` on every call.
    """

    def __init__(self, address: str | Sequence[str], *, connect_timeout: float = 10.0,
                 credentials: grpc.ChannelCredentials | None = None, token: str | None = None):
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses:
            raise ValueError("FeedClient needs at least one server address")
        self.servers = [Server(a, connect_timeout=connect_timeout, credentials=credentials,
                               token=token) for a in addresses]
        self.address = ",".join(addresses)

    def __enter__(self) -> FeedClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def info(self) -> feed_pb2.InfoResponse:
        """The first server's Info."""
        return self.servers[0].info()

    def loader(self, files: Sequence[str] | str, *, batch_size: int, size: tuple[int, int],
               prefix: str = "", labels: Sequence[int] | None = None, shuffle: bool = False,
               seed: int = 0, epoch: int = 0, rank: int = 0, world_size: int = 1,
               drop_last: bool = False, transport: str = "auto", prefetch: int = 0,
               copy: bool = False, failure_budget: int | float = 0,
               reconnect_timeout: float = 30.0, job: str = "") -> Loader:
        """A loader over ``files``: a list of paths, or the path of a list file on the server.

        ``size`` is (height, width). ``prefetch`` is how many batches the server
        may decode ahead (0: the server's default). ``copy=True`` makes shm
        batches owned tensors instead of views of shared memory.
        ``failure_budget``: how many samples may fail before the pass ends with
        DATA_LOSS; an int is a count, a float in (0, 1) a fraction of the pass,
        0 the server's default (10 samples or 0.1%). ``reconnect_timeout``:
        seconds to keep reconnecting after the server becomes unavailable (0: never).
        ``job``: share one pass with every loader naming the same job (one
        server only; see gpufeed/server/jobs.py for what that keeps and loses).
        """
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(_TRANSPORTS)}, got {transport!r}")
        if job and len(self.servers) > 1:
            raise ValueError("a shared job lives on one server; give FeedClient one address")
        request = feed_pb2.StreamRequest(
            prefix=prefix, labels=labels or [], batch_size=batch_size,
            output=feed_pb2.OutputSpec(height=size[0], width=size[1]),
            drop_last=drop_last, shuffle=shuffle, seed=seed, epoch=epoch, rank=rank,
            world_size=world_size, transport=_TRANSPORTS[transport], prefetch=prefetch, job=job)
        if isinstance(failure_budget, float) and 0 < failure_budget < 1:
            request.max_failure_fraction = failure_budget
        elif isinstance(failure_budget, int) and failure_budget >= 0:
            request.max_failures = failure_budget
        else:
            raise ValueError(f"failure_budget must be a count (int >= 0) or a fraction in (0, 1), "
                             f"got {failure_budget!r}")
        if isinstance(files, str):
            request.list_file = files
        else:
            request.files.paths.extend(files)
        return Loader(self.servers, request, copy=copy, reconnect_timeout=reconnect_timeout)
