"""A server that lies: the trainer gets DATA_LOSS naming the field, at once.

The server here is a real gRPC server in this process that speaks the Feed
protocol as gpufeed-server does (Info; Stream: the request, a header, batches,
the client's Attached and Release messages read as they come, the segment's
name unlinked once the client has attached) and lies in one way per case:
about a tensor's place, shape or dtype, a variable-length field's offsets, the
order of batches, the header's ring, its shared-memory segment, or how much a
compressed batch holds. The trainer uses the loader as a training script
does; each lie must end its pass with a ``FeedError`` whose code is DATA_LOSS
and whose message names the field, the loader must not reconnect (the server
sees one Stream call), and the client must leave the call. A decompression
bomb must not raise the trainer's peak memory. The same server telling the
truth is read correctly, so each case's lie is what the client refused.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
import torch

from gpufeed.client import FeedClient, FeedError, split
from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from gpufeed.v1.vocabulary import INLINE_ALIGN, SHM_DIR, SLOT_ALIGN
from support import status_mb

INLINE = feed_pb2.TRANSPORT_INLINE
SHM = feed_pb2.TRANSPORT_SHM
_INLINE_SLOT = 192  # image [2, 3, 4, 4] uint8 and index [2] int64, each padded to 64 bytes
_SHM_SLOT = 2 * SLOT_ALIGN
_BOMB = 1 << 30  # what each decompression bomb holds: 1 GiB of zeros
_FILES = ["a.jpg", "b.jpg", "c.jpg", "d.jpg"]

_END = object()  # in a script: the server ends the call (OK) here, instead of waiting


class _Liar(feed_pb2_grpc.FeedServicer):
    """The Feed service, playing ``script``: the messages of each Stream call (a
    ServerMessage, bytes sent as they are, or a function to call, which may wait
    for something before the next message), then either ``_END`` (the call ends
    OK, as after a pass's last batch) or nothing: the server waits for the client
    to leave, so a client that did not refuse the lie when it came would hang."""

    def __init__(self):
        self.script: list = []
        self.streams = 0
        self.left = threading.Event()  # the last Stream call has ended
        self.unlink: str | None = None  # a segment whose name goes once the client attached

    def Info(self, request, context):  # noqa: N802 (the service's name)
        return feed_pb2.InfoResponse(version="liar", transports=[
            INLINE, SHM, feed_pb2.TRANSPORT_CUDA_IPC])

    def Stream(self, request_iterator, context):  # noqa: N802 (the service's name)
        self.streams += 1
        left = self.left = threading.Event()
        context.add_callback(left.set)
        next(request_iterator)  # the request: whatever it asks, the script is the answer
        threading.Thread(target=self._read, args=(request_iterator,), daemon=True).start()
        for message in self.script:
            if message is _END:
                return
            if callable(message):  # a wait (for the lane to close, as the protocol says)
                message()
                continue
            yield message
        left.wait(timeout=120)  # a safety net only: the client's leaving sets it

    def _read(self, request_iterator: Iterator[feed_pb2.ClientMessage]) -> None:
        try:
            for message in request_iterator:  # releases, and attached for a segment
                if message.WhichOneof("kind") == "attached" and self.unlink:
                    os.unlink(os.path.join(SHM_DIR, self.unlink))
                    self.unlink = None
        except grpc.RpcError:  # the call ended
            pass


def _serialize(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


@pytest.fixture(scope="module")
def listening() -> Iterator[tuple[_Liar, str]]:
    """The lying server, started once for the module, and its address."""
    servicer = _Liar()
    # As gpufeed-server (src/gpufeed/server/app.py): the client pings every 2 s, and a server that
    # minded would send GOAWAY, which the loader reconnects through.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
        ("grpc.http2.max_ping_strikes", 0)])
    handlers = {
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info, request_deserializer=feed_pb2.InfoRequest.FromString,
            response_serializer=feed_pb2.InfoResponse.SerializeToString),
        # bytes pass as they are, so that a case can send what no ServerMessage serializes to
        "Stream": grpc.stream_stream_rpc_method_handler(
            servicer.Stream, request_deserializer=feed_pb2.ClientMessage.FromString,
            response_serializer=_serialize),
    }
    service = feed_pb2.DESCRIPTOR.services_by_name["Feed"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=0)


@pytest.fixture
def liar(listening) -> _Liar:
    """The lying server, with no script and no calls yet."""
    servicer, _ = listening
    servicer.script, servicer.streams, servicer.unlink = [], 0, None
    return servicer


@pytest.fixture
def trainer(listening, liar) -> Iterator[FeedClient]:
    with FeedClient(listening[1]) as feed:
        yield feed


# --- What the server sends when it tells the truth -------------------------------------


def _arrays(seq: int, rows: int = 2, boxes: list[int] | None = None) -> dict[str, np.ndarray]:
    """Batch ``seq``'s arrays: an image and index per row; with ``boxes`` (boxes per
    row), a variable-length field, flat with its offsets."""
    arrays = {"image": np.full((rows, 3, 4, 4), seq, np.uint8),
              "index": np.arange(rows * seq, rows * seq + rows, dtype=np.int64)}
    if boxes is not None:
        arrays["boxes"] = np.arange(sum(boxes) * 5, dtype=np.float32).reshape(-1, 5)
        arrays["boxes_offsets"] = np.concatenate([[0], np.cumsum(boxes)]).astype(np.int64)
    return arrays


def _layout(arrays: dict[str, np.ndarray], align: int) -> tuple[list[feed_pb2.TensorMeta], bytes]:
    """The arrays' TensorMetas and bytes, each array at a multiple of ``align``."""
    metas, chunks, offset = [], [], 0
    for name, array in arrays.items():
        metas.append(feed_pb2.TensorMeta(name=name, dtype=array.dtype.name, shape=array.shape,
                                         offset=offset))
        data = array.tobytes()
        chunks += [data, bytes(-len(data) % align)]
        offset += len(data) + len(chunks[-1])
    return metas, b"".join(chunks)


def _header(transport: int = INLINE, batches: int = 2, slot_bytes: int = _INLINE_SLOT,
            **fields) -> feed_pb2.ServerMessage:
    header = feed_pb2.StreamHeader(transport=transport, num_slots=2, slot_bytes=slot_bytes,
                                   num_samples=2 * batches, num_batches=batches)
    for name, value in fields.items():
        if isinstance(value, feed_pb2.CudaIpc):
            getattr(header, name).CopyFrom(value)
        else:
            setattr(header, name, value)
    return feed_pb2.ServerMessage(header=header)


def _inline(seq: int, **arrays) -> feed_pb2.ServerMessage:
    """Inline batch ``seq`` (``arrays``: _arrays' options)."""
    metas, data = _layout(_arrays(seq, **arrays), INLINE_ALIGN)
    return feed_pb2.ServerMessage(batch=feed_pb2.Batch(seq=seq, tensors=metas, data=data))


def _inline_stream(batches: int = 2, **arrays) -> list:
    """An inline stream as gpufeed-server sends one, its slot as large as the largest
    batch's data."""
    messages = [_inline(seq, **arrays) for seq in range(batches)]
    slot_bytes = max(len(m.batch.data) for m in messages)
    return [_header(batches=batches, slot_bytes=slot_bytes), *messages]


class _HeldProbe:
    """A probe segment under a server id of its own, locked as a running server's is."""

    def __init__(self):
        self.server_id = secrets.token_hex(8)
        self._path = os.path.join(SHM_DIR, f"gpufeed-{self.server_id}-probe")
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def close(self) -> None:
        os.unlink(self._path)
        os.close(self._fd)


@dataclass
class _Kit:
    """What a case may make: shared-memory segments and lanes (unlinked at the end)
    and the compressed bombs (made once)."""

    server: _Liar
    bombs: dict[str, bytes]
    names: list[str] = field(default_factory=list)
    lane_closed: threading.Event = field(default_factory=threading.Event)  # the last lane's
    probe: _HeldProbe | None = None

    def segment(self, size: int) -> tuple[str, mmap.mmap]:
        name = f"gpufeed-liar-{secrets.token_hex(8)}"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.names.append(name)
        return name, memory

    def shm_stream(self, batches: int = 2, slots: int = 2, segment_slots: int | None = None,
                   slot_of: Callable[[int], int] = lambda seq: seq % 2, **arrays) -> list:
        """A shm stream as gpufeed-server sends one: each batch's arrays in its slot of a
        segment the header names (unlinked once the client has attached)."""
        layouts = [_layout(_arrays(seq, **arrays), SLOT_ALIGN) for seq in range(batches)]
        slot_bytes = max(len(data) for _, data in layouts)
        name, memory = self.segment((segment_slots or slots) * slot_bytes)
        self.server.unlink = name
        messages = [_header(SHM, batches, slot_bytes, shm_name=name, num_slots=slots)]
        for seq, (metas, data) in enumerate(layouts):
            start = slot_of(seq) * slot_bytes
            if 0 <= start and start + len(data) <= len(memory):
                memory[start:start + len(data)] = data
            messages.append(feed_pb2.ServerMessage(batch=feed_pb2.Batch(
                seq=seq, slot=slot_of(seq), tensors=metas)))
        memory.close()
        return messages

    def lane(self, messages: list) -> tuple[str, bytes]:
        """A lane (its name and token) that, once the trainer has connected, sends
        ``messages`` (ServerMessages, or bytes as they are) and closes.

        Named as gpufeed-server names its lanes (the client connects to no other
        name), under a probe this process holds, as a live server does, so that
        servers starting elsewhere do not sweep it."""
        if self.probe is None:
            self.probe = _HeldProbe()
        name = f"gpufeed-{self.probe.server_id}-{secrets.token_hex(8)}"
        token = secrets.token_bytes(16)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(os.path.join(SHM_DIR, name))
        listener.listen(1)
        self.names.append(name)
        self.lane_closed = closed = threading.Event()

        def serve() -> None:
            try:
                with listener:
                    listener.settimeout(30)  # a trainer that refused the header never comes
                    connection, _ = listener.accept()
                with connection:
                    connection.settimeout(30)
                    connection.recv(64)  # the token
                    for message in messages:
                        connection.send(_serialize(message))
                    connection.shutdown(socket.SHUT_WR)  # as gpufeed-server ends a lane:
                    while connection.recv(256):  # until the trainer closes its end
                        pass
            except OSError:  # the trainer refused a message and left
                pass
            finally:
                closed.set()

        threading.Thread(target=serve, daemon=True).start()
        return name, token

    def lane_stream(self, on_call: list | None = None, **stream) -> list:
        """A shm stream whose batches go on a lane, as gpufeed-server sends them to a
        trainer that connected; ``on_call``: what the call sends after the header."""
        messages = self.shm_stream(**stream)
        header, batches = messages[0], messages[1:]
        header.header.lane_name, header.header.lane_token = self.lane(batches)
        closed = self.lane_closed
        return [header, *(on_call or []), lambda: closed.wait(30)]  # the lane closes first

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
        for name in self.names:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


def _bomb(compression: str, declared: bool) -> bytes:
    """A frame of ``_BOMB`` zero bytes (a few KB or MB), declaring its size or not."""
    chunk = bytes(1 << 20)
    if compression == "zstd":
        import zstandard

        stream = zstandard.ZstdCompressor(level=1).compressobj(size=_BOMB if declared else -1)
        return b"".join([*(stream.compress(chunk) for _ in range(_BOMB // len(chunk))),
                         stream.flush()])
    import lz4.frame

    compressor = lz4.frame.LZ4FrameCompressor()
    return b"".join([compressor.begin(_BOMB if declared else 0),
                     *(compressor.compress(chunk) for _ in range(_BOMB // len(chunk))),
                     compressor.flush()])


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    return {f"{c}{'' if declared else '-undeclared'}": _bomb(c, declared)
            for c in ("zstd", "lz4") for declared in (True, False)}


@pytest.fixture
def kit(liar, bombs) -> Iterator[_Kit]:
    kit = _Kit(liar, bombs)
    yield kit
    kit.close()


def _compressed(compression: str, data: bytes) -> bytes:
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=1).compress(data)
    import lz4.frame

    return lz4.frame.compress(data, store_size=True)


def _compressed_stream(compression: str, batches: int = 2) -> list:
    messages = _inline_stream(batches)
    for message in messages[1:]:
        message.batch.data = _compressed(compression, message.batch.data)
        message.batch.compression = compression
    return messages


# --- The truth, read correctly ------------------------------------------------------------


def _read(trainer: FeedClient, **options) -> list[dict[str, torch.Tensor]]:
    loader = trainer.loader(**{"files": _FILES, "batch_size": 2, "transport": "inline",
                               **options})
    return [{name: tensor.clone() for name, tensor in batch.items()} for batch in loader]


@pytest.mark.parametrize("how", ["inline", "zstd", "lz4", "shm", "lane", "fields"])
def test_the_truth_is_read_as_sent(liar, trainer, kit, how):
    """The lying server's protocol is the real one: told straight, every batch arrives."""
    options = {}
    if how == "inline":
        liar.script = _inline_stream()
    elif how == "fields":
        liar.script = _inline_stream(boxes=[1, 2])
    elif how in ("shm", "lane"):
        liar.script = kit.shm_stream() if how == "shm" else kit.lane_stream()
        options["transport"] = "shm"
    else:
        liar.script = _compressed_stream(how)
        options["compression"] = how
    liar.script.append(_END)
    batches = _read(trainer, **options)
    assert [b["index"].tolist() for b in batches] == [[0, 1], [2, 3]]
    assert [b["image"].unique().tolist() for b in batches] == [[0], [1]]
    if how == "fields":
        assert [len(boxes) for boxes in split(batches[0], "boxes")] == [1, 2]
    assert liar.streams == 1


# --- Lies, one a case ----------------------------------------------------------------------


def _tensor(message: feed_pb2.ServerMessage, name: str) -> feed_pb2.TensorMeta:
    return next(meta for meta in message.batch.tensors if meta.name == name)


def _set(tensor: str, seq: int = 0, **fields) -> Callable[[list], None]:
    """An edit of a stream's messages: tensor ``tensor`` of batch ``seq`` gets ``fields``."""
    def edit(messages: list) -> None:
        meta = _tensor(messages[1 + seq], tensor)
        for key, value in fields.items():
            if key == "shape":
                del meta.shape[:]
                meta.shape.extend(value)
            else:
                setattr(meta, key, value)
    return edit


def _inline_lie(edit: Callable[[list], object], **arrays) -> Callable[[_Kit], list]:
    """An inline stream told straight (``arrays``: _arrays' options), then ``edit``-ed."""
    def script(kit: _Kit) -> list:
        messages = _inline_stream(**arrays)
        edit(messages)
        return messages
    return script


def _header_lie(**fields) -> Callable[[_Kit], list]:
    def script(kit: _Kit) -> list:
        messages = _inline_stream()
        messages[0] = _header(**fields)
        return messages
    return script


def _compressed_lie(compression: str, edit: Callable[[list], object]) -> Callable[[_Kit], list]:
    def script(kit: _Kit) -> list:
        messages = _compressed_stream(compression)
        edit(messages)
        return messages
    return script


def _truncated(messages: list) -> None:
    messages[1].batch.data = messages[1].batch.data[:-6]


def _garbage(messages: list) -> None:
    messages[1].batch.data = b"not a frame, just bytes"


def _shm_lie(edit: Callable[[list], object], **stream) -> Callable[[_Kit], list]:
    """A shm stream told straight (``stream``: shm_stream's options), then ``edit``-ed."""
    def script(kit: _Kit) -> list:
        messages = kit.shm_stream(**stream)
        edit(messages)
        return messages
    return script


def _lane_lie(edit: Callable[[list], object], on_call: list | None = None,
              **stream) -> Callable[[_Kit], list]:
    """A shm stream whose batches go on a lane, ``edit``-ed before they go there."""
    def script(kit: _Kit) -> list:
        messages = kit.shm_stream(**stream)
        header, batches = messages[0], messages[1:]
        edit(batches)
        header.header.lane_name, header.header.lane_token = kit.lane(batches)
        return [header, *(on_call or [])]
    return script


def _symlink(kit: _Kit) -> list:
    """A segment name that is a symbolic link to a file of the trainer's."""
    target, _ = kit.segment(4 * _SHM_SLOT)
    link, _ = kit.segment(1)
    os.unlink(os.path.join(SHM_DIR, link))
    os.symlink(os.path.join(SHM_DIR, target), os.path.join(SHM_DIR, link))
    messages = kit.shm_stream()
    messages[0].header.shm_name = link
    return messages


def _case(script: Callable[[_Kit], list], named: str, id: str, **options):
    """A lie: the server's ``script``, the loader's ``options``, and what the error names."""
    return pytest.param(script, options, named, id=id)


_SHM = {"transport": "shm"}
_LIES = [
    # Inline: where and what each tensor is.
    _case(_inline_lie(_set("image", offset=4096)), "tensor 'image' with offset 4096 + 96 bytes "
          "past the 192 bytes of its batch's data", "offset-past-the-data"),
    _case(_inline_lie(_set("image", shape=[2, -3, 4, 4])), "tensor 'image' with shape "
          "[2, -3, 4, 4]", "negative-dim"),
    _case(_inline_lie(_set("index", shape=[2, 1 << 62, 1 << 62])), "tensor 'index' with offset "
          "128 + 340282366920938463463374607431768211456 bytes past", "overflowing-dims"),
    _case(_inline_lie(_set("index", shape=[])), "tensor 'index' with shape []", "no-dims"),
    _case(_inline_lie(_set("index", dtype="object")), "tensor 'index' with unknown dtype "
          "'object'", "unknown-dtype"),
    _case(_inline_lie(_set("index", offset=132)), "tensor 'index' with offset 132, not a "
          "multiple of its int64's 8 bytes", "unaligned-offset"),
    _case(_inline_lie(_set("index", shape=[3])), "tensor 'index' with 3 rows, but tensor "
          "'image' has 2", "rows-disagree"),
    _case(_inline_lie(_set("index", name="image")), "tensor 'image' twice", "duplicate-name"),
    _case(_inline_lie(lambda m: None, rows=3), "tensor 'image' with 3 rows, more than the "
          "request's batch_size 2", "more-rows-than-batch-size"),
    _case(_inline_lie(lambda m: setattr(m[0].header, "slot_bytes", 128)),
          "192 bytes of data for its 128-byte slot", "data-past-the-slot"),
    # Inline: a variable-length field's offsets.
    _case(_inline_lie(lambda m: None, boxes=[2, -1]), "'boxes_offsets' that decrease at row 1",
          "offsets-decrease"),
    _case(_inline_lie(_set("boxes", shape=[2, 5]), boxes=[1, 2]), "'boxes_offsets' from 0 to 3, "
          "but the field has 2 entries", "offsets-past-the-data"),
    _case(_inline_lie(_set("boxes_offsets", shape=[2]), boxes=[1, 2]), "tensor 'boxes_offsets' "
          "with 2 offsets, but tensor 'image' has 2 rows", "offsets-count"),
    # The stream's order and messages.
    _case(_inline_lie(lambda m: setattr(m[1].batch, "seq", 1)), "batch seq 1 where batch 0 was "
          "due", "seq-skipped"),
    _case(_inline_lie(lambda m: setattr(m[2].batch, "seq", 0)), "batch seq 0 where batch 1 was "
          "due", "seq-repeated"),
    _case(_inline_lie(lambda m: m.append(_inline(2))), "batch seq 2, past the 2 batches its "
          "header declared", "more-batches"),
    _case(_inline_lie(lambda m: m.insert(2, _header())), "a header where a batch was due",
          "second-header"),
    _case(_inline_lie(lambda m: m.insert(1, b"\x12\x80")), "a message that does not parse",
          "unparsable"),
    _case(_inline_lie(lambda m: m.insert(1, b"\x12\x05\x22\x7f\x00\x01\x02")),
          "a message that does not parse", "data-past-the-message"),
    _case(lambda kit: [_END], "ended the stream where a header was due", "no-header"),
    _case(lambda kit: [_inline(0)], "a batch where a header was due", "batch-first"),
    # The header.
    _case(_header_lie(transport=SHM), "header names transport shm, but the request asked for "
          "inline", "other-transport"),
    _case(_header_lie(transport=9), "header names transport 9", "unknown-transport"),
    _case(_header_lie(num_slots=0), "num_slots 0", "no-slots"),
    _case(_header_lie(start_batch=1), "start_batch 1, but the request asked to start at batch 0",
          "other-start"),
    _case(_header_lie(num_batches=-1), "num_batches -1", "negative-count"),
    # Compressed inline batches (the bombs: test_a_decompression_bomb_...).
    _case(_compressed_lie("zstd", _garbage), "zstd data without a frame header", "zstd-garbage",
          compression="zstd"),
    _case(_compressed_lie("zstd", _truncated), "zstd data that does not decompress",
          "zstd-truncated", compression="zstd"),
    _case(_compressed_lie("lz4", _truncated), "lz4 data that is not one whole frame",
          "lz4-truncated", compression="lz4"),
    _case(_compressed_lie("lz4", _set("image", offset=4096)), "tensor 'image' with offset 4096 + "
          "96 bytes past the 192 bytes of its batch's data", "compressed-offset-past-the-data",
          compression="lz4"),
    # shm: the segment, the slot, and the tensors in the slot.
    _case(_shm_lie(lambda m: None, slot_of=lambda seq: 2), "batch 0 in slot 2, outside its ring "
          "of 2 slots", "shm-slot-outside", **_SHM),
    _case(_shm_lie(lambda m: None, slot_of=lambda seq: -1), "batch 0 in slot -1, outside its "
          "ring of 2 slots", "shm-slot-negative", **_SHM),
    _case(_shm_lie(lambda m: None, slots=3, slot_of=lambda seq: 0), "batch 1 in slot 0, which "
          "holds a batch the trainer has not released", "shm-slot-still-held", **_SHM),
    _case(_shm_lie(_set("image", offset=4096, shape=[4, 3, 224, 224])), "tensor 'image' with "
          "offset 4096 + 602112 bytes past its 8192-byte slot", "shm-past-the-slot", **_SHM),
    _case(_shm_lie(lambda m: None, slots=4, segment_slots=2), "declares a ring of 32768 bytes, "
          "but its segment", "shm-segment-too-small", **_SHM),
    _case(lambda kit: [_header(SHM, shm_name="../dev/zero")], "shm_name '../dev/zero'",
          "shm-name-a-path", **_SHM),
    _case(_symlink, "is a symbolic link", "shm-symlink", **_SHM),
    _case(_shm_lie(lambda m: None, boxes=[2, -1]), "'boxes_offsets' that decrease at row 1",
          "shm-offsets-decrease", **_SHM),
    # shm with a lane: its name, and what comes on it (checked as what comes on the call).
    _case(_shm_lie(lambda m: setattr(m[0].header, "lane_name", "../x")), "lane_name '../x'",
          "lane-name-a-path", **_SHM),
    _case(_lane_lie(lambda m: m.insert(0, b"\x12\x80")), "on the stream's lane that is not "
          "a ServerMessage", "lane-unparsable", **_SHM),
    _case(_lane_lie(lambda m: m.insert(0, bytes(70_000))), "a message over 65536 bytes on the "
          "stream's lane", "lane-oversized", **_SHM),
    _case(_lane_lie(lambda m: None, slot_of=lambda seq: 2), "batch 0 in slot 2, outside its "
          "ring of 2 slots", "lane-slot-outside", **_SHM),
    _case(_lane_lie(lambda m: m.pop(), on_call=[feed_pb2.ServerMessage(batch=feed_pb2.Batch(
        seq=1))]), "a message on the call after closing the stream's lane", "lane-then-call",
        **_SHM),
    # cuda_ipc: the header alone (checked before any CUDA call, so on any machine).
    _case(lambda kit: [_header(feed_pb2.TRANSPORT_CUDA_IPC, cuda_ipc=feed_pb2.CudaIpc(
        slot_events=[b"x"], storage_size=2 * _SHM_SLOT))], "num_slots 2 but "
        "cuda_ipc.slot_events has 1", "cuda-events-count", transport="cuda_ipc"),
]


@pytest.mark.parametrize("script, options, named", _LIES)
def test_a_lie_ends_the_pass_with_data_loss_naming_the_field(liar, trainer, kit, script, options,
                                                            named):
    liar.script = script(kit)
    with pytest.raises(FeedError) as error:
        _read(trainer, **options)
    assert error.value.code == grpc.StatusCode.DATA_LOSS, error.value
    assert named in str(error.value)
    assert liar.streams == 1  # not reconnected: a lying server is not asked again
    assert liar.left.wait(timeout=30)  # and the client has left the call


def _bomb_stream(kit: _Kit, bomb: str) -> list:
    messages = _inline_stream()
    messages[1].batch.data = kit.bombs[bomb]
    messages[1].batch.compression = bomb.split("-")[0]
    return messages


@pytest.mark.parametrize("bomb, named", [
    ("zstd", f"zstd frame of {_BOMB} bytes for its 192-byte slot"),
    ("zstd-undeclared", "zstd data that does not decompress within its 192-byte slot"),
    ("lz4", f"lz4 frame of {_BOMB} bytes for its 192-byte slot"),
    ("lz4-undeclared", "lz4 data that decompresses past its 192-byte slot"),
])
def test_a_decompression_bomb_does_not_raise_the_trainers_memory(liar, trainer, kit, bomb,
                                                                 named):
    """A frame of a GiB for a 192-byte slot, its size declared or not: refused before
    it is decompressed, or decompressed no further than the slot. Measured as the
    growth of this process's peak RSS (VmHWM, reset first) once the loader's imports
    are done and its heap is warm."""
    compression = bomb.split("-")[0]
    liar.script = [*_compressed_stream(compression), _END]
    _read(trainer, compression=compression)
    liar.script = _bomb_stream(kit, bomb)
    with open("/proc/self/clear_refs", "w") as clear:  # peak RSS := RSS now (Linux >= 4.0)
        clear.write("5")
    before = status_mb(os.getpid(), "VmHWM")
    with pytest.raises(FeedError) as error:
        _read(trainer, compression=compression)
    grown = status_mb(os.getpid(), "VmHWM") - before
    assert error.value.code == grpc.StatusCode.DATA_LOSS
    assert named in str(error.value)
    assert grown < 200, f"peak RSS grew by {grown:.0f} MB for a {len(kit.bombs[bomb])}-byte bomb"


def test_split_checks_the_offsets_it_reads():
    """A zero-copy batch's offsets can change after they were checked (the server owns
    the memory): split checks what it reads before it cuts."""
    batch = {"boxes": torch.zeros(3, 5), "boxes_offsets": torch.tensor([0, 2, 5])}
    with pytest.raises(FeedError) as error:
        split(batch, "boxes")
    assert error.value.code == grpc.StatusCode.DATA_LOSS
    assert "'boxes_offsets' from 0 to 5, but the field has 3 entries" in str(error.value)
