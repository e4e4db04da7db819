"""Tar headers read directly, block by block: where each regular member of a shard lies.

A shard's index needs three things per member: its name, where its data starts
and how long it is. ``tarfile`` gave them, at a price paid on every shard a
request names: a ``TarInfo`` per member (about 30,000 members a second, so
seconds to a minute for a large shard), and its trust in the headers. It
accepts a negative size (a pax ``size`` record of minus the member's distance
from the pax header sends the next header back to it: the index loops, growing,
for ever), and reads a GNU long name or a pax record whole, allocating whatever
its header declares. Here the 512-byte headers are parsed
from windows of the file (``IndexSource.read``) and every number is checked
before it is used:

- a header's checksum must hold (unsigned or, as some old tars wrote it,
  signed); a size is octal digits or GNU base-256, never negative, never more
  than the shard holds; a pax ``size`` record is decimal digits;
- a long name or pax record is read only when it fits both the shard and
  ``MAX_RECORD_BYTES``;
- the next header lies past this one's data, rounded up to whole blocks, so
  offsets only grow and a shard of N bytes is at most N / 512 headers.

What breaks a rule raises ``BadTar`` (the caller decides what the members found
before it mean); a read error is the source's ``OSError``. Members come in
batches of at most ``every`` headers (empty ones too, when a stretch of the
shard holds no regular file), so that a caller can count samples and notice
a cancelled request while a shard of millions of headers is read.

Names are ustar's (with its ``prefix``), a GNU long name's (``././@LongLink``,
type ``L``), or a pax ``path`` record's, which wins over both, as tarfile has
it. Only regular files (types ``0``, NUL and ``7``) are members; every other
type is passed over: directories, links and devices (which carry no data),
GNU sparse files (whose data is not the file's bytes; old-style extension
blocks included), members a pax header marks sparse, global pax headers, link
targets (``K``) and types tar does not know (their data is skipped).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from typing import Protocol

__all__ = ["MAX_RECORD_BYTES", "BadTar", "IndexSource", "Member", "tar_members"]

_BLOCK = 512
# A long name or the pax records of one member: a path is at most a few KiB (PATH_MAX
# is 4096), a member's records a few hundred bytes. More is not a shard's.
MAX_RECORD_BYTES = 1 << 20
# Bytes read at once while headers come close together (small members: reading over
# their data costs less than a read per header), and when they lie far apart.
_DENSE_WINDOW = 64 << 10
_SPARSE_WINDOW = 4 << 10
_STREAM_WINDOW = 1 << 20  # an S3 object is read through anyway: fewer, larger reads

# name, size, chksum, typeflag, magic + version, prefix (the ustar header's fields)
_HEADER = struct.Struct("100s24x12s12x8sB100x8s80x155s12x")
_GNU_MAGIC = b"ustar  \x00"
_REGULAR = frozenset(b"0\x007")
_NO_DATA = frozenset(b"123456")  # links, devices, directories, FIFOs: tarfile reads no data
_PAX = frozenset(b"xX")
_LONG_NAME, _GNU_SPARSE = b"LS"
_EMPTY_CHKSUM = b"\0" * 8

Member = tuple[str, int, int]  # name, offset of its data, size


class BadTar(ValueError):
    """A header that breaks a rule of the format (or of a shard's size)."""


class IndexSource(Protocol):
    """A shard opened for its index."""

    @property
    def size(self) -> int:
        """The shard's size when it was opened: nothing past it is read."""
        ...

    @property
    def version(self) -> str:
        """The version of the shard it reads (roots.py's ``Storage.version``), which the
        index records."""
        ...

    @property
    def sequential(self) -> bool:
        """Whether reads must go forward (a streamed S3 object), each at or past the last."""
        ...

    def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer only at the shard's end)."""
        ...


def tar_members(source: IndexSource, every: int = 4096) -> Iterator[list[Member]]:
    """The shard's regular members, in order, in batches of at most ``every`` headers.

    A member whose data runs past the shard's end is the last one given, then
    BadTar says so; any other BadTar comes once the members before it are given.
    """
    window = _Window(source)
    end = source.size
    offset = 0
    batch: list[Member] = []
    headers = 0
    long_name: str | None = None
    pax: dict[bytes, bytes] = {}
    unpack, adler32 = _HEADER.unpack_from, zlib.adler32
    try:
        while True:
            headers += 1
            if headers == every:
                yield batch
                batch, headers = [], 0
            at = offset - window.start
            buf = window.buf
            if at < 0 or at + _BLOCK > len(buf):
                buf, at = window.get(offset, _BLOCK)
                if len(buf) - at < _BLOCK:
                    if len(buf) == at and offset:  # nothing more: the shard ends between members
                        break
                    raise BadTar("the shard ends inside a header" if offset or buf else
                                 "an empty file")
            name_field, size_field, chksum_field, kind, magic, prefix = unpack(buf, at)
            if chksum_field == _EMPTY_CHKSUM and buf.count(0, at, at + _BLOCK) == _BLOCK:
                break  # the end-of-archive block
            # The sum of the header's bytes, its checksum field counted as spaces. Each
            # half sums to less than 65521, so Adler-32's low half, 1 + sum mod 65521, is
            # its exact sum: C calls, not a Python loop over 512 bytes.
            view = window.view
            total = ((adler32(view[at:at + 256]) & 0xFFFF)
                     + (adler32(view[at + 256:at + _BLOCK]) & 0xFFFF)
                     - (adler32(chksum_field) & 0xFFFF) - 1 + 8 * 32)
            if _number(chksum_field) != total:
                _check_signed_sum(buf, at, chksum_field, total, offset)
            size = _number(size_field)
            if size is None:
                raise BadTar(f"the header at {offset} has a bad size field {size_field!r}")
            if kind in _REGULAR:
                member = True
                name = None
                if pax or long_name is not None:
                    if b"size" in pax:  # the member's own records (a global header's are not read)
                        size = _pax_size(pax[b"size"], offset)
                    member = not any(key.startswith(b"GNU.sparse.") for key in pax)
                    name = _decode(pax[b"path"]) if b"path" in pax else long_name
                    long_name, pax = None, {}
                if name is None:
                    name = name_field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                    if prefix[0] and magic != _GNU_MAGIC:
                        name = _decode(prefix.split(b"\0", 1)[0]) + "/" + name
                if size > end:
                    raise BadTar(f"member {name!r} declares {size} bytes, more than the "
                                 f"shard's {end}")
                data = offset + _BLOCK
                if member and not (kind == 0 and name.endswith("/")):  # V7's directory
                    batch.append((name, data, size))
                if data + size > end:
                    raise BadTar(f"member {name!r} runs past the end of the shard")
                offset = _next(offset, size, offset)
            elif kind in _PAX or kind == _LONG_NAME:
                record = window.record(offset + _BLOCK, size, offset)
                if kind == _LONG_NAME:
                    long_name = _decode(record.split(b"\0", 1)[0])
                else:
                    pax.update(_pax_records(record, offset))
                offset = _next(offset, size, offset)
            else:
                long_name, pax = None, {}
                offset = _skip(window, buf, at, kind, size, offset, end)
    except (BadTar, OSError):
        if batch:
            yield batch
        raise
    if batch:
        yield batch


def _skip(window: _Window, buf: bytes, at: int, kind: int, size: int, offset: int,
          end: int) -> int:
    """The offset of the header after a header that is no member (``buf[at:]``)."""
    if kind in _NO_DATA:
        return offset + _BLOCK
    last = offset  # the last block before the data
    if kind == _GNU_SPARSE:  # old GNU sparse: extension blocks before the data
        extended = buf[at + 482]
        while extended:
            last += _BLOCK
            more, where = window.get(last, _BLOCK)
            if len(more) - where < _BLOCK:
                raise BadTar("the shard ends inside a sparse header")
            extended = more[where + 504]
    if size > end - last - _BLOCK:  # a global pax header, a long link, unknown types
        raise BadTar(f"the header at {offset} declares {size} bytes, more than the shard "
                     f"holds")
    return _next(last, size, offset)


def _next(header: int, size: int, offset: int) -> int:
    """The offset of the header after one at ``header`` with ``size`` bytes of data; never
    at or before ``offset`` (the current header), so that an index only goes forward."""
    after = header + _BLOCK + (size + _BLOCK - 1) // _BLOCK * _BLOCK
    if after <= offset:  # cannot happen with size >= 0; an index that loops would
        raise BadTar(f"the header at {offset} points back to {after}")
    return after


def _check_signed_sum(buf: bytes, at: int, field: bytes, total: int, offset: int) -> None:
    """Some tars summed signed bytes: each byte over 127 counts 256 less. BadTar if the
    checksum is neither sum."""
    high = sum(1 for b in buf[at:at + 148] if b > 127) + \
        sum(1 for b in buf[at + 156:at + _BLOCK] if b > 127)
    if _number(field) != total - 256 * high:
        raise BadTar(f"bad checksum in the header at {offset}")


def _number(field: bytes) -> int | None:
    """A header's numeric field: octal digits (NUL or space ended), or GNU's base-256
    (first byte 0x80); None for anything else, a negative base-256 number included."""
    if field[0] & 0x80:
        return int.from_bytes(field[1:], "big") if field[0] == 0x80 else None
    digits = field.split(b"\0", 1)[0].strip()
    if digits.isdigit():  # ASCII digits only: no sign, space or underscore for int()
        try:
            return int(digits, 8)
        except ValueError:  # an 8 or a 9
            return None
    return None if digits else 0


def _pax_size(value: bytes, offset: int) -> int:
    if not value.isdigit() or not value.isascii() or len(value) > 20:
        raise BadTar(f"the pax header before {offset} has a bad size {value[:40]!r}")
    return int(value)


def _pax_records(data: bytes, offset: int) -> dict[bytes, bytes]:
    """``"%d %s=%s\\n"`` records (the length counts the whole record), up to NUL padding."""
    records: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data) and data[pos]:
        space = data.find(b" ", pos, pos + 21)
        length = data[pos:space]
        if space < 0 or not length.isdigit() or not length.isascii():
            raise BadTar(f"a bad pax record in the header at {offset}")
        end = pos + int(length)
        equals = data.find(b"=", space, end)
        if end > len(data) or equals < 0 or data[end - 1] != 0x0A:
            raise BadTar(f"a bad pax record in the header at {offset}")
        records[data[space + 1:equals]] = data[equals + 1:end - 1]
        pos = end
    return records


def _decode(name: bytes) -> str:
    return name.decode("utf-8", "surrogateescape")


class _Window:
    """The bytes of the shard around the headers being read: one read per window, not per
    header. Locally a window is wide while headers come close together and narrow when
    members are large (a read per header, as seeking over their data was); a stream is
    read forward in large windows."""

    def __init__(self, source: IndexSource):
        self._source = source
        self.buf = b""
        self.view = memoryview(self.buf)
        self.start = 0  # the shard's offset of buf[0]

    def get(self, offset: int, length: int) -> tuple[bytes, int]:
        """(buffer, where ``offset`` is in it) holding [offset, offset + length), or what
        the shard has of it. What the window already holds of it is kept, not read again
        (a stream cannot go back)."""
        at = offset - self.start
        if 0 <= at and at + length <= len(self.buf):
            return self.buf, at
        kept = self.buf[at:] if 0 <= at < len(self.buf) else b""
        if self._source.sequential:
            width = _STREAM_WINDOW
        else:
            gap = offset - (self.start + len(self.buf))
            width = _DENSE_WINDOW if gap < _DENSE_WINDOW else _SPARSE_WINDOW
        more = self._source.read(offset + len(kept), max(length, width) - len(kept))
        self.buf = kept + more if kept else more
        self.view = memoryview(self.buf)
        self.start = offset
        return self.buf, 0

    def record(self, offset: int, size: int, header: int) -> bytes:
        """A long name's or pax header's ``size`` bytes at ``offset``, once the size is
        known to fit the shard and MAX_RECORD_BYTES."""
        if size > MAX_RECORD_BYTES or size > self._source.size - offset:
            raise BadTar(f"the header at {header} declares a {size}-byte name or pax record, "
                         f"more than the shard holds or {MAX_RECORD_BYTES} bytes")
        buf, at = self.get(offset, size)
        if len(buf) - at < size:
            raise BadTar(f"the shard ends inside the record of the header at {header}")
        return buf[at:at + size]
