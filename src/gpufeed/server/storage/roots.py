"""Where sample bytes come from: local data roots, or prefixes in S3-compatible storage.

``Storage`` is what the rest of the server reads through. A data root is a
local directory (``paths.DataRoots`` keeps reads inside it) or an
``s3://bucket/prefix`` URL. Confinement is the same idea for both: a name that
resolves outside every root is refused (``OutsideDataRoots``, sent as
PERMISSION_DENIED). For S3 a name is ``s3://bucket/key``, confined when its
bucket is a root's and its key lies under the root's prefix (``..`` segments
are refused, never resolved); a relative name resolves under the first S3 root
when no local root is configured.

How S3 is configured, and its errors, are s3.py's; what a shard's version is,
versions.py's: a shard is read as the version its index describes (``version``,
checked when a local shard is opened, ``open_shard``), or not at all.

Loose S3 files are images only, read ahead as shard samples are (readahead.py):
video and array readers need a seekable local file, and fail such a sample
saying so.

S3 has no directories, only keys; a "directory" is a prefix ending in "/"
(``is_directory``), and ``list_objects`` lists what lies under one with
ListObjectsV2, a page at a time, so that a caller counting what it keeps stops
a listing of a hundred million keys at its bound. What a listing yields obeys
``locate``'s rules: a key outside the prefix asked for, or with a ``..``
segment (which an HTTP client or proxy on the way may resolve into another
key), is refused as OutsideDataRoots, never read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial

from .indexreads import IndexReads
from .paths import DEFAULT_MAX_FILE_BYTES, DataRoots, FileTooLarge, OutsideDataRoots
from .readahead import ReadAhead
from .s3 import (
    LIST_PAGE,
    S3_CONNECT_TIMEOUT,
    S3_READ_TIMEOUT,
    S3_SCHEME,
    PastEnd,
    S3Root,
    is_s3,
    s3_client,
    s3_errors,
    split_s3,
)
from .versions import ShardChanged, local_version, s3_version, what_changed

__all__ = ["Storage"]

# A shard is a container: its size is not limited, each sample read from it is.
_CONTAINER = sys.maxsize
_READ_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Storage:
    """Reads confined to the data roots, local (paths.py's ``DataRoots``) or S3 prefixes:
    the one object the server reads through."""

    def __init__(self, roots: list[str], s3_endpoint: str | None = None,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, connections: int = 10,
                 io_threads: int = 16, read_ahead_bytes: int = 256 << 20,
                 s3_connect_timeout: float = S3_CONNECT_TIMEOUT,
                 s3_read_timeout: float = S3_READ_TIMEOUT):
        if not roots:
            raise ValueError("at least one data root is required")
        if not (s3_connect_timeout > 0 and s3_read_timeout > 0):
            raise ValueError("--s3-connect-timeout and --s3-read-timeout must be positive")
        local = [r for r in roots if not is_s3(r)]
        self.max_file_bytes = max_file_bytes
        self._local = DataRoots(local, max_file_bytes) if local else None
        self._s3_roots = [S3Root(r) for r in roots if is_s3(r)]
        self.roots = (self._local.roots if self._local else []) + [r.url for r in self._s3_roots]
        self._client = None
        # The I/O stage (readahead.py): only for S3, and off with a budget of 0.
        self.read_ahead: ReadAhead | None = None
        if self._s3_roots:
            self._client = s3_client(s3_endpoint, connections + io_threads,
                                     s3_connect_timeout, s3_read_timeout)
            if read_ahead_bytes > 0:
                self.read_ahead = ReadAhead(io_threads, read_ahead_bytes)
        self._bytes = self._seconds = self._index_bytes = None
        self._by_source: dict[str, tuple] | None = None

    def register_metrics(self, registry) -> None:
        """Per source (local, s3): bytes read and read latency; the read-ahead depth."""
        from prometheus_client import Counter, Histogram

        self._bytes = Counter("gpufeed_storage_read_bytes", "Bytes read from storage, per "
                              "source.", ["source"], registry=registry)
        self._seconds = Histogram("gpufeed_storage_read_seconds", "Latency of one read "
                                  "(a file, a shard sample, an S3 chunk of shard samples), "
                                  "per source.",
                                  ["source"], buckets=_READ_BUCKETS, registry=registry)
        # Each source's two series, looked up once: labels() takes a lock per call.
        self._by_source = {source: (self._bytes.labels(source), self._seconds.labels(source))
                           for source in ("local", "s3")}
        self._index_bytes = Counter("gpufeed_storage_index_bytes", "Bytes read to index tar "
                                    "shards (also in gpufeed_storage_read_bytes), per source.",
                                    ["source"], registry=registry)
        for source in ("local", "s3"):
            self._index_bytes.labels(source)
        registry.register(_ReadAheadDepth(self))

    def close(self) -> None:
        if self.read_ahead is not None:
            self.read_ahead.close()

    @property
    def _s3(self):
        """The S3 client: made in __init__ when a data root is on S3; an S3 path that
        reaches a read is under one (``locate``)."""
        if self._client is None:
            raise RuntimeError("an S3 read with no S3 data root: the path was not located")
        return self._client

    # -- names -------------------------------------------------------------

    def locate(self, name: str) -> str:
        """The confined path or URL for ``name``; OutsideDataRoots when it escapes."""
        if is_s3(name):
            bucket, key = split_s3(name)
            if ".." in key.split("/") or not any(r.holds(bucket, key) for r in self._s3_roots):
                raise OutsideDataRoots(f"{name!r} is not under an S3 data root")
            return name
        if self._local is not None:
            return self._local.locate(name)
        rel = posixpath.normpath(name)
        if name.startswith("/") or rel == ".." or rel.startswith("../"):
            raise OutsideDataRoots(f"{name!r} is not under a data root")
        root = self._s3_roots[0]
        key = root.prefix if rel == "." else posixpath.join(root.prefix, rel)
        if rel == "." or name.endswith("/"):  # a directory named as one stays one
            key += "/"
        return f"{S3_SCHEME}{root.bucket}/{key.lstrip('/')}"

    def shown(self, path: str) -> str:
        """A located path as a request would name it, for messages (an S3 URL in full)."""
        if is_s3(path) or self._local is None:
            return path
        return self._local.shown(path)

    def root_of(self, path: str) -> str | None:
        """The root a located path lies under (lexically), or None."""
        if is_s3(path):
            bucket, key = split_s3(path)
            return next((r.url for r in self._s3_roots if r.holds(bucket, key)), None)
        return self._local.root_of(path) if self._local is not None else None

    # -- listings ----------------------------------------------------------

    def is_directory(self, path: str) -> bool:
        """Whether a located path is a directory: for a local one, the file system says;
        an S3 URL is one when it ends in "/", or when an object lies under it (one LIST
        of one key): ``s3://b/val`` is a directory if ``s3://b/val/x`` exists."""
        if not is_s3(path):
            return os.path.isdir(path)
        if path.endswith("/"):
            return True
        bucket, key = split_s3(path)
        with s3_errors(path):
            reply = self._s3.list_objects_v2(Bucket=bucket, Prefix=key + "/", MaxKeys=1)
        return bool(reply.get("Contents") or reply.get("CommonPrefixes"))

    def list_objects(self, directory: str, first_level: bool = False) -> Iterator[str]:
        """The names under an S3 ``directory`` (a located URL ending in "/"), relative to
        it, as ListObjectsV2 gives them, one page at a time: a caller that stops early
        asks for no more pages. Every key under it, recursively (a "directory marker"
        key ending in "/" too); with ``first_level``, the keys directly in it and its
        first-level "directories" (``name/``), the delimiter's common prefixes.

        The store's order is not relied on (SeaweedFS lists in another order than
        AWS's byte order). OutsideDataRoots for a directory under no root, a key
        outside it or one with a ``..`` segment; the OSError kinds of ``s3_errors``
        for a failed LIST (FileNotFoundError: no such bucket).
        """
        bucket, prefix = split_s3(directory)
        if not directory.endswith("/") or self.root_of(directory) is None:
            raise OutsideDataRoots(f"{directory!r} is not a directory under an S3 data root")
        extra = {"Delimiter": "/"} if first_level else {}
        pages = self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix, **extra, PaginationConfig={"PageSize": LIST_PAGE})
        with s3_errors(directory):
            for page in pages:
                names = [entry["Key"] for entry in page.get("Contents", ())]
                names += [entry["Prefix"] for entry in page.get("CommonPrefixes", ())]
                for key in names:
                    url = f"{S3_SCHEME}{bucket}/{key}"
                    if not key.startswith(prefix):
                        raise OutsideDataRoots(f"the listing of {directory!r} answered {url!r}, "
                                               f"which is not under it")
                    if ".." in key.split("/"):
                        raise OutsideDataRoots(f"{url!r} (under {directory!r}) has a '..' "
                                               f"segment: refused, never resolved")
                    yield key[len(prefix):]

    # -- reads -------------------------------------------------------------

    def read(self, path: str, max_bytes: int | None = None,
             flag: str = "--max-file-bytes") -> bytes:
        """The whole file or object; FileTooLarge past ``max_bytes`` (``max_file_bytes``)."""
        started = time.perf_counter()
        if is_s3(path):
            limit = self.max_file_bytes if max_bytes is None else max_bytes
            data = self._get_at_most(path, limit, flag)
        else:
            data = self._local_roots(path).read(path, max_bytes, flag)
        self._observe(path, len(data), started)
        return data

    def read_range(self, path: str, offset: int, size: int, max_bytes: int | None = None,
                   version: str = "") -> bytes:
        """``size`` bytes at ``offset`` (fewer at the end of the file or object): a sample
        inside a shard, which may be larger than --max-file-bytes; the sample may not
        (``max_bytes``: a run of samples' own limit, each checked before). With a
        ``version`` (the one its index was made from), ShardChanged when the shard is
        another now."""
        if not is_s3(path):
            fd = self.open_shard(path, version)
            try:
                return self.read_at(fd, path, offset, size, max_bytes)
            finally:
                os.close(fd)
        etag = version.partition(":")[2]
        return self._read_sample(path, size, max_bytes,
                                 partial(self._get, path, f"bytes={offset}-{offset + size - 1}",
                                         etag))

    def open_shard(self, path: str, version: str = "") -> int:
        """A local shard's descriptor, checked as a sample file is (under a data root, a
        regular file) but of any size, for ``read_at``; and, given the ``version`` its
        index was made from, that it is still that file (ShardChanged if not). The
        descriptor keeps that file whatever is renamed over its path later."""
        fd = self._local_roots(path).open_checked(path, _CONTAINER)
        try:
            self.check_unchanged(fd, version)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def check_unchanged(self, fd: int, version: str) -> None:
        """ShardChanged when an open local shard is no longer the ``version`` its index
        was made from: replaced (another file at its path when opened) or written in
        place (``cp`` over it, ``rsync --inplace``: its size or mtime moved). Checked
        after each read too, so bytes read while it changed are never used."""
        if version:
            now = os.fstat(fd)
            if local_version(now) != version:
                raise ShardChanged(f"shard changed since it was indexed: "
                                   f"{what_changed(version, now)}")

    def read_at(self, fd: int, path: str, offset: int, size: int, max_bytes: int | None = None
                ) -> bytes:
        """``read_range`` on a local shard's descriptor from ``open_shard`` (one ``pread``)."""
        return self._read_sample(path, size, max_bytes, partial(os.pread, fd, size, offset))

    def _read_sample(self, path: str, size: int, max_bytes: int | None,
                     read: Callable[[], bytes]) -> bytes:
        """``read()`` of a shard sample's ``size`` bytes (or a run of samples'), refused
        before reading past its limit, and counted."""
        if size <= 0:
            return b""
        limit = self.max_file_bytes if max_bytes is None else max_bytes
        if size > limit:
            raise FileTooLarge(f"sample of {size} bytes, over the limit of {limit} "
                               f"(gpufeed-server --max-file-bytes)")
        started = time.perf_counter()
        data = read()
        self._observe(path, len(data), started)
        return data

    def open_object(self, path: str) -> tuple[int, _ObjectBody]:
        """An S3 object's size and unread body (the I/O stage reads loose objects so, to learn
        their size before their bytes); FileTooLarge past ``max_file_bytes``, unread."""
        started = time.perf_counter()
        bucket, key = split_s3(path)
        with s3_errors(path):
            reply = self._s3.get_object(Bucket=bucket, Key=key)
        size = int(reply["ContentLength"])
        if size > self.max_file_bytes:
            reply["Body"].close()
            raise FileTooLarge(f"object of {size} bytes, over the limit of "
                               f"{self.max_file_bytes} (gpufeed-server --max-file-bytes)")
        return size, _ObjectBody(self, path, reply["Body"], started)

    def _observe(self, path: str, size: int, started: float) -> None:
        if self._by_source is not None:
            read_bytes, read_seconds = self._by_source["s3" if is_s3(path) else "local"]
            read_bytes.inc(size)
            read_seconds.observe(time.perf_counter() - started)

    def open_checked(self, path: str, max_bytes: int | None = None,
                     flag: str = "--max-file-bytes") -> int:
        """A local file's descriptor (video and array readers need one)."""
        if is_s3(path):
            raise OSError(errno.EOPNOTSUPP, "video and array samples are read from local "
                                            "data roots only, not S3")
        return self._local_roots(path).open_checked(path, max_bytes, flag)

    def version(self, path: str) -> str:
        """What the shard is now, a tag that changes when it does (a local file's device,
        inode, size and mtime; an object's size and ETag): whether an index made earlier
        still describes it."""
        if is_s3(path):
            bucket, key = split_s3(path)
            with s3_errors(path):
                reply = self._s3.head_object(Bucket=bucket, Key=key)
            return s3_version(reply)
        fd = self._local_roots(path).open_checked(path, _CONTAINER)
        try:
            return local_version(os.fstat(fd))
        finally:
            os.close(fd)

    def open_index(self, path: str) -> IndexReads:
        """The shard opened to index it (tarindex.py's ``IndexSource``): a local file read
        where the headers are, an object in one streamed GET; its ``version`` is that of
        what it reads. Its reads count as read bytes and index bytes."""
        if is_s3(path):
            bucket, key = split_s3(path)
            with s3_errors(path):
                reply = self._s3.get_object(Bucket=bucket, Key=key)
            return IndexReads(self._observe_index, path, int(reply["ContentLength"]),
                              s3_version(reply), body=reply["Body"])
        fd = self._local_roots(path).open_checked(path, _CONTAINER)
        try:
            stat = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        return IndexReads(self._observe_index, path, stat.st_size, local_version(stat), fd=fd)

    def _observe_index(self, path: str, size: int) -> None:
        read_bytes, index_bytes = self._bytes, self._index_bytes
        if read_bytes is not None and index_bytes is not None:  # both set by register_metrics
            source = "s3" if is_s3(path) else "local"
            read_bytes.labels(source).inc(size)
            index_bytes.labels(source).inc(size)

    def _get(self, path: str, byte_range: str = "", etag: str = "") -> bytes:
        bucket, key = split_s3(path)
        extra = {"Range": byte_range} if byte_range else {}
        if etag:  # the object the index describes, or 412 (ShardChanged)
            extra["IfMatch"] = etag
        try:
            with s3_errors(path, etag):
                reply = self._s3.get_object(Bucket=bucket, Key=key, **extra)
                return reply["Body"].read()
        except PastEnd:
            return b""

    def _get_at_most(self, path: str, limit: int, flag: str) -> bytes:
        """An object's bytes; FileTooLarge without reading its body when its answer
        declares more than ``limit`` (a sidecar's bound may be a few KiB, the object
        a gigabyte), and after at most ``limit + 1`` bytes whatever it declared."""
        bucket, key = split_s3(path)
        with s3_errors(path):
            reply = self._s3.get_object(Bucket=bucket, Key=key)
            size = int(reply.get("ContentLength", 0))
            with contextlib.closing(reply["Body"]) as body:
                data = body.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise FileTooLarge(f"object of {max(size, len(data))} bytes, over the limit of "
                               f"{limit} (gpufeed-server {flag})")
        return data

    def _local_roots(self, path: str) -> DataRoots:
        if self._local is None:
            raise OutsideDataRoots(f"{path!r} is not under a data root")
        return self._local


class _ObjectBody:
    """An answered GET's body, counted in the storage metrics when read."""

    def __init__(self, storage: Storage, path: str, body, started: float):
        self._storage, self._path, self._body, self._started = storage, path, body, started

    def read(self) -> bytes:
        with s3_errors(self._path):
            data = self._body.read()
        self._storage._observe(self._path, len(data), self._started)
        return data

    def close(self) -> None:
        self._body.close()


class _ReadAheadDepth:
    """Scrape-time figures of the I/O stage: reads started, reads queued, bytes held."""

    def __init__(self, storage: Storage):
        self._storage = storage

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stage = self._storage.read_ahead
        queued, held = stage.depth() if stage else (0, 0)
        yield CounterMetricFamily("gpufeed_storage_read_ahead_started", "Reads the I/O "
                                  "threads started ahead of the decode threads (chunks of "
                                  "S3 shard samples, loose objects).",
                                  value=stage.started if stage else 0)
        yield GaugeMetricFamily("gpufeed_storage_read_ahead_reads", "Reads issued ahead of "
                                "the decode threads and not yet started or taken (S3).",
                                value=queued)
        yield GaugeMetricFamily("gpufeed_storage_read_ahead_bytes", "Bytes of reads ahead "
                                "started and not yet taken by a decode thread (S3; within "
                                "--read-ahead-bytes).", value=held)
