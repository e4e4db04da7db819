"""The soak's adversarial mix: idle calls, oversized requests and bad files, over and over.

``Adversary`` runs three threads against a server beside the soak's trainers,
each a bounded load, so that what the soak measures is the server's defences
and not the machine running out of cores:

- idle calls: ``idle_calls`` Stream calls at a time that never send ``open``,
  each held for ``hold`` seconds and then cancelled;
- oversized or hostile requests: a ring far over any memory budget (batch
  7000 x prefetch 16 at 224x224, 17.9 GB), ``shorter_side`` 12000, a "list
  file" that is a sparse 2 GiB file, 10 million tar shards in one brace
  pattern, an ``s3://`` name on a server without S3 roots, and sample-transform
  parameters that would cost memory or time (3 million magnitude bins, 30,000
  levels of nesting, an infinite ratio, a 2-million-item list), one after
  another;
- bad files: a stream over files that must each fail alone (truncated, not an
  image, a decompression bomb, a FIFO, a sparse 2 GiB "JPEG"), with a failure
  budget that lets it finish; then tar shards whose headers lie (a pax size
  that points back at itself, a GNU long name of 2**62 bytes) beside a good
  one, and an image whose boxes sidecar holds 2 million boxes.

``counts`` says how each kind of call ended (its gRPC status, or how many
samples failed), for the soak's report.
"""

from __future__ import annotations

import io
import logging
import os
import struct
import tarfile
import threading
import zlib
from collections import Counter
from pathlib import Path

import grpc

from gpufeed.client import FeedClient, FeedError
from gpufeed.v1 import feed_pb2, feed_pb2_grpc

__all__ = ["Adversary", "make_bad_files"]

_BAD = "adversary"  # folder under the data root
_HUGE = 2 << 30


def make_bad_files(root: Path, good_jpeg: bytes) -> list[str]:
    """Write the bad files into ``root/adversary`` (once); their names relative to ``root``."""
    folder = root / _BAD
    folder.mkdir(exist_ok=True)
    files = {
        "truncated.jpg": good_jpeg[:len(good_jpeg) // 2],
        "text.jpg": b"not an image at all\n" * 50,
        "bomb.png": _png_bomb(50_000, 50_000),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    if not (folder / "pipe.jpg").exists():
        os.mkfifo(folder / "pipe.jpg")
    with open(folder / "huge.jpg", "wb") as f:  # sparse: no disk, 2 GiB to whoever reads it
        f.write(good_jpeg)
        f.truncate(_HUGE)
    shards = {"good.tar": _shard(good_jpeg), "loop.tar": _shard(good_jpeg, "loop"),
              "longname.tar": _shard(good_jpeg, "longname")}
    for name, data in shards.items():
        (folder / name).write_bytes(data)
    (folder / "boxes.jpg").write_bytes(good_jpeg)
    (folder / "boxes.txt").write_bytes(b"0 0 1 1 0\n" * 2_000_000)
    return [f"{_BAD}/{name}" for name in [*files, "pipe.jpg", "huge.jpg", *shards, "boxes.jpg"]]


def _shard(jpeg: bytes, lie: str = "") -> bytes:
    """A tar of two samples (JPEG + .cls); ``lie``: before the second, a pax header whose
    size points back at itself ("loop"), or a GNU long name of 2**62 bytes ("longname")."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key in ("000000", "000001"):
            for suffix, data in (("jpg", jpeg), ("cls", b"7")):
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    data = out.getvalue()
    if not lie:
        return data
    second = 512 + -(-len(jpeg) // 512) * 512 + 1024  # after the first sample
    if lie == "loop":
        records = b"14 size=-1536\n"  # back to the pax header itself: tarfile loops
        header = _header(b"PaxHeader", len(records), b"x", b"ustar\x0000")
        extra = header + records + b"\0" * (512 - len(records))
    else:
        extra = _header(b"././@LongLink", 0, b"L", b"ustar  \0",
                        size_field=b"\x80" + b"\0" * 3 + b"\x40" + b"\0" * 7)
    return data[:second] + extra + data[second:]


def _header(name: bytes, size: int, kind: bytes, magic: bytes,
            size_field: bytes | None = None) -> bytes:
    header = bytearray(512)
    header[0:len(name)] = name
    header[100:108] = b"0000644\0"
    header[124:136] = size_field or b"%011o\0" % size
    header[156:157] = kind
    header[257:265] = magic
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def _png_bomb(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


class Adversary:
    def __init__(self, address: str, bad_files: list[str], *, idle_calls: int = 4,
                 hold: float = 5.0, pause: float = 0.5):
        self.address = address
        self.bad_files = bad_files
        self.idle_calls, self.hold, self.pause = idle_calls, hold, pause
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=target, name=f"adversary-{target.__name__}",
                                          daemon=True)
                         for target in (self._idle, self._oversized, self._bad_files)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        return dict(self.counts)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _idle(self) -> None:
        """``idle_calls`` calls that never send ``open``, each held ``hold`` seconds."""
        with grpc.insecure_channel(self.address) as channel:
            stub = feed_pb2_grpc.FeedStub(channel)
            while not self._stop.is_set():
                hung_up = threading.Event()
                calls = [stub.Stream(_silent(hung_up)) for _ in range(self.idle_calls)]
                self._stop.wait(self.hold)
                for call in calls:
                    if call.done():  # the server ended it: say how
                        self._count(f"idle call ended by the server: {call.code().name}")
                    else:
                        self._count("idle call held")
                    call.cancel()
                hung_up.set()

    def _oversized(self) -> None:
        image = feed_pb2.OutputSpec(height=224, width=224)
        one = feed_pb2.FileList(paths=self.bad_files[:1])
        requests = {
            "17.9 GB ring": feed_pb2.StreamRequest(
                files=one, batch_size=7000, prefetch=16, output=image),
            "shorter_side 12000": feed_pb2.StreamRequest(
                files=one, batch_size=1, output=feed_pb2.OutputSpec(
                    height=224, width=224, resize=feed_pb2.RESIZE_SHORTER_CENTER_CROP,
                    shorter_side=12000)),
            "2 GiB list file": feed_pb2.StreamRequest(
                list_file=f"{_BAD}/huge.jpg", batch_size=1, output=image),
            "10 million shards": feed_pb2.StreamRequest(
                files=feed_pb2.FileList(paths=["x-{0000000..9999999}.tar"]), batch_size=1,
                output=image),
            "an s3:// name": feed_pb2.StreamRequest(
                files=feed_pb2.FileList(paths=["s3://data/x.jpg"]), batch_size=1, output=image),
        }
        hostile = {  # sample-transform parameters, as JSON text (the client would refuse some)
            "3 million magnitude bins": ("trivial_augment_wide",
                                         '{"num_magnitude_bins": 3000000}'),
            "parameters 30,000 deep": ("random_erasing", '{"value": ' + "[" * 30_000
                                       + "]" * 30_000 + "}"),
            "an infinite ratio": ("random_erasing", '{"ratio": [1, Infinity]}'),
            "a 2-million-item list": ("random_erasing",
                                      '{"value": [' + ",".join(["1"] * 2_000_000) + "]}"),
        }
        for what, (name, params) in hostile.items():
            requests[what] = request = feed_pb2.StreamRequest(files=one, batch_size=1,
                                                              output=image)
            request.sample_transforms.add(name=name, params_json=params)
        for request in requests.values():
            request.transport = feed_pb2.TRANSPORT_INLINE
        with grpc.insecure_channel(self.address) as channel:
            stub = feed_pb2_grpc.FeedStub(channel)
            while not self._stop.is_set():
                for what, request in requests.items():
                    call = stub.Stream(iter([feed_pb2.ClientMessage(open=request)]))
                    try:
                        next(call)
                        self._count(f"{what}: ACCEPTED")
                    except grpc.RpcError as e:
                        self._count(f"{what}: {e.code().name}")
                    finally:
                        call.cancel()
                    if self._stop.wait(self.pause):
                        return

    def _bad_files(self) -> None:
        names = [n for n in self.bad_files if n.endswith((".jpg", ".png"))]
        # Every pass skips every file: counted here, not logged each time. The level
        # is put back after, as the soak may run inside another program (the tests).
        client_log = logging.getLogger("gpufeed.client.loader")
        level = client_log.level
        client_log.setLevel(logging.ERROR)
        try:
            self._fetch_bad_files(names)
        finally:
            client_log.setLevel(level)

    def _fetch_bad_files(self, names: list[str]) -> None:
        loose = [n for n in names if n != f"{_BAD}/boxes.jpg"]
        passes = {
            "bad files": dict(files=loose),
            "lying shards": dict(files=[n for n in self.bad_files if n.endswith(".tar")]),
            "2 million boxes": dict(files=[f"{_BAD}/boxes.jpg"], fields={"boxes": ".txt"}),
        }
        with FeedClient(self.address) as feed:
            while not self._stop.is_set():
                for what, files in passes.items():
                    loader = feed.loader(batch_size=8, size=(64, 64), transport="inline",
                                         failure_budget=100, reconnect_timeout=0, **files)
                    try:
                        delivered = sum(len(b["index"]) for b in loader)
                        self._count(f"{what}: {len(loader.failures)} failed, {delivered} "
                                    f"delivered")
                    except FeedError as e:
                        self._count(f"{what}: stream ended {e.code.name}")
                    if self._stop.wait(self.pause):
                        return


def _silent(hung_up: threading.Event):
    """A request stream that sends nothing, and ends when the caller hangs up."""
    hung_up.wait()
    yield from ()
