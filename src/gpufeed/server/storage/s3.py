"""S3-compatible object storage as data roots: its names, its client and its errors.

A data root ``s3://bucket/prefix`` holds the names ``s3://bucket/key`` whose
key lies under the prefix (``S3Root``; roots.py confines every name to a root).

The operator configures S3 (never the client): the endpoint with
``--s3-endpoint`` or boto3's own ``AWS_ENDPOINT_URL``, credentials and region
as boto3 finds them (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, the
shared config and credentials files, an instance role). boto3 is the ``s3``
extra and is imported only when a root is an S3 URL. One client is shared by
every thread (boto3 clients are thread-safe), with a connection pool as large
as the threads that use it. Its timeouts are stated (``--s3-connect-timeout``,
``--s3-read-timeout``): a read from an object store that stops answering fails
with TimeoutError (its samples' category is ``timeout``) instead of holding a
thread for botocore's minute per attempt. botocore's errors become the OSError
kinds a sample's failure is reported by (``s3_errors``).

This module imports nothing heavy: config.py takes its timeouts' defaults from
here before boto3, torch or gRPC are imported.
"""

from __future__ import annotations

import errno
import os

from .versions import ShardChanged

__all__ = ["LIST_PAGE", "S3_CONNECT_TIMEOUT", "S3_READ_TIMEOUT", "S3_SCHEME", "PastEnd", "S3Root",
           "is_s3", "s3_client", "s3_errors", "split_s3"]

S3_SCHEME = "s3://"
# Seconds to wait for an S3 connection: a reachable endpoint answers in milliseconds, and
# this is long enough for Linux to retry a lost SYN twice (after 1 s, then 3 s).
S3_CONNECT_TIMEOUT = 10.0
# Seconds an S3 response may go silent (before its headers, or between bytes of its body)
# before the read fails: an object store's slowest healthy first byte is a second or two,
# a throttled one answers 503 at once; botocore's default, 60 s, held a decode or I/O
# thread a minute per attempt. Three attempts of a request that never answers stay well
# inside --lease-timeout's 300 s.
S3_READ_TIMEOUT = 30.0
# Keys per ListObjectsV2 page: S3's own maximum, and its default.
LIST_PAGE = 1000


def is_s3(name: str) -> bool:
    return name.startswith(S3_SCHEME)


def split_s3(url: str) -> tuple[str, str]:
    bucket, _, key = url[len(S3_SCHEME):].partition("/")
    return bucket, key


class S3Root:
    """One ``s3://bucket/prefix`` root."""

    def __init__(self, url: str):
        bucket, prefix = split_s3(url.rstrip("/"))
        if not bucket:
            raise ValueError(f"data root {url!r}: an S3 root is s3://bucket[/prefix]")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"{S3_SCHEME}{bucket}/{self.prefix}".rstrip("/")

    def holds(self, bucket: str, key: str) -> bool:
        return bucket == self.bucket and (not self.prefix or key.startswith(self.prefix + "/"))


def s3_client(endpoint: str | None, connections: int, connect_timeout: float,
              read_timeout: float):
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise RuntimeError("an s3:// data root needs boto3: pip install 'gpufeed[server,s3]'") \
            from None
    # boto3 reads AWS_ENDPOINT_URL itself; looked up here too, to address buckets as paths.
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or \
        os.environ.get("AWS_ENDPOINT_URL")
    # Standard retries: a request that timed out (connecting, or before its answer's
    # headers) is tried 3 times in all; a body that stalls is not retried by botocore (a
    # chunk's samples each read their own range again, chunks.py).
    config = Config(max_pool_connections=connections,
                    connect_timeout=connect_timeout, read_timeout=read_timeout,
                    retries={"max_attempts": 3, "mode": "standard"},
                    # Custom endpoints (SeaweedFS, MinIO, Ceph) serve buckets as paths.
                    s3={"addressing_style": "path"} if endpoint else None)
    return boto3.Session().client("s3", endpoint_url=endpoint or None, config=config)


class PastEnd(Exception):
    """A range that starts past the end of the object."""


class s3_errors:
    """botocore's errors as the OSError kinds a sample failure is reported by."""

    def __init__(self, path: str, etag: str = ""):
        self._path, self._etag = path, etag  # the ETag a read asked If-Match for

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is None:
            return False
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectTimeoutError,
            ReadTimeoutError,
        )

        if isinstance(error, ClientError):
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound", "NoSuchBucket"):
                raise FileNotFoundError(errno.ENOENT, f"{self._path}: not found") from None
            if code in ("AccessDenied", "403", "Forbidden"):
                raise PermissionError(errno.EACCES, f"{self._path}: access denied") from None
            if code == "InvalidRange":
                raise PastEnd() from None
            if code in ("PreconditionFailed", "412"):  # only a read with If-Match asks
                raise ShardChanged(f"shard changed since it was indexed: its ETag is no "
                                   f"longer {self._etag}") from None
            raise OSError(errno.EIO, f"{self._path}: S3 error {code}") from None
        if isinstance(error, (ReadTimeoutError, ConnectTimeoutError)):
            flag = "--s3-read-timeout" if isinstance(error, ReadTimeoutError) else \
                "--s3-connect-timeout"
            raise TimeoutError(f"{error} (gpufeed-server {flag})") from None
        if isinstance(error, BotoCoreError):
            raise OSError(errno.EIO, f"{self._path}: {error}") from None
        return False
