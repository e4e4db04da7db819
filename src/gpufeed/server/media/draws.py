"""Seeded draws: every random choice about a sample, keyed by (seed, epoch, index, decision).

The crop box, the flip and a clip's start (output.py, samples.py) draw from
``SampleDraws``; sample transforms (transforms/runner.py) get a numpy Generator
from ``sample_rng``. Both are functions of the key alone, so a pass is the same
whatever the thread count, timing or resume position. One module for both, below
the crop and the transforms that use them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CLIP", "CROP", "FLIP", "SampleDraws", "sample_draws", "sample_rng"]

# The built-in decisions about a sample, one generator each, so that one's draws never
# shift another's; sample transforms take 100 and up (transforms/runner.py).
CROP, FLIP, CLIP = 0, 1, 2

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2^64 / the golden ratio, odd


def _mix(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that scatters every bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class SampleDraws:
    """The random draws of one built-in decision about one sample: SplitMix64 from a key.

    The state is a hash of the key (seed, epoch, sample index, decision), so
    draws depend on nothing but the key: not on threads, order or resume. It
    answers the three calls the choices make, as numpy's Generator names them.
    ``np.random.default_rng(key)`` did this before and cost ~25 us per sample
    and decision in the server (a SeedSequence, a PCG64 and an errstate each
    time), ~9% of a random-resized crop's decode thread; this costs ~2 us per
    draw. Sample transforms still get a numpy Generator (``sample_rng``): they
    may ask for any distribution.
    SplitMix64 passes BigCrush; ``integers`` maps 64 random bits onto the range
    by one multiplication, biased by at most range / 2^64.
    """

    __slots__ = ("_state",)

    def __init__(self, *key: int) -> None:
        state = 0
        for part in key:
            state = _mix(((state + _GOLDEN) ^ part) & _MASK)
        self._state = state

    def _next(self) -> int:
        self._state = state = (self._state + _GOLDEN) & _MASK
        return _mix(state)

    def random(self) -> float:
        """A float in [0, 1), 53 random bits."""
        return (self._next() >> 11) * (1.0 / (1 << 53))

    def uniform(self, low: float, high: float) -> float:
        """A float in [low, high)."""
        return low + (high - low) * self.random()

    def integers(self, low: int, high: int) -> int:
        """An int in [low, high)."""
        return low + ((self._next() * (high - low)) >> 64)


def sample_rng(seed: int, epoch: int, index: int, decision: int) -> np.random.Generator:
    """A numpy generator for one random decision about one sample of one epoch: what
    sample transforms (transforms/runner.py) are given."""
    return np.random.default_rng([seed, epoch, index, decision])


def sample_draws(seed: int, epoch: int, index: int, decision: int = CROP) -> SampleDraws:
    """The draws of one built-in decision (crop box, flip, clip start) about one sample."""
    return SampleDraws(seed, epoch, index, decision)
