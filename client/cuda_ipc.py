"""CUDA IPC, the trainer's side: the only module of the client that touches CUDA.

The stream's device buffer is opened once (as torch.multiprocessing does for a
shared CUDA storage) on the local GPU with the server's UUID. Each batch is a
set of views of its slot; before they are returned, the trainer's current
stream waits on the slot's ready event, so kernels queued afterwards see the
finished batch without a host synchronisation.

Each batch's tensors are built on a storage of their own that aliases the slot
(torch keeps no Python object alive for views of a CUDA buffer, so a
finaliser cannot tell when a batch is dropped; a storage's use count can).
Before each fetch the loader asks ``make_room``, which finds the batches no
tensor refers to any more, records an event on the trainer's current stream
for each, and a watcher thread sends the Release once that event has
completed: the server never rewrites a slot that queued kernels still read. Requirements and failure modes are listed in
gpufeed/server/cuda_ipc.py.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading

import grpc
import torch

from gpufeed.v1 import feed_pb2

from .batches import Release
from .errors import FeedError

__all__ = ["CudaBatches", "local_device"]

_log = logging.getLogger(__name__)


def local_device(uuid: str) -> int | None:
    """This process's ordinal for the GPU with ``uuid``, if it sees that GPU."""
    if not uuid or not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None


class CudaBatches:
    def __init__(self, header: feed_pb2.StreamHeader, release: Release, copy: bool):
        ipc = header.cuda_ipc
        index = local_device(ipc.gpu_uuid)
        if index is None:
            raise FeedError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"cuda_ipc: this process does not see the server's GPU {ipc.gpu_uuid}; "
                            f"use transport='auto' or 'shm'")
        self.device = torch.device("cuda", index)
        torch.cuda._lazy_init()
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                index, ipc.storage_handle, ipc.storage_size, ipc.storage_offset,
                ipc.ref_counter_handle, ipc.ref_counter_offset, ipc.event_handle,
                ipc.event_sync_required)
        except RuntimeError as e:
            raise FeedError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"cuda_ipc: cannot open the server's GPU memory ({e}); trainer and "
                            f"server containers need `ipc: host` and a shared pid namespace, or "
                            f"use transport='shm'") from None
        self._storage = storage
        self._ready = [torch.cuda.Event.from_ipc_handle(self.device, handle)
                       for handle in ipc.slot_events]
        self._slot_bytes = header.slot_bytes
        self._release = release
        self._finished: queue.SimpleQueue = queue.SimpleQueue()  # put() is GC-safe
        threading.Thread(target=self._release_when_finished, daemon=True,
                         name="gpufeed-cuda-release").start()
        self._num_slots = header.num_slots
        self._held: collections.deque[tuple[int, torch.UntypedStorage]] = collections.deque()
        self._warned = False
        self._copy = copy
        # Releases wait for the trainer's kernels: the loader must not send them itself.
        self.release_at_once = False

    def tensors(self, batch: feed_pb2.Batch) -> dict[str, torch.Tensor]:
        torch.cuda.current_stream(self.device).wait_event(self._ready[batch.slot])
        start = batch.slot * self._slot_bytes
        slot = self._storage[start:start + self._slot_bytes]  # a storage of its own, aliased
        tensors = {}
        for meta in batch.tensors:
            dtype = getattr(torch, meta.dtype)
            tensors[meta.name] = torch.empty(0, dtype=dtype, device=self.device).set_(
                slot, meta.offset // dtype.itemsize, tuple(meta.shape))
        if self._copy:
            tensors = {name: t.clone() for name, t in tensors.items()}
            self._record_release(batch.seq)
        else:
            self._held.append((batch.seq, slot))
        return tensors

    def make_room(self) -> None:
        """Release the batches nothing refers to; if every slot is still held, the oldest."""
        still_held = collections.deque()
        for seq, slot in self._held:
            if torch._C._storage_Use_Count(slot._cdata) > 1:  # a tensor still uses it
                still_held.append((seq, slot))
            else:
                self._record_release(seq)
        self._held = still_held
        if len(self._held) >= self._num_slots:
            if not self._warned:
                self._warned = True
                _log.warning("the trainer holds all %d CUDA batches of this stream; the oldest "
                             "is being reused while still referenced. Drop batches sooner, raise "
                             "prefetch, or pass copy=True to keep them.", self._num_slots)
            self._record_release(self._held.popleft()[0])

    def close(self) -> None:
        self._finished.put(None)

    def _record_release(self, seq: int) -> None:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self._finished.put((seq, done))

    def _release_when_finished(self) -> None:
        while (item := self._finished.get()) is not None:
            seq, done = item
            done.synchronize()
            self._release(seq)
