"""Which memory a stream's slots get: one ``SlotMemory`` backend per transport.

The only place on the server that maps a transport to its memory: the
servicer asks ``SlotMemories`` what it offers and for a stream's memory, and
from then on holds the ``SlotMemory`` (slots.py) without asking which it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import NO_SLOT_MEMORY

from .budget import MemoryExhausted
from .heap import HeapSlots
from .shm import ShmNamespace, ShmSlots
from .slots import SlotMemory, SlotPlan

__all__ = ["SlotMemories"]

_log = logging.getLogger(__name__)


class SlotMemories:
    """The memories this server can give a stream, one kind per offered transport.

    inline always; shm when /dev/shm held the probe segment at start-up; cuda_ipc
    when the server has a ``device``. ``observe_copy`` records a host-to-device
    copy's seconds (cuda_ipc).
    """

    def __init__(self, shm: ShmNamespace, device: torch.device | None,
                 observe_copy: Callable[[float], None]):
        self._shm = shm
        self._device = device
        self._observe_copy = observe_copy
        transports = [feed_pb2.TRANSPORT_INLINE]
        if shm.probe is not None:  # else /dev/shm was full or missing at start-up
            transports.append(feed_pb2.TRANSPORT_SHM)
        self.gpu_uuid = ""
        if device is not None:
            from .cuda_ipc import gpu_uuid

            transports.append(feed_pb2.TRANSPORT_CUDA_IPC)
            self.gpu_uuid = gpu_uuid(device)
        self.transports: tuple[feed_pb2.Transport, ...] = tuple(transports)

    def shm_probe(self) -> feed_pb2.ShmProbe | None:
        """Info's proof of a shared /dev/shm (the client's ``auto`` reads it)."""
        probe = self._shm.probe
        return None if probe is None else feed_pb2.ShmProbe(name=probe.name,
                                                            token=self._shm.probe_token)

    def lane_name(self) -> str | None:
        """A name under /dev/shm for a stream's lane, or None when there is no /dev/shm."""
        return None if self._shm.probe is None else self._shm.new_name()

    def open(self, plan: SlotPlan) -> SlotMemory:
        """The memory of the plan's transport for its ``num_slots`` slots.

        Raises MemoryExhausted when there is none (ENOSPC in /dev/shm, CUDA out
        of memory); its message begins with the vocabulary's ``NO_SLOT_MEMORY``,
        which the client's ``auto`` transport takes as its cue to fall back to inline.
        """
        try:
            if plan.transport == feed_pb2.TRANSPORT_SHM:
                return ShmSlots(self._shm, plan)
            if plan.transport == feed_pb2.TRANSPORT_CUDA_IPC:
                from .cuda_ipc import DeviceSlots

                assert self._device is not None  # offered only with a device
                return DeviceSlots(self._device, plan, self._observe_copy)
            return HeapSlots(plan)
        except (MemoryError, OSError, RuntimeError) as e:
            _log.warning("no memory for a %s stream's %d slots of %d bytes: %s",
                         feed_pb2.Transport.Name(plan.transport), plan.num_slots,
                         plan.layout.slot_bytes, e)
            raise MemoryExhausted(f"{NO_SLOT_MEMORY} {plan.num_slots} slots of "
                                  f"{plan.layout.slot_bytes} bytes: {e}; ask for a smaller "
                                  f"prefetch or batch") from None
