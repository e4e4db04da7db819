"""What the client checks in each message before it believes the server.

A batch reaches the trainer as views of bytes the client holds: the received
message's data (inline), or the batch's slot of the stream's shared memory
(shm, cuda_ipc), whose size the header declared. Each view is made from
numbers the server sent (a tensor's offset, shape and dtype, the slot's
index), and torch's ``set_`` trusts them: left unchecked, a server with a bug,
or one that is not gpufeed's, makes the trainer fail with a bare
``RuntimeError`` somewhere in torch, floors an unaligned offset into a shifted
tensor, or hands out a batch whose tensors disagree. So every such number is
checked first against what the client knows by itself: the bytes it received,
the header's slot size and slot count, the request, the batches so far.

Anything inconsistent is a ``FeedError`` with DATA_LOSS whose message names
the field at fault. The loader reconnects only on UNAVAILABLE (an outage), so
DATA_LOSS ends the pass and reaches the trainer: a server that lies once is
not asked again.

The checks are arithmetic per message and per tensor, never per element, so
the zero-copy path stays zero-copy; the one exception is a variable-length
field's offsets (fields.py), B + 1 numbers checked at once with numpy. Inline
decompression is bounded by the same slot size (inline.py).

What checking cannot give: a shm or cuda_ipc server owns the memory the
trainer's views alias, and can rewrite it after these checks. They make the
views stay inside the memory the header declared; what the bytes say is the
server's (``fields.split`` checks the offsets again when it reads them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import grpc
import numpy as np
import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import BFLOAT16, TRANSPORTS, carrier_dtype, transport_name

from .errors import FeedError

__all__ = ["OFFSETS", "BatchOrder", "Place", "Unparsable", "check_header", "check_offsets",
           "check_rows", "check_slot", "check_tensors", "data_loss", "expect"]

# A variable-length field ``x`` travels flat with ``x`` + OFFSETS (fields.py).
OFFSETS = "_offsets"

# The dtype names a TensorMeta may carry (the vocabulary's), and each one's size.
_ITEMSIZE = {name: carrier_dtype(name).itemsize for name in (
    "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", BFLOAT16, "float32", "float64", "complex64", "complex128")}
_MAX_DIMS = 32  # more than any batch's tensor has


def data_loss(message: str) -> FeedError:
    """A FeedError with DATA_LOSS: the server sent what ``message`` says."""
    return FeedError(grpc.StatusCode.DATA_LOSS, message)


class Unparsable:
    """What the Stream call's deserializer (``inline.parse``) gives for bytes that are
    not a ServerMessage: it may not raise (gRPC would end the call with INTERNAL and
    log a traceback), so the stream raises DATA_LOSS with ``problem`` instead."""

    __slots__ = ("problem",)

    def __init__(self, problem: str):
        self.problem = problem

    def WhichOneof(self, oneof: str) -> None:  # noqa: N802 (protobuf's name)
        return None


def expect(message, kind: str) -> feed_pb2.ServerMessage:
    """``message`` (a ServerMessage; None: the call ended), if it holds ``kind``; else raise."""
    if isinstance(message, Unparsable):
        raise data_loss(f"the server sent a message that does not parse: {message.problem}")
    if message is None:
        raise data_loss(f"the server ended the stream where a {kind} was due")
    got = message.WhichOneof("kind")
    if got != kind:
        raise data_loss(f"the server sent {'a ' + got if got else 'an empty message'} where "
                        f"a {kind} was due")
    return message


def check_header(header: feed_pb2.StreamHeader, request: feed_pb2.StreamRequest) -> None:
    """Raise unless ``header`` is a header of a stream for ``request``: the transport
    asked for, a ring of at least one slot, counts that are not negative, the
    resume position asked for, and a memory the size of the ring."""
    if header.transport not in TRANSPORTS.values():
        raise data_loss(f"the server's header names transport {header.transport}, which is "
                        f"none of {', '.join(TRANSPORTS)}")
    if request.transport not in (feed_pb2.TRANSPORT_AUTO, header.transport):
        raise data_loss(f"the server's header names transport {transport_name(header.transport)}"
                        f", but the request asked for {transport_name(request.transport)}")
    if header.num_slots < 1 or header.slot_bytes < 1:
        raise data_loss(f"the server's header declares num_slots {header.num_slots} of "
                        f"slot_bytes {header.slot_bytes}: a ring needs a slot of a byte or more")
    for field in ("num_samples", "num_batches", "start_batch"):
        if getattr(header, field) < 0:
            raise data_loss(f"the server's header declares {field} {getattr(header, field)}")
    if not request.job and header.start_batch != request.start_batch:
        raise data_loss(f"the server's header declares start_batch {header.start_batch}, but "
                        f"the request asked to start at batch {request.start_batch}")
    if header.transport == feed_pb2.TRANSPORT_SHM:
        name = header.shm_name
        if not name or "/" in name or "\0" in name or name in (".", ".."):
            raise data_loss(f"the server's header names shm_name {name!r}, which is not a "
                            f"segment's name")
    elif header.transport == feed_pb2.TRANSPORT_CUDA_IPC:
        ipc = header.cuda_ipc
        if len(ipc.slot_events) != header.num_slots:
            raise data_loss(f"the server's header declares num_slots {header.num_slots} but "
                            f"cuda_ipc.slot_events has {len(ipc.slot_events)}")
        if ipc.storage_offset < 0 or ipc.storage_size < header.num_slots * header.slot_bytes:
            raise data_loss(f"the server's header declares {header.num_slots} slots of "
                            f"{header.slot_bytes} bytes but cuda_ipc.storage_size "
                            f"{ipc.storage_size}")


class BatchOrder:
    """The seq each batch of a stream must carry.

    A stream's own pass sends batches start_batch, start_batch + 1, ... and no
    more than the header's num_batches (0 counts as not said, as a shared job's
    header has it); a shared job's consumer gets whichever batches it is dealt,
    in no fixed order, so only their being batches of a pass is checked.
    """

    def __init__(self, header: feed_pb2.StreamHeader, request: feed_pb2.StreamRequest):
        self._shared = bool(request.job)
        self._next = header.start_batch
        self._end = header.start_batch + header.num_batches if header.num_batches else None

    def check(self, batch: feed_pb2.Batch) -> None:
        seq = batch.seq
        if self._shared:
            if seq < 0:
                raise data_loss(f"the server sent batch seq {seq}")
            return
        if seq != self._next:
            raise data_loss(f"the server sent batch seq {seq} where batch {self._next} was due")
        if self._end is not None and seq >= self._end:
            raise data_loss(f"the server sent batch seq {seq}, past the {self._end} batches its "
                            f"header declared")
        self._next += 1


def check_slot(batch: feed_pb2.Batch, num_slots: int) -> None:
    """Raise unless the batch's slot is one of the ring's ``num_slots``."""
    if not 0 <= batch.slot < num_slots:
        raise data_loss(f"the server sent batch {batch.seq} in slot {batch.slot}, outside its "
                        f"ring of {num_slots} slots")


class Place(NamedTuple):
    """A checked TensorMeta: its fields as Python values (``slot_tensors`` takes either)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


def check_tensors(metas: Sequence[feed_pb2.TensorMeta], size: int, where: str) -> list[Place]:
    """The batch's tensors' places, once every tensor is known to lie within ``size``
    bytes (``where``: those bytes, for the message) and the tensors make one batch.

    Each tensor: a known dtype; 1 to ``_MAX_DIMS`` dimensions, none negative; an
    offset that is a multiple of its itemsize (so that the view starts where the
    server put it, not floored); offset + bytes within ``size``. Together: names
    that differ; the same number of rows N (a variable-length field's flat
    tensor aside); and each ``x_offsets`` an int64 [N + 1] beside its ``x``.
    """
    # Each field is read once, here: a protobuf field's read costs more than the
    # arithmetic, and the views are made from the Places returned.
    places = [Place(meta.name, meta.dtype, tuple(meta.shape), meta.offset) for meta in metas]
    tensors = {}
    for name, dtype, shape, offset in places:
        if name in tensors:
            raise data_loss(f"the server sent tensor {name!r} twice in one batch")
        tensors[name] = dtype, shape
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is None:
            raise data_loss(f"the server sent tensor {name!r} with unknown dtype {dtype!r}")
        if not 0 < len(shape) <= _MAX_DIMS or min(shape) < 0:
            raise data_loss(f"the server sent tensor {name!r} with shape {list(shape)}: a "
                            f"batch's tensor has 1 to {_MAX_DIMS} dimensions, none negative")
        if offset < 0 or offset % itemsize:
            raise data_loss(f"the server sent tensor {name!r} with offset {offset}, not a "
                            f"multiple of its {dtype}'s {itemsize} bytes")
        nbytes = itemsize * math.prod(shape)
        if offset + nbytes > size:
            raise data_loss(f"the server sent tensor {name!r} with offset {offset} + {nbytes} "
                            f"bytes past {where}")
    _check_rows_agree(tensors)
    return places


def _check_rows_agree(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """The tensors (name -> dtype, shape) have N rows each, and each offsets N + 1."""
    rows = first = None
    for name, (_, shape) in tensors.items():
        if not name.endswith(OFFSETS) and name + OFFSETS not in tensors:  # not a field's
            if rows is None:
                rows, first = shape[0], name
            elif shape[0] != rows:
                raise data_loss(f"the server sent tensor {name!r} with {shape[0]} rows, but "
                                f"tensor {first!r} has {rows}")
    for name, (dtype, shape) in tensors.items():
        if not name.endswith(OFFSETS):
            continue
        field = name.removesuffix(OFFSETS)
        if field not in tensors:
            raise data_loss(f"the server sent tensor {name!r} without {field!r}")
        if dtype != "int64" or len(shape) != 1:
            raise data_loss(f"the server sent tensor {name!r} as {dtype} {list(shape)}: "
                            f"offsets are int64 [N + 1]")
        if rows is None:
            rows, first = shape[0] - 1, name
        elif shape[0] != rows + 1:
            raise data_loss(f"the server sent tensor {name!r} with {shape[0]} offsets, but "
                            f"tensor {first!r} has {rows} rows")


def check_rows(tensors: Mapping[str, torch.Tensor], batch_size: int) -> None:
    """Raise unless the batch has at most ``batch_size`` rows and, where its memory is
    the host's, each variable-length field's offsets cut its flat tensor (the
    tensors passed ``check_tensors``: one row tensor stands for all)."""
    rows_checked = False
    for name, tensor in tensors.items():
        if name.endswith(OFFSETS):
            field = name.removesuffix(OFFSETS)
            if tensor.device.type == "cpu":  # reading device memory would wait for the GPU
                check_offsets(name, tensor.numpy(), len(tensors[field]))
        elif not rows_checked and name + OFFSETS not in tensors:
            rows_checked = True
            if len(tensor) > batch_size > 0:
                raise data_loss(f"the server sent tensor {name!r} with {len(tensor)} rows, "
                                f"more than the request's batch_size {batch_size}")


def check_offsets(name: str, offsets: np.ndarray, entries: int) -> None:
    """Raise unless ``offsets`` (a field's, ``name``) start at 0, never decrease and end
    at ``entries``, the length of the field's flat tensor."""
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != entries:
        raise data_loss(f"the server sent {name!r} {_ends(offsets)}, but the field has "
                        f"{entries} entries from 0")
    falls = offsets[1:] < offsets[:-1]
    if falls.any():
        row = int(np.flatnonzero(falls)[0])
        raise data_loss(f"the server sent {name!r} that decrease at row {row}: "
                        f"{int(offsets[row])} then {int(offsets[row + 1])}")


def _ends(offsets: np.ndarray) -> str:
    if len(offsets) == 0:
        return "empty"
    return f"from {int(offsets[0])} to {int(offsets[-1])}"

