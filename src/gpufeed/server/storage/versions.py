"""A shard's version: what it is now, so that a read of it is of the version its index describes.

``version`` (roots.py) names what a shard is now: a local file's device, inode,
size and mtime; an object's size and ETag. The index records the version it
read, and each read names it: a local shard's descriptor is checked once, when
it is opened, and an S3 range is asked for ``If-Match`` its ETag. A shard
replaced meanwhile fails the read with ``ShardChanged`` rather than giving
another version's bytes at the index's offsets.
"""

from __future__ import annotations

import os

__all__ = ["ShardChanged", "local_version", "s3_version", "what_changed"]


class ShardChanged(OSError):
    """A shard that is no longer the version its index describes: replaced or rewritten
    since it was indexed (its samples fail, category unreadable)."""


def local_version(stat: os.stat_result) -> str:
    return f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}"


def s3_version(reply: dict) -> str:
    """An object's version from a HEAD or GET reply: size, then the ETag (``read_range``
    takes the ETag back from after the first colon)."""
    return f"{reply['ContentLength']}:{reply.get('ETag', '')}"


def what_changed(version: str, now: os.stat_result) -> str:
    """How a local shard differs from the version its index was made from, in words."""
    device, inode, size, mtime = (int(part) for part in version.split(":"))
    if (now.st_dev, now.st_ino) != (device, inode):
        return "another file was put in its place"
    if now.st_size != size:
        return f"it is {now.st_size} bytes, was {size}"
    return "it was modified"
