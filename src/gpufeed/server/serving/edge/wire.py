"""Inline batches onto the wire with one copy of their bytes.

Building a ``Batch`` with its arrays in ``data`` and serialising it copies the
arrays three times in Python (joined into ``bytes``, into the message, out of
it) before gRPC copies them once more into its own buffers. gRPC's Python
server takes a method's response serializer as a function returning
``bytes``, so the Stream method is registered with ``serialize`` instead of
``ServerMessage.SerializeToString``: an inline batch reaches it as an
``InlineBatch`` (the small fields as a ``Batch``, the arrays as views of the
slot's rows) and is written as header + arrays in one ``bytes.join``, the one
copy gRPC's API leaves. The bytes are a valid ``ServerMessage``: ``data``
(field 4) simply comes last, as protobuf allows, so any client parses it.

Compression (``StreamRequest.compression``) replaces that copy with the
compressor's (the plan's, planning/compression.py): it reads the views and
writes the smaller bytes.
"""

from __future__ import annotations

import grpc

from gpufeed.v1 import feed_pb2

__all__ = ["InlineBatch", "add_feed_servicer", "serialize"]

# Tags of ServerMessage.batch (field 2) and Batch.data (field 4): length-delimited.
_BATCH_TAG = bytes([2 << 3 | 2])
_DATA_TAG = bytes([4 << 3 | 2])


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class InlineBatch:
    """A ServerMessage holding ``batch`` whose ``data`` is ``chunks``, not yet copied.

    ``compress`` (views -> compressed pieces), when given, makes ``data`` the
    compressed bytes and sets ``batch.compression`` to ``compression``.
    """

    def __init__(self, batch: feed_pb2.Batch, chunks: list[memoryview],
                 compress=None, compression: str = ""):
        self.batch = batch
        self._chunks = chunks
        if compress is not None and chunks:
            self._chunks = compress(chunks)
            batch.compression = compression
        self._data_bytes = sum(len(c) for c in self._chunks)

    def ByteSize(self) -> int:
        """Its size on the wire (as a protobuf message's ByteSize)."""
        inner = self.batch.ByteSize()
        if self._data_bytes:
            inner += 1 + len(_varint(self._data_bytes)) + self._data_bytes
        return 1 + len(_varint(inner)) + inner

    def serialize(self) -> bytes:
        head = self.batch.SerializeToString()
        if not self._data_bytes:
            return b"".join((_BATCH_TAG, _varint(len(head)), head))
        data_head = _DATA_TAG + _varint(self._data_bytes)
        inner = len(head) + len(data_head) + self._data_bytes
        return b"".join((_BATCH_TAG, _varint(inner), head, data_head, *self._chunks))


def serialize(message: feed_pb2.ServerMessage | InlineBatch) -> bytes:
    """The Stream method's response serializer."""
    if isinstance(message, InlineBatch):
        return message.serialize()
    return message.SerializeToString()


def add_feed_servicer(servicer, server: grpc.Server) -> None:
    """``feed_pb2_grpc.add_FeedServicer_to_server``, with Stream's responses by ``serialize``."""
    handlers = {
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info,
            request_deserializer=feed_pb2.InfoRequest.FromString,
            response_serializer=feed_pb2.InfoResponse.SerializeToString),
        "Stream": grpc.stream_stream_rpc_method_handler(
            servicer.Stream,
            request_deserializer=feed_pb2.ClientMessage.FromString,
            response_serializer=serialize),
    }
    service = feed_pb2.DESCRIPTOR.services_by_name["Feed"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    # typeshed's grpcio stub lags grpc.Server, which has had this method since 1.62.
    server.add_registered_method_handlers(service, handlers)  # pyright: ignore[reportAttributeAccessIssue]
