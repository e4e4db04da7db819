"""Reading ServerMessages without copying an inline batch's arrays out of them.

gRPC's Python client hands a response deserializer the message as one
``bytes`` (the one copy its API leaves). ``ServerMessage.FromString`` would
copy ``Batch.data`` into the message, and reading ``batch.data`` would copy it
again. ``parse`` instead finds ``data`` (field 4 of the batch), parses every
other field with protobuf, and keeps ``data`` as a view of the received
bytes: the batch's tensors are views of it too (``InlineBatches``).

Messages without ``data`` (the header, zero-copy batches) are parsed as usual.
Bytes that are not a ServerMessage parse to ``checks.Unparsable``, which the
stream raises as DATA_LOSS (a deserializer that raised would have gRPC end the
call with INTERNAL).

``InlineBatches`` is the inline transport's ``BatchReader`` (batches.py). The
header's ``slot_bytes`` bounds a batch's data: compressed data is
decompressed no further than that (a frame declaring more is refused before
anything is allocated), and every tensor must lie within the data received
(checks.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import grpc
import torch
from google.protobuf.message import DecodeError

from gpufeed.v1 import feed_pb2

from .batches import Release, slot_tensors
from .checks import Unparsable, check_tensors, data_loss
from .errors import FeedError
from .malloc import keep_large_buffers

__all__ = ["DECOMPRESSORS", "InlineBatches", "ReceivedBatch", "parse"]

_BATCH_FIELD = 2  # ServerMessage.batch
_DATA_FIELD = 4  # Batch.data
_LENGTH_DELIMITED = 2
_MAX_VARINT_BYTES = 10  # a 64-bit value's


def _zstd():
    import zstandard

    decompressor = zstandard.ZstdDecompressor()

    def decompress(data, limit: int) -> bytes:
        # decompress() allocates the size a frame declares, whatever max_output_size
        # says; max_output_size bounds only a frame that declares none.
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as e:
            raise data_loss(f"the server sent zstd data without a frame header ({e})") from None
        if declared > limit:
            raise data_loss(f"the server sent a zstd frame of {declared} bytes for its "
                            f"{limit}-byte slot")
        try:
            return decompressor.decompress(data, max_output_size=limit, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise data_loss(f"the server sent zstd data that does not decompress within its "
                            f"{limit}-byte slot ({e})") from None

    return decompress


def _lz4():
    import lz4.frame

    def decompress(data, limit: int) -> bytes:
        # lz4.frame.decompress has no bound: the frame's declared size is checked
        # first, then at most `limit` bytes are decompressed, whatever it declared.
        decompressor = lz4.frame.LZ4FrameDecompressor()
        try:  # lz4's errors are RuntimeErrors
            declared = lz4.frame.get_frame_info(data)["content_size"]  # 0: not declared
        except RuntimeError as e:
            raise data_loss(f"the server sent lz4 data without a frame header ({e})") from None
        if declared > limit:
            raise data_loss(f"the server sent an lz4 frame of {declared} bytes for its "
                            f"{limit}-byte slot")
        try:
            out = decompressor.decompress(data, max_length=limit)
        except RuntimeError as e:
            raise data_loss(f"the server sent lz4 data that does not decompress ({e})") from None
        if not decompressor.needs_input:  # stopped at the limit with output left
            raise data_loss(f"the server sent lz4 data that decompresses past its {limit}-byte "
                            f"slot")
        if not decompressor.eof or decompressor.unused_data:
            raise data_loss("the server sent lz4 data that is not one whole frame")
        return out

    return decompress


# Batch.compression -> a factory of functions (compressed buffer, most bytes it may
# give -> bytes), which raise DATA_LOSS rather than give more.
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
        if pos >= len(buffer) or shift >= 7 * _MAX_VARINT_BYTES:
            raise ValueError(f"a varint at byte {pos} runs past the message's end")
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


def parse(raw: bytes) -> feed_pb2.ServerMessage | _Received | Unparsable:
    """The Stream method's response deserializer (never raises: see Unparsable)."""
    try:
        return _parse(raw)
    except (ValueError, DecodeError) as e:
        return Unparsable(f"{len(raw)} bytes: {e}")


def _parse(raw: bytes) -> feed_pb2.ServerMessage | _Received:
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
        if pos > len(raw):
            raise ValueError(f"field {tag >> 3} of the batch runs past the message's end")
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
        # A batch's data is its slot's arrays, each padded to INLINE_ALIGN: no more
        # than the slot (whose arrays are padded to SLOT_ALIGN).
        self._slot_bytes = header.slot_bytes

    def make_room(self) -> None:
        pass

    def close(self) -> None:
        pass

    def tensors(self, batch) -> dict[str, torch.Tensor]:
        """The batch's tensors; its slot goes back now (nothing of the server's is held)."""
        data = batch.data  # a view of the message (inline.parse), or bytes
        if batch.compression:
            data = self._decompressor(batch.compression)(data, self._slot_bytes)
        elif len(data) > self._slot_bytes:
            raise data_loss(f"the server sent {len(data)} bytes of data for its "
                            f"{self._slot_bytes}-byte slot")
        places = check_tensors(batch.tensors, len(data),
                               f"the {len(data)} bytes of its batch's data")
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
        return slot_tensors(storage, places)

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
