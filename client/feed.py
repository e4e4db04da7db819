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


class FeedClient:
    """A connection to ``address`` ("host:port"). Use as a context manager or call close()."""

    def __init__(self, address: str, *, connect_timeout: float = 10.0):
        self.address = address
        self._channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", -1)])
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
                                  wait_for_ready=True)
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
            self._auto = feed_pb2.TRANSPORT_SHM if same_shm else feed_pb2.TRANSPORT_INLINE
            _log.info("transport auto -> %s (%s)", "shm" if same_shm else "inline",
                      "shares the server's /dev/shm" if same_shm
                      else "cannot see the server's /dev/shm probe")
        return self._auto

    def loader(self, files: Sequence[str] | str, *, batch_size: int, size: tuple[int, int],
               prefix: str = "", labels: Sequence[int] | None = None, shuffle: bool = False,
               seed: int = 0, epoch: int = 0, rank: int = 0, world_size: int = 1,
               drop_last: bool = False, transport: str = "auto", prefetch: int = 0,
               copy: bool = False) -> Loader:
        """A loader over ``files``: a list of paths, or the path of a list file on the server.

        ``size`` is (height, width). ``prefetch`` is how many batches the server
        may decode ahead (0: the server's default). ``copy=True`` makes shm
        batches owned tensors instead of views of shared memory.
        """
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(_TRANSPORTS)}, got {transport!r}")
        request = feed_pb2.StreamRequest(
            prefix=prefix, labels=labels or [], batch_size=batch_size,
            output=feed_pb2.OutputSpec(height=size[0], width=size[1]),
            drop_last=drop_last, shuffle=shuffle, seed=seed, epoch=epoch, rank=rank,
            world_size=world_size, transport=_TRANSPORTS[transport], prefetch=prefetch)
        if isinstance(files, str):
            request.list_file = files
        else:
            request.files.paths.extend(files)
        return Loader(self, request, copy)
