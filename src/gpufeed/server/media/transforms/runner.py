"""A stream's sample transforms (registry.py): checked at open, run per sample.

They run on the decode thread that decoded the sample, right after the decode
wrote its row (crop, scale and flip done) and before the batch pass
(normalisation, dtype, layout), on the row itself: ``image`` is a uint8
[3, H, W] view of the batch, and the stream's fields (``mask``, ``boxes``,
``meta``: media/fields.py's ``row_sample``) are views of theirs, already cropped and
flipped with the image. A transform's generator is seeded by (seed, epoch,
sample index, 100 + its place in the request's list), so its draws never
shift the crop's or flip's, nor another transform's, and do not depend on
threads, timing or where a pass resumed.

A transform registered with ``holds_gil=True`` runs in a small pool of worker
processes instead (one per decode thread, started at its first use): the
decode thread sends the sample's arrays and the transform's name and JSON
parameters (never code: the worker imports the same plugin modules and builds
the transform itself), waits without the GIL, and writes the result back.

A transform that raises fails its sample alone; the reason names the
transform.

A request names at most ``MAX_TRANSFORMS`` transforms, each made at open and
kept while its stream is; a worker process keeps the last ``MAX_TRANSFORMS``
it made. Each factory's own allocations being small (builtins.py bounds the
built-ins' parameters so), what a request's transforms hold stays small, and
is given back when its stream ends.
"""

from __future__ import annotations

import functools
import multiprocessing
import threading
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np
import torch

from ..draws import sample_rng
from ..fields import row_sample
from . import registry

__all__ = ["MAX_TRANSFORMS", "SampleTransforms", "TransformFailed", "set_process_count",
           "shutdown_processes"]

# sample_rng's decision number of the i-th transform: 100 + i (crop, flip, clip are 0-2).
_FIRST_DECISION = 100
# Transforms in one request: several times any augmentation pipeline's length.
MAX_TRANSFORMS = 64


class TransformFailed(Exception):
    """A sample transform raised; the message names the transform."""


@dataclass(frozen=True)
class _Step:
    name: str
    params_json: str
    fn: registry.SampleFn
    holds_gil: bool


class SampleTransforms:
    """The request's transforms, each made once from its parameters, in order."""

    def __init__(self, steps: list[_Step], seed: int, epoch: int):
        self._steps = steps
        self._seed, self._epoch = seed, epoch

    @classmethod
    def from_request(cls, specs: Iterable, seed: int, epoch: int,
                     fields: Iterable[str] = ()) -> SampleTransforms | None:
        """The transforms ``specs`` (SampleTransform messages) name; None for none.
        ValueError naming ``sample_transforms[i]`` and the transform when one is unknown,
        its parameters are not what it takes, or it moves the image alone while the
        request's ``fields`` include a mask or boxes (they would no longer match);
        naming ``sample_transforms`` when there are more than ``MAX_TRANSFORMS``."""
        specs = list(specs)
        if len(specs) > MAX_TRANSFORMS:
            raise ValueError(f"sample_transforms: {len(specs)} transforms, over the "
                             f"{MAX_TRANSFORMS} a request may name")
        steps = []
        moved_with_image = sorted({"mask", "boxes"} & set(fields))
        for i, spec in enumerate(specs):
            try:
                found = registry.lookup(spec.name)
                fn = found.make(registry.parse_params(spec.name, spec.params_json))
            except registry.TransformError as e:
                raise ValueError(f"sample_transforms[{i}]: {e}") from None
            if found.moves_image and moved_with_image:
                raise ValueError(f"sample_transforms[{i}]: {spec.name!r} moves the image's "
                                 f"pixels but not the fields {', '.join(moved_with_image)}, "
                                 f"which would no longer match the image; leave it out of "
                                 f"this request (photometric transforms such as "
                                 f"color_jitter keep them matching)")
            steps.append(_Step(spec.name, spec.params_json, fn, found.holds_gil))
        return cls(steps, seed, epoch) if steps else None

    def apply(self, arrays: dict[str, np.ndarray], row: int, index: int) -> None:
        """Run every transform on row ``row`` (sample ``index``) of a batch's arrays."""
        fields = row_sample(arrays, row)
        for i, step in enumerate(self._steps):
            key = (self._seed, self._epoch, index, _FIRST_DECISION + i)
            try:
                if step.holds_gil:
                    result = _processes.run(step.name, step.params_json, key, fields)
                else:
                    result = step.fn(dict(fields), sample_rng(*key))
                _write_back(fields, result)
            except Exception as e:
                raise TransformFailed(f"transform {step.name!r} failed: {type(e).__name__}: "
                                      f"{e}") from e


def _write_back(fields: dict[str, np.ndarray], result: object) -> None:
    """Copy what a transform returned into the sample's rows (nothing if it worked in place);
    ValueError if it changed a field's shape or dtype."""
    if not isinstance(result, dict):
        raise TypeError(f"returned {type(result).__name__}, not the sample's dict of arrays")
    for key, row in fields.items():
        value = result.get(key, row)
        if value is row:
            continue
        if isinstance(value, torch.Tensor):
            value = value.numpy(force=True)
        value = np.asarray(value)
        if value.shape != row.shape or value.dtype != row.dtype:
            raise ValueError(f"returned {key!r} as {value.dtype} {list(value.shape)}; "
                             f"the sample's is {row.dtype} {list(row.shape)}")
        if value.ctypes.data != row.ctypes.data or value.strides != row.strides:
            np.copyto(row, value)  # numpy copies through a buffer when the two overlap


class _Processes:
    """The worker processes of GIL-holding transforms, started at first use.

    spawn, not fork: the server's threads (gRPC's among them) must not be
    copied mid-flight into a child.
    """

    def __init__(self) -> None:
        self.workers = 1
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None

    def run(self, name: str, params_json: str, key: tuple, fields: dict) -> dict:
        pool = self._started()
        try:
            return pool.submit(_run_in_worker, name, params_json, key, fields).result()
        except BrokenProcessPool:  # a worker died (killed, crashed): the next sample starts anew
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise

    def _started(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_worker, initargs=(registry.loaded_modules(),))
            return self._pool

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


_processes = _Processes()


def set_process_count(workers: int) -> None:
    """How many worker processes GIL-holding transforms get (the server: its decode threads)."""
    _processes.workers = max(1, workers)


def shutdown_processes() -> None:
    """Stop the worker processes, if any were started (the server, as it stops)."""
    _processes.shutdown()


def _start_worker(modules: tuple[str, ...]) -> None:
    """A worker process's start: the server's transform modules, and torch on one thread
    (the workers are the parallelism; idle intra-op threads would spin on the cores)."""
    torch.set_num_threads(1)
    registry.load(modules)


@functools.lru_cache(maxsize=MAX_TRANSFORMS)
def _made(name: str, params_json: str) -> registry.SampleFn:
    """In a worker process: the transform ``name`` made from its JSON parameters, the last
    ``MAX_TRANSFORMS`` kept (streams come and go; their transforms should too)."""
    return registry.lookup(name).make(registry.parse_params(name, params_json))


def _run_in_worker(name: str, params_json: str, key: tuple, fields: dict) -> dict:
    """In a worker process: the transform ``name`` made from its JSON parameters (once),
    run on ``fields`` with the sample's generator."""
    result = _made(name, params_json)(fields, sample_rng(*key))
    if isinstance(result, dict):  # tensors travel back as arrays
        result = {k: v.numpy(force=True) if isinstance(v, torch.Tensor) else v
                  for k, v in result.items()}
    return result
