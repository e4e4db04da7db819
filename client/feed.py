"""``FeedClient``: one channel to a gpufeed server, and loaders over it."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from gpufeed.v1 import feed_pb2, feed_pb2_grpc

from .errors import FeedError
from .loader import Loader
from .shm import shares_shm

__all__ = ["FeedClient"]

_log = logging.getLogger(__name__)
_TRANSPORTS = {"auto": feed_pb2.TRANSPORT_AUTO, "inline": feed_pb2.TRANSPORT_INLINE,
               "shm": feed_pb2.TRANSPORT_SHM, "cuda_ipc": feed_pb2.TRANSPORT_CUDA_IPC}


# Keepalive pings find a server that vanished without closing the connection
# (host down, network cut) within about 5 s, instead of a hang.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),  # inline batches are as large as they are
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def _sees_gpu(uuid: str) -> bool:
    if not uuid:
        return False
    from .cuda_ipc import local_device

    return local_device(uuid) is not None


class FeedClient:
    """A connection to ``address`` ("host:port"). Use as a context manager or call close().

    ``credentials`` (e.g. ``grpc.ssl_channel_credentials(ca_pem)``) makes it a TLS
    channel; ``token`` is sent as ``authorization: Bearer <token>`` on every call.
    """

    def __init__(self, address: str, *, connect_timeout: float = 10.0,
                 credentials: grpc.ChannelCredentials | None = None, token: str | None = None):
        self.address = address
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=_CHANNEL_OPTIONS)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.stub = feed_pb2_grpc.FeedStub(self._channel)
        self._connect_timeout = connect_timeout
        self._auto: int | None = None

    def __enter__(self) -> FeedClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def info(self) -> feed_pb2.InfoResponse:
        try:
            return self.stub.Info(feed_pb2.InfoRequest(), timeout=self._connect_timeout,
                                  wait_for_ready=True, metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise FeedError(grpc.StatusCode.UNAVAILABLE,
                                f"no gpufeed server answered at {self.address} within "
                                f"{self._connect_timeout:g} s; is gpufeed-server running "
                                f"and listening there?") from None
            raise FeedError.from_rpc(e, self.address) from None

    def auto_transport(self) -> int:
        """shm when this process shares the server's /dev/shm (the probe says), else inline."""
        if self._auto is None:
            info = self.info()
            same_shm = (feed_pb2.TRANSPORT_SHM in info.transports
                        and shares_shm(info.shm_probe.name, info.shm_probe.token))
            if not same_shm:
                self._auto, why = feed_pb2.TRANSPORT_INLINE, "cannot see the server's /dev/shm probe"
            elif feed_pb2.TRANSPORT_CUDA_IPC in info.transports and _sees_gpu(info.gpu_uuid):
                self._auto, why = feed_pb2.TRANSPORT_CUDA_IPC, f"same host and GPU {info.gpu_uuid}"
            else:
                self._auto, why = feed_pb2.TRANSPORT_SHM, "shares the server's /dev/shm"
            _log.info("transport auto -> %s (%s)",
                      feed_pb2.Transport.Name(self._auto).removeprefix("TRANSPORT_").lower(), why)
        return self._auto

    def loader(self, files: Sequence[str] | str, *, batch_size: int, size: tuple[int, int],
               prefix: str = "", labels: Sequence[int] | None = None, shuffle: bool = False,
               seed: int = 0, epoch: int = 0, rank: int = 0, world_size: int = 1,
               drop_last: bool = False, transport: str = "auto", prefetch: int = 0,
               copy: bool = False, failure_budget: int | float = 0,
               reconnect_timeout: float = 30.0) -> Loader:
        """A loader over ``files``: a list of paths, or the path of a list file on the server.

        ``size`` is (height, width). ``prefetch`` is how many batches the server
        may decode ahead (0: the server's default). ``copy=True`` makes shm
        batches owned tensors instead of views of shared memory.
        ``failure_budget``: how many samples may fail before the pass ends with
        DATA_LOSS; an int is a count, a float in (0, 1) a fraction of the pass,
        0 the server's default (10 samples or 0.1%). ``reconnect_timeout``:
        seconds to keep reconnecting after the server becomes unavailable (0: never).
        """
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(_TRANSPORTS)}, got {transport!r}")
        request = feed_pb2.StreamRequest(
            prefix=prefix, labels=labels or [], batch_size=batch_size,
            output=feed_pb2.OutputSpec(height=size[0], width=size[1]),
            drop_last=drop_last, shuffle=shuffle, seed=seed, epoch=epoch, rank=rank,
            world_size=world_size, transport=_TRANSPORTS[transport], prefetch=prefetch)
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
        return Loader(self, request, copy=copy, reconnect_timeout=reconnect_timeout)
