"""CUDA IPC, the server's side: the only module of the server that touches CUDA.

A cuda_ipc stream keeps two rings with the same slots: the host ring (pinned
memory) that decode threads write, and one device allocation exported once to
the trainer. When a batch is complete, ``publish`` copies its slot host->device
on a side stream (all but the pixels of a batch that a GPU decoder wrote
straight into the device slot, ``device_views``) and records the slot's
interprocess event; the trainer's stream waits on that event before it
reads. The trainer releases a slot only after the kernels that read it have
finished (the client records an event on its own stream and waits for it
before sending the Release), so the ring's ordinary leases also protect the
device memory and the host slot under a copy.

What it needs, and what goes wrong otherwise:

* both processes see the same GPU: matched by UUID, not ordinal. A trainer
  without it gets shm or inline from ``auto``, and a refusal naming the UUID if
  it asks for cuda_ipc.
* shared IPC and PID namespaces between containers (``ipc: host``, ``pid:
  host`` or a shared pid namespace): otherwise opening the handle fails in the
  trainer with "cudaIpcOpenMemHandle ... invalid argument" (or "invalid device
  context"), surfaced as a FeedError naming cuda_ipc; ``auto`` never picks
  cuda_ipc unless the shared-memory probe shows the two share /dev/shm.
* torch's native caching allocator without ``expandable_segments`` (neither
  that nor the ``cudaMallocAsync`` backend can export its memory): the server
  refuses to start with ``--device cuda:N`` while PYTORCH_ALLOC_CONF (or the
  older PYTORCH_CUDA_ALLOC_CONF) asks for either, naming the setting.
* the same user for both: torch's reference counter for the exported memory
  is a 0600 file in /dev/shm. A trainer that cannot open it fails to open the
  stream (FeedError naming cuda_ipc).
* the server outlives the batches the trainer still holds: device memory is
  the server's; a trainer must not touch batches after the server has gone.

Lifetime: exporting sets torch's counter for the ring to one; the trainer's
opened storage owns that count and gives it back when it is freed (after its
last batch is dropped). A ring the server frees before then waits in torch's
"limbo" until the count is zero. A trainer that never opened the ring (it
failed, or left first) never says ``attached``; the server then gives the
count back itself, so the ring is freed. A trainer killed while holding the
ring leaves its count behind: that ring stays allocated until the server
restarts.

``DeviceSlots`` is the cuda_ipc transport's slot memory: the ring behind the
protocol every transport's memory keeps (slots.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from gpufeed.v1 import feed_pb2

from .slots import FilledBatch, SlotPlan, batch_fields

__all__ = ["DeviceRing", "DeviceSlots", "check_device", "gpu_uuid"]


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
    unshareable = _unshareable_allocator_settings()
    if unshareable:
        settings = "; ".join(f"{variable} sets {setting}" for variable, setting in unshareable)
        raise ValueError(f"--device {name}: {settings}, whose memory cannot be shared over "
                         f"CUDA IPC; unset it for the server")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available to this server "
                         f"(torch.cuda.is_available() is False)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this server sees {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def _unshareable_allocator_settings() -> list[tuple[str, str]]:
    """(variable, "key:value") of each allocator setting whose memory CUDA IPC cannot export."""
    found = []
    for variable in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        for option in os.environ.get(variable, "").split(","):
            key, _, value = (part.strip() for part in option.partition(":"))
            if (key, value.lower()) in (("expandable_segments", "true"),
                                        ("backend", "cudamallocasync")):
                found.append((variable, f"{key}:{value}"))
    return found


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class DeviceRing:
    """A pinned host ring and its device twin, exported once.

    Only the spans the host writes (decoded pixels, index, label, flip) are
    copied: a float output region is written on the device by the batch pass,
    and copying it too would move 5x the bytes of the uint8 it comes from.
    """

    def __init__(self, device: torch.device, plan, observe_copy: Callable[[float], None]):
        slots_bytes = plan.num_slots * plan.layout.slot_bytes
        self._device = device
        self.slot_bytes = plan.layout.slot_bytes
        # The spans copied: as the host writes them, and for a batch whose pixels a GPU
        # decoder wrote in the device slot.
        self._spans = {pixels_on_device: _host_written_spans(plan.layout, pixels_on_device)
                       for pixels_on_device in (False, True)}
        # Timing events around each slot's copy; read when the slot is next published,
        # by which time the trainer has released it, so the copy is long finished.
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event] | None] | None = \
            [None] * plan.num_slots
        self._observe_copy = observe_copy
        # Events are created on the current device: make it the ring's (cuda:N, not 0).
        with torch.cuda.device(device):
            # None once closed (close), so that the memory goes with the stream.
            self.host: torch.Tensor | None = torch.empty(slots_bytes, dtype=torch.uint8,
                                                         pin_memory=True)
            self.device: torch.Tensor | None = torch.empty(slots_bytes, dtype=torch.uint8,
                                                           device=device)
            self._copies = torch.cuda.Stream(device)
            # Freed at the stream's end: not reused before the copies queued on it finish.
            self.device.record_stream(self._copies)
            self._ready: list[torch.cuda.Event] | None = [
                torch.cuda.Event(interprocess=True) for _ in range(plan.num_slots)]
            slot_events = [event.ipc_handle() for event in self._ready]
            (_, handle, size, offset, counter_handle, counter_offset, event_handle,
             event_sync) = self.device.untyped_storage()._share_cuda_()
        self.export = feed_pb2.CudaIpc(
            gpu_uuid=gpu_uuid(device), storage_handle=handle, storage_size=size,
            storage_offset=offset, ref_counter_handle=counter_handle,
            ref_counter_offset=counter_offset, event_handle=event_handle,
            event_sync_required=event_sync, slot_events=slot_events)

    def host_buffer(self):
        """The host ring as a buffer the slot ring and decode threads write into."""
        return self._live()[0].numpy()

    def device_slot(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s bytes in the device ring."""
        start = slot * self.slot_bytes
        return self._live()[1][start:start + self.slot_bytes]

    def publish(self, batch, plan) -> None:
        """Copy the batch's slot to the device and run the batch pass there, on the side
        stream; the slot's event marks the result ready."""
        host, device, ready, timing = self._live()
        start = batch.slot * self.slot_bytes
        last = timing[batch.slot]
        if last is not None:
            began, ended = last
            if ended.query():  # elapsed_time raises otherwise (a client that released early)
                self._observe_copy(began.elapsed_time(ended) / 1000)
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timing[batch.slot] = began, ended
        # The device first: leaving a stream context alone would make device 0 current
        # on this gRPC thread, creating a context there when the ring is on cuda:N.
        with torch.cuda.device(self._device), torch.cuda.stream(self._copies):
            slot = device[start:start + self.slot_bytes]
            began.record(self._copies)
            for begin, end in self._spans[batch.pixels_on_device]:
                slot[begin:end].copy_(host[start + begin:start + end], non_blocking=True)
            ended.record(self._copies)
            if plan.transform is not None:
                plan.transform.finish_slot(plan.layout.views(slot), batch.rows)
            ready[batch.slot].record(self._copies)

    def _live(self) -> tuple[torch.Tensor, torch.Tensor, list[torch.cuda.Event],
                             list[tuple[torch.cuda.Event, torch.cuda.Event] | None]]:
        """The ring's memory and events; the stream has not closed it yet."""
        if self.host is None or self.device is None or self._ready is None \
                or self._timing is None:
            raise RuntimeError("the device ring is used after its stream closed it")
        return self.host, self.device, self._ready, self._timing

    def close(self, opened: bool) -> None:
        """The stream has ended; ``opened``: the trainer said it opened the export."""
        if not opened:  # nobody else will give back the count the export holds
            torch.UntypedStorage._release_ipc_counter_cuda(self.export.ref_counter_handle,
                                                           self.export.ref_counter_offset)
        self.host = self.device = self._ready = self._timing = None
        with torch.cuda.device(self._device):
            torch.cuda.ipc_collect()  # free rings whose trainers have let go since


class DeviceSlots:
    """A stream's slots in a ``DeviceRing`` (a ``SlotMemory``): decode threads write
    the pinned host ring, ``publish`` copies a slot to the device and runs the batch
    pass there."""

    shared = True

    def __init__(self, device: torch.device, plan: SlotPlan,
                 observe_copy: Callable[[float], None]):
        self._plan = plan
        self._ring = DeviceRing(device, plan, observe_copy)
        self._opened = False
        self.host = self._ring.host_buffer()

    def header(self) -> feed_pb2.StreamHeader:
        return feed_pb2.StreamHeader(cuda_ipc=self._ring.export)

    def attached(self) -> None:
        """The trainer has opened the export: its count is the trainer's to give back."""
        self._opened = True

    def filled(self, slot: np.ndarray, rows: int) -> None:
        pass  # the batch pass runs on the device, after the copy (publish)

    def device_views(self, slot: int) -> dict[str, torch.Tensor]:
        return self._plan.layout.views(self._ring.device_slot(slot))

    def publish(self, batch: FilledBatch) -> tuple[feed_pb2.Batch, None]:
        if batch.rows:
            self._ring.publish(batch, self._plan)
        return batch_fields(batch, self._plan.layout), None

    def close(self) -> None:
        self._ring.close(opened=self._opened)
        self.host = np.empty(0, np.uint8)  # the pinned ring goes with the stream


def _host_written_spans(layout, pixels_on_device: bool = False) -> list[tuple[int, int]]:
    """(begin, end) byte ranges of a slot that the host writes, adjacent ones merged;
    ``pixels_on_device``: but not the decoded pixels, written on the device."""
    device_made = {"image"} if layout.pixels == "decoded" else set()
    if pixels_on_device:
        device_made.add(layout.pixels)
    spans: list[tuple[int, int]] = []
    for place, next_offset in zip(layout.places, [p.offset for p in layout.places[1:]]
                                  + [layout.slot_bytes]):
        if place.name in device_made:
            continue
        if spans and spans[-1][1] == place.offset:
            spans[-1] = spans[-1][0], next_offset
        else:
            spans.append((place.offset, next_offset))
    return spans
