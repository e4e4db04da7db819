"""CUDA IPC, the trainer's side: the only module of the client that touches CUDA.

The stream's device buffer is opened once (as torch.multiprocessing does for a
shared CUDA storage) on the local GPU with the server's UUID. Each batch is a
set of views of its slot (``slot_tensors`` over a storage of the batch's own
that aliases the slot, so its use count tells when the trainer has dropped
the batch: see batches.py). Before they are returned, the trainer's current
stream waits on the slot's ready event, so kernels queued afterwards see the
finished batch without a host synchronisation.

A dropped batch is given back by recording an event on the trainer's current
stream; a watcher thread sends the Release once that event has completed, so
the server never rewrites a slot that queued kernels still read. Requirements
and failure modes are listed in gpufeed/server/cuda_ipc.py.
"""

from __future__ import annotations

import queue
import threading

import grpc
import torch

from gpufeed.v1 import feed_pb2

from .batches import HeldSlots, Release, slot_tensors, storage_in_use
from .errors import FeedError

__all__ = ["CudaBatches", "local_device"]


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
        self._held = HeldSlots(header.num_slots, "CUDA")
        self.make_room = self._held.make_room
        self._copy = copy
        # Releases wait for the trainer's kernels: the loader must not send them itself.
        self.release_at_once = False

    def tensors(self, batch: feed_pb2.Batch) -> dict[str, torch.Tensor]:
        torch.cuda.current_stream(self.device).wait_event(self._ready[batch.slot])
        start = batch.slot * self._slot_bytes
        slot = self._storage[start:start + self._slot_bytes]  # a storage of its own, aliased
        tensors = slot_tensors(slot, batch.tensors)
        if self._copy:
            tensors = {name: t.clone() for name, t in tensors.items()}
            self._give_back(batch.seq)
        else:
            self._held.hold(lambda: storage_in_use(slot), lambda: self._give_back(batch.seq))
        return tensors

    def close(self) -> None:
        self._finished.put(None)

    def _give_back(self, seq: int) -> None:
        """Release ``seq`` once the kernels queued so far on the trainer's stream are done."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self._finished.put((seq, done))

    def _release_when_finished(self) -> None:
        while (item := self._finished.get()) is not None:
            seq, done = item
            done.synchronize()
            self._release(seq)
