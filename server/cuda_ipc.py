"""CUDA IPC, the server's side: the only module of the server that touches CUDA.

A cuda_ipc stream keeps two rings with the same slots: the host ring (pinned
memory) that decode threads write, and one device allocation exported once to
the trainer. When a batch is complete, ``publish`` copies its slot host->device
on a side stream and records the slot's interprocess event; the trainer's
stream waits on that event before it reads. The trainer releases a slot only
after the kernels that read it have finished (the client records an event on
its own stream and waits for it before sending the Release), so the ring's
ordinary leases also protect the device memory and the host slot under a copy.

What it needs, and what goes wrong otherwise:

* both processes see the same GPU: matched by UUID, not ordinal. A trainer
  without it gets shm or inline from ``auto``, and a refusal naming the UUID if
  it asks for cuda_ipc.
* shared IPC and PID namespaces between containers (``ipc: host``, ``pid:
  host`` or a shared pid namespace): otherwise opening the handle fails in the
  trainer with "cudaIpcOpenMemHandle ... invalid argument" (or "invalid device
  context"), surfaced as a FeedError naming cuda_ipc; ``auto`` never picks
  cuda_ipc unless the shared-memory probe shows the two share /dev/shm.
* the caching allocator without ``expandable_segments`` (its memory cannot be
  exported): the server refuses to start with ``--device cuda:N`` while
  PYTORCH_CUDA_ALLOC_CONF enables it.
* the server outlives the batches the trainer still holds: device memory is
  the server's; a trainer must not touch batches after the server has gone.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from gpufeed.v1 import feed_pb2

__all__ = ["DeviceRing", "check_device", "gpu_uuid"]


def check_device(name: str) -> torch.device:
    """The device batches are assembled on, or ValueError saying why it cannot be used."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r}: {e}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {name!r}: only cpu and cuda:N are supported")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available to this server "
                         f"(torch.cuda.is_available() is False)")
    if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower():
        raise ValueError(f"--device {name}: PYTORCH_CUDA_ALLOC_CONF enables expandable_segments, "
                         f"whose memory cannot be shared over CUDA IPC; unset it for the server")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this server sees {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class DeviceRing:
    """A pinned host ring and its device twin, exported once."""

    def __init__(self, device: torch.device, num_slots: int, slot_bytes: int,
                 observe_copy: Callable[[float], None]):
        self.slot_bytes = slot_bytes
        # Timing events around each slot's copy; read when the slot is next published,
        # by which time the trainer has released it, so the copy is long finished.
        self._timing = [None] * num_slots
        self._observe_copy = observe_copy
        self.host = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, pin_memory=True)
        self.device = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, device=device)
        self._copies = torch.cuda.Stream(device)
        self._ready = [torch.cuda.Event(interprocess=True) for _ in range(num_slots)]
        (_, handle, size, offset, counter_handle, counter_offset, event_handle,
         event_sync) = self.device.untyped_storage()._share_cuda_()
        self.export = feed_pb2.CudaIpc(
            gpu_uuid=gpu_uuid(device), storage_handle=handle, storage_size=size,
            storage_offset=offset, ref_counter_handle=counter_handle,
            ref_counter_offset=counter_offset, event_handle=event_handle,
            event_sync_required=event_sync,
            slot_events=[event.ipc_handle() for event in self._ready])

    def host_buffer(self):
        """The host ring as a buffer the slot ring and decode threads write into."""
        return self.host.numpy()

    def publish(self, batch, plan) -> None:
        """Copy the batch's slot to the device and run the batch pass there, on the side
        stream; the slot's event marks the result ready."""
        start = batch.slot * self.slot_bytes
        if self._timing[batch.slot] is not None:
            began, ended = self._timing[batch.slot]
            self._observe_copy(began.elapsed_time(ended) / 1000)
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._timing[batch.slot] = began, ended
        with torch.cuda.stream(self._copies):
            slot = self.device[start:start + self.slot_bytes]
            began.record(self._copies)
            slot.copy_(self.host[start:start + self.slot_bytes], non_blocking=True)
            ended.record(self._copies)
            if plan.transform is not None:
                arrays = plan.layout.views(slot)
                rows = batch.rows
                plan.transform.finish_batch(arrays.get("decoded", arrays["image"])[:rows],
                                            arrays["flip"][:rows], arrays["image"][:rows])
            self._ready[batch.slot].record(self._copies)
