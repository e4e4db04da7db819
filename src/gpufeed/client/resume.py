"""Where a loader is in its epochs: what ``state_dict()`` holds, and how a loader at any
world size goes on from it.

A state is ``{"epoch", "samples_consumed", "world_size", "resumed_from",
"fingerprint"}``: the epoch; the samples each rank has consumed of it, at
``world_size`` ranks; and, when that epoch was itself resumed at another world
size, its earlier *phases*, ``[world_size, batches]`` pairs, first to last (what
a phase is, and which samples the next one gets, is the server's rule:
src/gpufeed/server/serving/planning/order.py). Synchronous data-parallel ranks consume as many
batches each, so any rank's state stands for every rank's, and every rank of a
restarted job may load the same one (torchrun's elastic restarts hand every
rank the same checkpoint).

A loader at the state's world size continues its phase at that batch. A loader
at another closes the phase (``batches`` each) and asks for the samples no phase
delivered, dealt over its own ranks: a new phase, from its start. A phase in
which nothing was consumed is left out: after another phase it changes nothing
(the server's serving/planning/order.py), and as the epoch's first, leaving it
out gives the new world size's own order, as a fresh run has.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

__all__ = ["Position"]


@dataclass(frozen=True)
class Position:
    """An epoch, the batches each rank has consumed of its current phase, that phase's
    world size, and the epoch's earlier phases as (world_size, batches)."""

    epoch: int
    batches: int
    world_size: int
    resumed_from: tuple[tuple[int, int], ...] = ()

    def state(self, batch_size: int, fingerprint: dict) -> dict:
        """The position as ``state_dict()`` gives it: plain values, for any checkpoint."""
        return {"epoch": self.epoch, "samples_consumed": self.batches * batch_size,
                "world_size": self.world_size,
                "resumed_from": [[size, batches] for size, batches in self.resumed_from],
                "fingerprint": dict(fingerprint)}

    @classmethod
    def from_state(cls, state: dict, batch_size: int) -> Position:
        """The position a state names; ValueError naming the key that makes no sense.

        A state saved before elastic resume has neither ``world_size`` nor
        ``resumed_from``: its world size is its fingerprint's.
        """
        epoch = _whole(state, "epoch")
        samples = _whole(state, "samples_consumed")
        if samples % batch_size:
            raise ValueError(f"load_state_dict: samples_consumed must be a multiple of "
                             f"batch_size {batch_size}, got {samples}")
        legacy = state.get("fingerprint", {}).get("world_size", 1)
        world_size = _whole(state, "world_size", legacy, least=1)
        phases = state.get("resumed_from", [])
        if not isinstance(phases, (list, tuple)) or not all(
                isinstance(phase, (list, tuple)) and len(phase) == 2 for phase in phases):
            raise ValueError(f"load_state_dict: resumed_from must be a list of "
                             f"[world_size, batches] pairs, got {phases!r}")
        resumed = tuple((_whole({"world_size": size}, "world_size", least=1, at="resumed_from"),
                         _whole({"batches": batches}, "batches", at="resumed_from"))
                        for size, batches in phases)
        return cls(epoch, samples // batch_size, world_size, resumed)

    def at(self, world_size: int) -> Position:
        """The same place in the epoch, for a loader of ``world_size`` ranks."""
        if world_size == self.world_size:
            return self
        closed = ((self.world_size, self.batches),) if self.batches else ()
        return Position(self.epoch, 0, world_size, self.resumed_from + closed)


def _whole(state: dict, key: str, default: object = None, *, least: int = 0,
           at: str = "") -> int:
    """``state[key]``, an int of at least ``least``; ValueError naming the key if not."""
    value = state.get(key, default)
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # int, numpy ints
    except TypeError:
        number = None
    if number is None or number < least:
        raise ValueError(f"load_state_dict: {at + '[...].' if at else ''}{key} must be an int "
                         f">= {least}, got {value!r}")
    return number
