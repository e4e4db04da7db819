"""A connection to one gpufeed server: its channel, its Info, its transport."""

from __future__ import annotations

import logging

import grpc

from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from gpufeed.v1.vocabulary import transport_name

from . import inline
from .errors import FeedError
from .shm import shares_shm

__all__ = ["Connection"]

_log = logging.getLogger(__name__)

# Keepalive pings find a server that vanished without closing the connection
# (host down, network cut) within about 5 s, instead of a hang.
#
# Inline batches are single messages of a few MB (4.8 MB for 32 x 3 x 224 x 224
# uint8). HTTP/2's default frame size (16 KB) splits one into some 300 frames;
# frames up to 16 MB let the server send it in a few. The stream's window
# starts at 32 MB, room for the batches the server may have outstanding,
# instead of growing from 64 KB by BDP probes (still on) during the first
# batches of every stream.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),  # inline batches are as large as they are
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
    ("grpc.http2.lookahead_bytes", 32 << 20),
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Any ping (flow-control probes too) left unanswered this long ends the
    # connection; gRPC's default is a minute, during which keepalive waits.
    ("grpc.http2.ping_timeout_ms", 3000),
]


class Connection:
    """One gpufeed server at ``address``: its gRPC channel and stub, and what it said.

    ``info()`` asks for the server's Info; ``auto_transport()`` is the transport
    ``auto`` means with this server (asked once, then kept); ``answered`` says
    whether the server has ever answered, which decides whether a failure is an
    outage worth reconnecting through. Shared by every loader of a FeedClient.
    """

    def __init__(self, address: str, *, connect_timeout: float,
                 credentials: grpc.ChannelCredentials | None, token: str | None,
                 authority: str = ""):
        self.address = address
        # A server found behind a DNS name is dialled at its address; its TLS certificate
        # names the name (``authority``), so that is what the handshake checks.
        options = [*_CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", authority),
                                        ("grpc.default_authority", authority)]
                                       if authority else [])]
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=options)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.stub = feed_pb2_grpc.FeedStub(self._channel)
        # Inline batches' arrays stay views of the received bytes (inline.parse).
        self.stub.Stream = self._channel.stream_stream(
            "/gpufeed.v1.Feed/Stream", request_serializer=feed_pb2.ClientMessage.SerializeToString,
            response_deserializer=inline.parse,
            # typeshed's grpcio stub lags grpcio's generated code, which passes this.
            _registered_method=True)  # pyright: ignore[reportCallIssue]
        self.connect_timeout = connect_timeout
        # Whether the server has ever answered on this connection: until it has, the
        # address may be wrong or the server down, and a loader fails at once rather
        # than spending its reconnect timeout.
        self.answered = False
        self._auto: feed_pb2.Transport | None = None

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout: float) -> None:
        """Until the channel is connected; FeedError UNAVAILABLE after ``timeout`` seconds."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=max(timeout, 0.01))
        except grpc.FutureTimeoutError:
            raise self._no_answer(timeout) from None

    def info(self) -> feed_pb2.InfoResponse:
        try:
            info = self.stub.Info(feed_pb2.InfoRequest(), timeout=self.connect_timeout,
                                  wait_for_ready=True, metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise self._no_answer(self.connect_timeout) from None
            raise FeedError.from_rpc(e, self.address) from None
        self.answered = True
        return info

    def _no_answer(self, timeout: float) -> FeedError:
        return FeedError(grpc.StatusCode.UNAVAILABLE,
                         f"no gpufeed server answered at {self.address} within {timeout:g} s; "
                         f"is gpufeed-server running and listening there?")

    def auto_transport(self) -> feed_pb2.Transport:
        """cuda_ipc on the same host and GPU, else shm on the same /dev/shm, else inline.

        "Same host" is proven by reading the probe segment the server names in
        Info, not by comparing host names; "same GPU" by the GPU's UUID.
        """
        if self._auto is None:
            info = self.info()
            same_shm = (feed_pb2.TRANSPORT_SHM in info.transports
                        and shares_shm(info.shm_probe.name, info.shm_probe.token))
            if not same_shm:
                why = "cannot see the server's /dev/shm probe"
                self._auto = feed_pb2.TRANSPORT_INLINE
            elif feed_pb2.TRANSPORT_CUDA_IPC in info.transports and _sees_gpu(info.gpu_uuid):
                self._auto, why = feed_pb2.TRANSPORT_CUDA_IPC, f"same host and GPU {info.gpu_uuid}"
            else:
                self._auto, why = feed_pb2.TRANSPORT_SHM, "shares the server's /dev/shm"
            _log.info("%s: transport auto -> %s (%s)", self.address, transport_name(self._auto),
                      why)
        return self._auto


def _sees_gpu(uuid: str) -> bool:
    if not uuid:
        return False
    from .cuda_ipc import local_device

    return local_device(uuid) is not None
