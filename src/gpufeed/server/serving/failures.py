"""A sample's failure as data: a category for programs, a detail for people.

Reading or decoding one sample can fail in a handful of ways that a trainer
or an operator treats differently: a missing file is a stale list, a denied
one a deployment mistake, an undecodable one bad data, one over a limit a
server setting. The error that ends a sample's read is classified here, by
its type, where the failure is made (the decode thread, running/stream.py): the
category goes on the wire (``SampleFailure.category``), the client lists it
and the failures metric counts by it, and nobody parses the text.
"""

from __future__ import annotations

import errno
import logging
import os

from gpufeed.v1 import feed_pb2

from ..media.decode import DecodeError, OverLimit
from ..media.transforms.runner import TransformFailed
from ..storage.paths import FileTooLarge
from ..storage.shardindex import ShardError

__all__ = ["log_sample_bug", "sample_failure"]

_log = logging.getLogger(__name__)
_logged_bugs: set[str] = set()  # exception types whose traceback the log has shown


def sample_failure(error: BaseException, index: int, path: str) -> tuple[int, str]:
    """(category, detail) of the error that failed sample ``index`` (read from ``path``).

    Never raises: an error that cannot describe itself (its ``__str__`` raises) is
    an internal failure all the same, since the decode thread that asks must
    still count its row.
    """
    try:
        return _classified(error, index, path)
    except Exception:
        return (feed_pb2.FAILURE_INTERNAL,
                f"internal error: {type(error).__name__} (whose message could not be made)")


def _classified(error: BaseException, index: int, path: str) -> tuple[int, str]:
    if isinstance(error, FileNotFoundError):  # an error without errno says what is missing
        return feed_pb2.FAILURE_NOT_FOUND, "file not found" if error.errno else str(error)
    if isinstance(error, PermissionError):
        return feed_pb2.FAILURE_PERMISSION_DENIED, f"permission denied: {error}"
    if isinstance(error, (FileTooLarge, OverLimit)):
        return feed_pb2.FAILURE_TOO_LARGE, f"too large: {error}"
    if isinstance(error, OSError):
        if isinstance(error, TimeoutError) or error.errno == errno.ETIMEDOUT:
            return feed_pb2.FAILURE_TIMEOUT, f"read timed out: {_strerror(error)}"
        return feed_pb2.FAILURE_UNREADABLE, f"read error: {_strerror(error)}"
    if isinstance(error, (DecodeError, ShardError)):
        return feed_pb2.FAILURE_UNDECODABLE, str(error)
    if isinstance(error, TransformFailed):
        return feed_pb2.FAILURE_TRANSFORM, str(error)
    log_sample_bug(error, index, path)  # a bug: fail the sample, keep the stream, say so in the log
    return feed_pb2.FAILURE_INTERNAL, f"internal error: {type(error).__name__}: {error}"


def _strerror(error: OSError) -> str:
    return os.strerror(error.errno) if error.errno else str(error)


def log_sample_bug(error: BaseException, index: int, path: str) -> None:
    """Log a sample's unexpected error with its traceback the first time its type is
    seen in this process, and at debug level after that: a bug that every sample
    hits would otherwise write a traceback per sample. The client gets each
    failure's detail anyway, and the failure metric counts them."""
    kind = type(error).__name__
    if kind in _logged_bugs:
        _log.debug("sample %d of %s: %s: %s", index, path, kind, error)
        return
    _logged_bugs.add(kind)
    _log.error("sample %d of %s", index, path, exc_info=error)
