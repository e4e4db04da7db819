"""POSIX shared-memory segments the server creates, and their clean-up.

Every segment is a file in /dev/shm named ``gpufeed-<server id>-<suffix>``,
created with mode 0600 (only the server's user can map it); the server id and
stream suffixes are random, so names cannot be guessed. Each running server
holds an ``flock`` on its probe segment (``gpufeed-<server id>-probe``) for its
whole life. A server that starts removes the segments of every server id whose
probe nobody holds any more: what a killed server left behind. This works
across containers that share /dev/shm but not a pid namespace.

Normally nothing is left at all: the server unlinks a stream's segment as soon
as the client says it has mapped it (``ShmSlots.attached``).

``ShmSlots`` is the shm transport's slot memory: one segment per stream, whose
name the header carries; a batch's message names its slot, not its bytes.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets

import numpy as np

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import SHM_DIR

from .slots import FilledBatch, SlotPlan, batch_fields, batch_pass_on_host

__all__ = ["SharedSegment", "ShmNamespace", "ShmSlots"]

_NAME = re.compile(r"^gpufeed-([0-9a-f]{16})-")
_log = logging.getLogger(__name__)


class SharedSegment:
    """A new, mapped segment of ``size`` bytes. ``unlink`` removes the name only."""

    def __init__(self, name: str, size: int):
        self.name = name
        self.size = size
        self._path = os.path.join(SHM_DIR, name)
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: a sparse segment would fail later, as a SIGBUS in
            # a decode thread (taking the whole server down), when /dev/shm fills up.
            os.posix_fallocate(self._fd, 0, size)
            self.buffer = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            os.unlink(self._path)
            raise
        self._linked = True

    def rename(self, name: str) -> None:
        path = os.path.join(SHM_DIR, name)
        os.rename(self._path, path)
        self.name, self._path = name, path

    def unlink(self) -> None:
        """Remove the name from /dev/shm; mappings stay valid until closed."""
        if self._linked:
            self._linked = False
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlink and unmap. Safe to call twice."""
        self.unlink()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self.buffer.close()
        except BufferError:
            # A view still exports the mapping; it is unmapped when that view
            # goes. The name is already gone, so nothing is left in /dev/shm.
            pass


class ShmNamespace:
    """This server's segment names, its probe, and the removal of stale ones."""

    def __init__(self) -> None:
        self.server_id = secrets.token_hex(8)
        removed = _remove_stale()
        if removed:
            _log.info("removed %d shared-memory segments and lanes left by dead servers",
                      removed)
        self.probe_token = secrets.token_bytes(16)
        try:
            self.probe: SharedSegment | None = self._make_probe()
        except OSError as e:  # /dev/shm full or missing: the server still serves inline
            _log.warning("no shared memory: cannot create the probe segment in %s (%s); "
                         "offering the inline transport only", SHM_DIR, e)
            self.probe = None

    def _make_probe(self) -> SharedSegment:
        # Lock the probe before it carries a name that a starting server would sweep.
        probe = SharedSegment(f".gpufeed-new-{self.server_id}", len(self.probe_token))
        try:
            fcntl.flock(probe._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            probe.buffer[:] = self.probe_token
            probe.rename(f"gpufeed-{self.server_id}-probe")
        except BaseException:
            probe.close()
            raise
        return probe

    def create(self, size: int) -> SharedSegment:
        return SharedSegment(self.new_name(), size)

    def new_name(self) -> str:
        """A name for this server's next segment or socket: removed with the segments
        by the next server to start if this one dies."""
        return f"gpufeed-{self.server_id}-{secrets.token_hex(8)}"

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()


class ShmSlots:
    """A stream's slots in a new segment of ``shm`` (a ``SlotMemory``)."""

    shared = True

    def __init__(self, shm: ShmNamespace, plan: SlotPlan):
        self._plan = plan
        self._segment = shm.create(plan.num_slots * plan.layout.slot_bytes)
        self.host = self._segment.buffer

    def header(self) -> feed_pb2.StreamHeader:
        return feed_pb2.StreamHeader(shm_name=self._segment.name)

    def attached(self) -> None:
        """The client has mapped the segment: its name can go."""
        self._segment.unlink()

    def filled(self, slot: np.ndarray, rows: int) -> None:
        batch_pass_on_host(self._plan, slot, rows)

    def device_views(self, slot: int) -> None:
        return None

    def publish(self, batch: FilledBatch) -> tuple[feed_pb2.Batch, None]:
        return batch_fields(batch, self._plan.layout), None

    def close(self) -> None:
        self._segment.close()


def _remove_stale() -> int:
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return 0
    by_server: dict[str, list[str]] = {}
    for name in names:
        match = _NAME.match(name)
        if match:
            by_server.setdefault(match.group(1), []).append(name)
    removed = 0
    for server_id, server_names in by_server.items():
        if _held(os.path.join(SHM_DIR, f"gpufeed-{server_id}-probe")):
            continue
        for name in server_names:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


def _held(probe_path: str) -> bool:
    """Whether a live server holds the lock on this probe."""
    try:
        fd = os.open(probe_path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except PermissionError:
        return True  # another user's server: not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
