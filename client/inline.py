"""Reading ServerMessages without copying an inline batch's arrays out of them.

gRPC's Python client hands a response deserializer the message as one
``bytes`` (the one copy its API leaves). ``ServerMessage.FromString`` would
copy ``Batch.data`` into the message, and reading ``batch.data`` would copy it
again. ``parse`` instead finds ``data`` (field 4 of the batch), parses every
other field with protobuf, and keeps ``data`` as a view of the received
bytes: the batch's tensors are views of it too (``InlineBatches``).

Messages without ``data`` (the header, zero-copy batches) are parsed as usual.

``InlineBatches`` is the inline transport's ``BatchReader`` (batches.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import grpc
import torch

from gpufeed.v1 import feed_pb2

from .batches import Release, slot_tensors
from .errors import FeedError
from .malloc import keep_large_buffers

__all__ = ["DECOMPRESSORS", "InlineBatches", "ReceivedBatch", "parse"]

_BATCH_FIELD = 2  # ServerMessage.batch
_DATA_FIELD = 4  # Batch.data
_LENGTH_DELIMITED = 2


def _zstd():
    import zstandard

    return zstandard.ZstdDecompressor().decompress  # the size is in the frame


def _lz4():
    import lz4.frame

    return lz4.frame.decompress


# Batch.compression -> a factory of functions (compressed buffer -> bytes).
DECOMPRESSORS = {"zstd": _zstd, "lz4": _lz4}


class ReceivedBatch:
    """A Batch's fields (``fields``, a ``feed_pb2.Batch`` without data) and its
    ``data``: a read-only view of the received message."""

    __slots__ = ("fields", "data")

    def __init__(self, fields: feed_pb2.Batch, data: memoryview):
        self.fields = fields
        self.data = data

    def __getattr__(self, name: str):
        return getattr(self.fields, name)


class _Received:
    """What ``parse`` gives for a batch carrying data: ``.batch`` as a ServerMessage has."""

    __slots__ = ("batch",)

    def __init__(self, batch: ReceivedBatch):
        self.batch = batch

    def WhichOneof(self, oneof: str) -> str:  # noqa: N802 (protobuf's name)
        return "batch"


def _varint(buffer: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buffer[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _skip(buffer: memoryview, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _varint(buffer, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == _LENGTH_DELIMITED:
        length, pos = _varint(buffer, pos)
        return pos + length
    if wire_type == 5:
        return pos + 4
    raise ValueError(f"unexpected wire type {wire_type}")


def parse(raw: bytes) -> feed_pb2.ServerMessage | _Received:
    """The Stream method's response deserializer."""
    view = memoryview(raw)
    tag, pos = _varint(view, 0) if raw else (0, 0)
    if tag != (_BATCH_FIELD << 3 | _LENGTH_DELIMITED):
        return feed_pb2.ServerMessage.FromString(raw)
    length, pos = _varint(view, pos)
    if pos + length != len(raw):  # more than one top-level field: not ours to take apart
        return feed_pb2.ServerMessage.FromString(raw)
    fields, data = [], None
    while pos < len(raw):
        start = pos
        tag, pos = _varint(view, pos)
        if tag == (_DATA_FIELD << 3 | _LENGTH_DELIMITED):
            size, pos = _varint(view, pos)
            data, pos = view[pos:pos + size], pos + size
        else:
            pos = _skip(view, pos, tag & 7)
            fields.append(view[start:pos])
    if data is None:
        return feed_pb2.ServerMessage.FromString(raw)
    return _Received(ReceivedBatch(feed_pb2.Batch.FromString(b"".join(fields)), data))


class InlineBatches:
    """Inline batches: tensors are read-only views of each received message's bytes
    (``inline.parse``), decompressed first when the stream is compressed; with
    ``copy``, owned writable tensors (one copy of the bytes).

    Nothing is shared with the server, so the slot is released as soon as the
    message is read, whatever the trainer keeps (a ``BatchReader``). The first
    one raises the process's malloc thresholds (``malloc.keep_large_buffers``).
    """

    shared = False

    def __init__(self, header: feed_pb2.StreamHeader, release: Release, copy: bool):
        keep_large_buffers()  # each batch's bytes reuse the last one's pages (malloc.py)
        self._release = release
        self._copy = copy
        self._decompress: dict[str, Callable] = {}

    def make_room(self) -> None:
        pass

    def close(self) -> None:
        pass

    def tensors(self, batch) -> dict[str, torch.Tensor]:
        """The batch's tensors; its slot goes back now (nothing of the server's is held)."""
        data = batch.data  # a view of the message (inline.parse), or bytes
        if batch.compression:
            data = self._decompressor(batch.compression)(data)
        if not data:  # every tensor is empty (frombuffer refuses b"")
            storage = torch.UntypedStorage(0)
        else:
            if self._copy:
                data = bytearray(data)
            with warnings.catch_warnings():
                # torch warns (once) that it cannot mark a tensor read-only; the class says so.
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
        self._release(batch.seq)
        return slot_tensors(storage, batch.tensors)

    def _decompressor(self, name: str) -> Callable:
        if name not in self._decompress:
            if name not in DECOMPRESSORS:
                raise FeedError(grpc.StatusCode.UNIMPLEMENTED,
                                f"the server sent {name}-compressed batches; this client "
                                f"knows {', '.join(sorted(DECOMPRESSORS))}")
            try:
                self._decompress[name] = DECOMPRESSORS[name]()
            except ImportError as e:
                raise FeedError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{name}-compressed batches need {e.name} in the trainer: "
                                f"pip install 'gpufeed[compression]'") from None
        return self._decompress[name]
