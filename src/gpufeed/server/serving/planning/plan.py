"""Turn a StreamRequest into a StreamPlan, or refuse it with a status a person can act on.

Every check names the request field at fault (checks.py). Nothing here decodes
or reads sample files (a missing or corrupt sample fails only that sample,
later); what planning reads (a list file, directories, tar shards) is
located.py's, and the batch's arrays are layout.py's. This module puts them
together in order and keeps the result.

A list file, or a directory named alone, is shared by every stream of the
server that names it (lists.py): the plan holds it until the stream ends
(``StreamPlan.release``).

A plan is kept compact (names packed, batches as views of one order array, see
names.py and order.py): its size, ``StreamPlan.nbytes``, counts against the
server's memory budget with the stream's ring; a shared list counts there once,
not in each plan.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gpufeed.v1 import feed_pb2

from ...config import Limits
from ...media.fields import SampleFields
from ...media.output import OutputTransform
from ...media.samples import ARRAYS, IMAGE, ArrayRows, ImageRows, RowReader
from ...media.shard_rows import ShardRows
from ...media.transforms.runner import SampleTransforms
from ...memory.budget import return_free_memory
from ...memory.ring import BatchLayout
from ...storage.paths import SamplePaths
from ...storage.roots import Storage
from ...storage.shards import ShardSet
from ..errors import InvalidRequest
from . import checks
from .batchnames import BatchNames
from .folders import ListedTree
from .layout import array_layout, first_arrays, image_layout, own_arrays, requested_names
from .lists import Hold, ParsedList, SharedLists
from .located import names_kind, sample_files, sample_labels, sample_names, tar_shards
from .order import Batches, EpochOrder, PhaseOverrun, resumed_order, split_batches

__all__ = ["StreamPlan", "plan_stream"]

# A plan this large gives the allocator's free memory back to the system when it goes.
_TRIM_AFTER_BYTES = 8 << 20


@dataclass
class StreamPlan:
    """Everything a stream needs, checked: located paths, labels, batches, output."""

    paths: SamplePaths
    reader: RowReader
    labels: np.ndarray | None
    classes: list[str]
    batches: Batches
    start_batch: int
    layout: BatchLayout
    transform: OutputTransform | None
    transport: int
    prefetch: int
    max_failures: int
    lease_timeout: float
    # Inline only: the request's compression ("" for none) and its compressor.
    compression: str = ""
    compress: Callable[[list[memoryview]], list[bytes]] | None = None
    # The request's fields beside the image (media/fields.py); None when it declares none.
    fields: SampleFields | None = None
    # The request's sample transforms (media/transforms/registry.py), run on each decoded row.
    sample_transforms: SampleTransforms | None = None
    # Each sample's name in its batch (batchnames.py); None unless the request asks.
    names: BatchNames | None = None
    # The request's resumed_from phases this plan's order applies (order.py): all of them.
    resumed: int = 0
    # The client hands the stream its batches (Deal messages; running/sources.py).
    dealt: bool = False
    # JPEG rows are read by the decode threads and decoded a batch at a time at the
    # batch's end (--decoder nvimgcodec: media/batch_jpeg.py).
    defers: bool = False
    # The lists it reads (lists.py: its names, labels), held until ``release``.
    held: list[Hold] = field(default_factory=list)

    @property
    def num_slots(self) -> int:
        """Slots in the stream's ring: ``prefetch`` ahead of the batch the trainer holds."""
        return self.prefetch + 1

    @property
    def num_samples(self) -> int:
        return self.batches.samples_from(self.start_batch)

    @property
    def nbytes(self) -> int:
        """What the plan keeps in memory of its own: its sample order, and the packed names
        and labels unless a shared list holds them (that counts them once, lists.py)."""
        shared = {id(part) for hold in self.held if hold.shared
                  for part in _parts(hold.value)}
        names = getattr(self.paths, "names", self.paths)  # LocatedPaths: its packed names
        own = self.batches.order.nbytes
        if id(names) not in shared:
            own += self.paths.nbytes
        if self.labels is not None and id(self.labels) not in shared:
            own += self.labels.nbytes
        return own

    def release(self) -> None:
        """Let go of the shared lists the plan holds (the stream has ended); more calls do
        nothing."""
        for hold in self.held:
            hold.release()


def _parts(value: ParsedList | ListedTree) -> tuple:
    """A shared list's arrays a plan may hold: a list file's names and labels, a tree's paths."""
    return (value.names, value.labels) if isinstance(value, ParsedList) else (value.paths,)


def plan_stream(req: feed_pb2.StreamRequest, storage: Storage, limits: Limits,
                transports: tuple[int, ...], stopped: Callable[[], bool] = lambda: False,
                *, batch_decode: bool = False, lists: SharedLists | None = None
                ) -> StreamPlan:
    """``req`` checked into a plan, or the refusal (serving/errors.py) naming the field at fault;
    ``PlanStopped`` once ``stopped()`` (the call ended: thread.py) while a list file
    is read, a directory listed or tar shards indexed. ``batch_decode``: the server
    decodes JPEGs a batch at a time (``--decoder nvimgcodec``), which a plan of loose
    images without fields or sample transforms (they need each row's pixels as it is
    read) does.

    In order: the sample names (files, list file, directories; bounded by the
    limits before they are built); tar shards, indexed, or loose files, located
    under the roots, with their labels and kind; the batch's geometry, fields,
    transforms and layout; prefetch and the batch's size against the limits; the
    transport and compression; the sample order and the batches this stream
    serves. The plan's memory is reserved by the servicer afterwards, once its
    size is known, so that a refused request reserves nothing. With ``lists``, a
    list file or a directory named alone is the server's shared one, held by the
    plan (``StreamPlan.release``); a refusal lets go of it at once.
    """
    held: list[Hold] = []
    try:
        plan = _plan(req, storage, limits, transports, stopped, batch_decode, lists, held)
    except BaseException:
        for hold in held:
            hold.release()
        raise
    if plan.nbytes >= _TRIM_AFTER_BYTES:
        weakref.finalize(plan, return_free_memory)
    if len(plan.paths) * 8 >= _TRIM_AFTER_BYTES:
        return_free_memory()  # planning's working arrays over the whole list, freed now
    if held:  # a plan dropped without release (not the servicer's) lets go when collected
        weakref.finalize(plan, _release_all, tuple(held))
    return plan


def _release_all(held: tuple[Hold, ...]) -> None:
    for hold in held:
        hold.release()


def _plan(req: feed_pb2.StreamRequest, storage: Storage, limits: Limits,
          transports: tuple[int, ...], stopped: Callable[[], bool], batch_decode: bool,
          lists: SharedLists | None, held: list[Hold]) -> StreamPlan:
    names, listed_labels, prefix = sample_names(req, storage, limits, stopped, lists, held)
    if not names:
        raise InvalidRequest("samples: the list is empty")
    shards = tar_shards(req, names, prefix, storage, limits, stopped)  # storage/shards.py, or None
    if shards:
        paths, labels, classes, kind = None, None, [], IMAGE
    else:
        samples = sample_files(names, prefix, storage, limits.max_samples, stopped, lists,
                               held)
        names, paths = samples.names, samples.paths
        labels, classes = sample_labels(req, samples, listed_labels, storage)
        try:
            kind = names_kind(names)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    world_size = checks.world_size(req)
    # Every split over ranks carries `padded` (order.py), so a trainer's keys do
    # not depend on whether world_size happens to divide the data set.
    extra = own_arrays(labels is not None or bool(shards and shards.has_labels),
                       padded=world_size > 1)
    fields = checks.sample_fields(req, kind, bool(shards))
    if kind == ARRAYS:
        assert paths is not None, "array files are sample files, never shards"
        transform = None
        reader = ArrayRows(first_arrays(paths[0], names[0], storage))
        batch_names = requested_names(req, storage, paths, reader, prefix)
        layout = array_layout(req.batch_size, reader, extra, batch_names)
    else:
        transform, reader = checks.pixels(req, kind, fields)
        if shards:
            reader = ShardRows(transform, shards, fields)
            paths = reader.paths
        batch_names = requested_names(req, storage, paths, reader, prefix)
        layout = image_layout(req.batch_size, transform, extra, fields, batch_names)
    sample_transforms = checks.sample_transforms(req, kind, fields)

    prefetch = checks.prefetch(req, limits)
    checks.check_batch_bytes(req.batch_size, layout, fields, limits)
    transport = checks.transport(req, transports)
    compression, compress = checks.compression(req.compression, transport)
    if shards and len(shards.paths) < world_size:
        raise InvalidRequest(f"world_size: {world_size} ranks but {len(shards.paths)} tar shards; "
                             f"each rank reads whole shards")
    order, resumed = _order(req, world_size, shards, len(names))
    whole = split_batches(order, req.batch_size, req.drop_last)
    dealt = checks.dealt(req)
    batches = whole
    assert paths is not None  # the shards' reader made them above
    plan = StreamPlan(paths=paths, reader=reader, labels=labels, classes=classes,
                      batches=batches,
                      start_batch=checks.start_batch(req, len(batches)), layout=layout,
                      transform=transform,
                      transport=transport,
                      prefetch=prefetch,
                      max_failures=checks.failure_budget(req, batches.samples_from(0), limits),
                      lease_timeout=limits.lease_timeout, compression=compression,
                      compress=compress, fields=fields, sample_transforms=sample_transforms,
                      names=batch_names, resumed=resumed, dealt=dealt,
                      defers=batch_decode and type(reader) is ImageRows and fields is None
                      and sample_transforms is None, held=held)
    if isinstance(reader, ShardRows):  # S3 chunks run over the samples the stream reads
        served = [batches[k] for k in range(plan.start_batch, len(batches))]
        reader.will_read(np.concatenate(served) if served else order[:0])
    return plan


def _order(req: feed_pb2.StreamRequest, world_size: int, shards: ShardSet | None,
           num_files: int) -> tuple[np.ndarray, int]:
    """The stream's sample order (order.py) and how many resumed phases it applies:
    the epoch's own, or, when the request resumes an epoch begun at other world
    sizes (``resumed_from``), the samples its earlier phases had not delivered."""
    phases = checks.resumed_from(req, world_size, shards)
    epoch = EpochOrder(int(shards.first[-1]) if shards else num_files,
                       shards.first if shards else None, req.shuffle, req.seed, req.epoch)
    try:
        order = resumed_order(epoch, phases, rank=req.rank, world_size=world_size,
                              batch_size=req.batch_size, drop_last=req.drop_last)
    except PhaseOverrun as e:
        raise InvalidRequest(f"resumed_from[{e.index}].batches: {e.batches} batches, but each "
                             f"rank of that phase had {e.available}") from None
    return order, len(phases)
