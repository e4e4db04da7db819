"""A stream's reads of S3 tar shards in chunks: a run of whole consecutive samples of one
shard fetched by one ranged GET, each sample then handed its bytes sliced from it.

shards.py's docstring states the rule for users (why, what a chunk holds, the
memory bound); this is how it holds:

- a byte per sample says whether the stream will still read it and no chunk
  holds it (``will_read``: the positions of its served batches from its start
  on, padded repeats included; a stream of a shared job (serving/running/sources.py) counts
  every batch of the pass, so samples another consumer takes stay held, within
  the share, until the stream ends);
- ``issue`` (a batch claimed) starts a chunk at each of its samples no chunk
  holds; the run grows over the shard's next wanted samples, those of the
  claimed batch always, others while the stream's chunks stay within its share;
- a chunk is one read of the I/O stage (readahead.py) with a taker per sample:
  charged to the read-ahead budget from its start until the last one takes its
  bytes; ``forget`` (the stream ended) drops what is left;
- ``take`` hands a sample a memoryview of its chunk; a sample held by no chunk
  (local, a repeat in flight) or whose chunk's GET failed or came back short
  reads its own range, so it fails, if at all, for what is wrong with it;
- a chunk's GET names the shard's version its index was made from (``If-Match``
  its ETag, roots.py), so its bytes are that version's or it fails.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from .readahead import PendingRead
from .roots import Storage

__all__ = ["CHUNK_BYTES", "ChunkReads", "Span"]

# The bytes one GET fetches at most: bench/RESULTS.md ("The S3 chunk size") has the measurement.
CHUNK_BYTES = 4 << 20
# A stream's chunks hold at most this part of the read-ahead budget for samples ahead.
_SHARE = 4

# A sample's bytes: (shard path, offset, size), and the shard's version its index describes.
Span = tuple[str, int, int, str]


class _Chunk:
    """A run of ``samples`` whole samples: bytes [start, start + size) of ``path`` (as of
    ``version``); ``live`` of them not yet taken."""

    __slots__ = ("path", "start", "size", "version", "samples", "live", "pending")

    def __init__(self, path: str, start: int, size: int, samples: int, version: str = ""):
        self.path, self.start, self.size, self.version = path, start, size, version
        self.samples = self.live = samples
        self.pending: PendingRead | None = None


class ChunkReads:
    """One stream's chunks, and which of them each sample they hold reads from.

    ``span(sample)``: the sample's bytes, None when it fails without a read;
    ``shard_end(sample)``: the index after its shard's last sample.
    """

    def __init__(self, num_samples: int, span: Callable[[int], Span | None],
                 shard_end: Callable[[int], int]):
        self._span, self._shard_end = span, shard_end
        self._lock = threading.Lock()
        # 1: the stream will read the sample and no chunk holds it; 0: read, held, or not its.
        self._wanted = np.ones(num_samples, np.uint8)
        self._held: dict[int, tuple[_Chunk, int, int]] = {}  # sample -> (chunk, at, size)
        self._bytes = 0  # what this stream's chunks hold

    def will_read(self, samples: np.ndarray) -> None:
        """The samples the stream reads (its served batches from its start position on)."""
        with self._lock:
            self._wanted[:] = 0
            self._wanted[samples] = 1

    def issue(self, storage: Storage, samples: list[int]) -> None:
        """Start the reads of a claimed batch's samples: a chunk at each one no chunk holds."""
        stage = storage.read_ahead
        assert stage is not None  # the caller reads ahead only when the storage does
        batch, chunks = set(samples), []
        with self._lock:
            share = stage.budget // _SHARE
            for sample in samples:
                if sample not in self._held:  # else held ahead, or a repeat in flight
                    chunk = self._run(sample, batch, share, storage.max_file_bytes)
                    if chunk is not None:
                        chunks.append(chunk)
            for chunk in chunks:
                chunk.pending = stage.issue(chunk.size, self._reader(storage, chunk),
                                            takers=chunk.samples)

    def take(self, storage: Storage, sample: int, read: Callable[[], bytes]
             ) -> bytes | memoryview:
        """The sample's bytes: sliced from its chunk, else ``read()`` here (not issued ahead,
        a repeat in flight, or its chunk's GET failed)."""
        with self._lock:
            held = self._held.pop(sample, None)
            self._wanted[sample] = 0
            if held is not None:
                chunk = held[0]
                chunk.live -= 1
                if chunk.live == 0:
                    self._bytes -= chunk.size
        if held is None or storage.read_ahead is None:
            return read()
        chunk, at, size = held
        assert chunk.pending is not None  # issued with the chunk, under the lock
        try:
            data = storage.read_ahead.take(chunk.pending)
        except OSError:
            return read()  # the chunk's GET failed: this sample's own read says why, if at all
        if at + size > len(data):  # the object ends early: this sample reads (and fails) alone
            return read()
        return memoryview(data)[at:at + size]

    def forget(self, storage: Storage) -> None:
        """The stream ended: its chunks give their bytes back."""
        with self._lock:
            chunks = {id(chunk): chunk for chunk, _, _ in self._held.values()}
            self._held.clear()
            self._bytes = 0
        if storage.read_ahead is not None:
            for chunk in chunks.values():
                if chunk.pending is not None:
                    storage.read_ahead.drop(chunk.pending)

    def _run(self, sample: int, batch: set[int], share: int, max_sample: int) -> _Chunk | None:
        """The chunk starting at ``sample`` (under the lock); None when it fails unread."""
        first = self._span(sample)
        if first is None:
            return None
        path, start, size, version = first
        run = [(sample, start, size)]
        if size <= max_sample:
            room = share - self._bytes  # for samples ahead of the claimed batch
            for later in range(sample + 1, self._shard_end(sample)):
                span = self._span(later) if self._wanted[later] else None
                if span is None or span[2] > max_sample:
                    break
                grown = span[1] + span[2] - start
                if grown > CHUNK_BYTES or (later not in batch and grown > room):
                    break
                run.append((later, span[1], span[2]))
        end = run[-1][1] + run[-1][2]
        chunk = _Chunk(path, start, end - start, len(run), version)
        self._bytes += chunk.size
        for held, offset, length in run:
            self._held[held] = (chunk, offset - start, length)
            self._wanted[held] = 0
        return chunk

    @staticmethod
    def _reader(storage: Storage, chunk: _Chunk) -> Callable[[], bytes]:
        # A run of several samples may exceed --max-file-bytes; each of its samples may not.
        limit = chunk.size if chunk.samples > 1 else None
        return lambda: storage.read_range(chunk.path, chunk.start, chunk.size, limit,
                                          chunk.version)
