"""CUDA IPC, the trainer's side: the only module of the client that touches CUDA.

The stream's device buffer is opened once (as torch.multiprocessing does for a
shared CUDA storage) on the local GPU with the server's UUID. Each batch is a
set of views of its slot, and is known to be dropped when no tensor uses its
slot's storage any more (``SharedSlots`` in batches.py, device-agnostic and
tested on the CPU). Before they are returned, the trainer's current stream
waits on the slot's ready event, so kernels queued afterwards see the finished
batch without a host synchronisation. A batch that arrives while the trainer
holds all slots but one (or with ``copy=True``) is cloned on the device, on
that stream, and given back like a dropped batch, so the server never rewrites
the slot before the clone has read it.

A dropped batch is given back by recording an event on the stream that was
current when it was fetched; a watcher thread sends the Release once that
event has completed, so the server never rewrites a slot that kernels queued
there still read. The watcher sleeps until then (a blocking-sync event): a
plain event's wait spins a CPU core for as long as the training step's
kernels run. A trainer that reads a batch on another stream orders that
stream itself (``other.wait_stream(fetching)`` before, and the reverse before
it drops the batch), as for any tensor shared between streams. Requirements
and failure modes are listed in gpufeed/server/memory/cuda_ipc.py.
"""

from __future__ import annotations

import queue
import threading

import grpc
import torch

from gpufeed.v1 import feed_pb2

from .batches import Release, SharedSlots
from .checks import check_slot
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
    """Batches as CUDA views of the server's device ring, opened once (a ``BatchReader``).

    A batch's slot is released once the trainer has dropped it (or, for a copy,
    at once) and the kernels queued on its stream until then have finished.
    """

    shared = True

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
            self._ready = [torch.cuda.Event.from_ipc_handle(self.device, handle)
                           for handle in ipc.slot_events]
            # Last: from here on this process owns the count that keeps the ring allocated
            # (and the loader says `attached`); a failure before leaves it to the server.
            storage = torch.UntypedStorage._new_shared_cuda(
                index, ipc.storage_handle, ipc.storage_size, ipc.storage_offset,
                ipc.ref_counter_handle, ipc.ref_counter_offset, ipc.event_handle,
                ipc.event_sync_required)
        except RuntimeError as e:
            raise FeedError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"cuda_ipc: cannot open the server's GPU memory ({e}); trainer and "
                            f"server containers need `ipc: host`, a shared pid namespace and the "
                            f"same user, or use transport='shm'") from None
        self._slots = SharedSlots(storage, header.num_slots, header.slot_bytes, copy)
        self.make_room = self._slots.make_room
        self._release = release
        self._finished: queue.SimpleQueue = queue.SimpleQueue()  # put() is GC-safe
        threading.Thread(target=self._release_when_finished, daemon=True,
                         name="gpufeed-cuda-release").start()

    def tensors(self, batch: feed_pb2.Batch) -> dict[str, torch.Tensor]:
        """The batch's tensors, ready on the current stream; the slot is released by the
        watcher thread, after the trainer's kernels (a copy's too)."""
        check_slot(batch, len(self._ready))  # before it picks the slot's event
        stream = torch.cuda.current_stream(self.device)  # the batch is ready on this one
        stream.wait_event(self._ready[batch.slot])
        seq = batch.seq
        return self._slots.tensors(batch, lambda: self._give_back(seq, stream))

    def close(self) -> None:
        self._finished.put(None)

    def _give_back(self, seq: int, stream: torch.cuda.Stream) -> None:
        """Release ``seq`` once the kernels queued so far on ``stream`` are done."""
        done = torch.cuda.Event(blocking=True)  # waited for asleep, not spinning
        done.record(stream)
        self._finished.put((seq, done))

    def _release_when_finished(self) -> None:
        torch.cuda.set_device(self.device)  # else this thread's first CUDA call binds GPU 0
        while (item := self._finished.get()) is not None:
            seq, done = item
            done.synchronize()
            self._release(seq)
