"""Turn a StreamRequest into a StreamPlan, or refuse it with a status a person can act on.

Every check names the request field at fault. Nothing here decodes or reads
sample files (a missing or corrupt sample fails only that sample, later); only
the list file, when one is named, is read here (at most ``--max-list-bytes``,
and at most ``--max-samples`` of its lines are worked on: listfile.py), and
directories named as samples are listed (folders.py).

A list file, or a directory named alone, is read once for every stream of the
server that names it, and shared (lists.py): the plan holds it until the
stream ends (``StreamPlan.release``). What planning asks of every name (a
sample file? which kind? a tar shard?) is asked once per distinct suffix
(names.py), not once per name.

A plan is kept compact (names packed, batches as views of one order array, see
names.py and order.py): its size, ``StreamPlan.nbytes``, counts against the
server's memory budget with the stream's ring; a shared list counts there once,
not in each plan.
"""

from __future__ import annotations

import os
import posixpath
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import BFLOAT16

from ..config import Limits
from ..media.arrays import read_arrays
from ..media.decode import DecodeError
from ..media.fields import MASK, FieldError, SampleFields
from ..media.output import OutputTransform
from ..media.samples import (
    ARRAYS,
    IMAGE,
    VIDEO,
    ArrayRows,
    ImageRows,
    RowReader,
    VideoRows,
    is_sample_file,
    kind_of,
    sample_kind,
)
from ..media.shard_rows import ShardRows
from ..media.transforms.runner import SampleTransforms
from ..memory.budget import return_free_memory
from ..memory.ring import BatchLayout
from ..storage.paths import FileTooLarge, LocatedPaths, OutsideDataRoots, SamplePaths
from ..storage.roots import Storage, is_s3
from ..storage.shards import (
    TAKEN_SUFFIXES,
    IndexCancelled,
    ShardSet,
    TooManySamples,
    TooManyShards,
    locate_shards,
    names_shards,
)
from .batchnames import BatchNames, name_room
from .errors import Forbidden, InvalidRequest, LimitExceeded, NotFound, Unsupported
from .folders import (
    FolderError,
    ListedNames,
    ListedTree,
    Listing,
    SampleFiles,
    TooManyFiles,
    as_directory,
    below,
    folder_labels,
    list_directory,
    names_a_directory,
)
from .listfile import ListFileError, parse_list
from .lists import Hold, ParsedList, SharedLists
from .names import SampleNames, TooManyNames
from .order import Batches, EpochOrder, PhaseOverrun, resumed_order, split_batches
from .planning import PlanStopped
from .wire import COMPRESSORS

__all__ = ["StreamPlan", "plan_stream"]

_MAX_SIDE = 8192
# Resuming an epoch at another world size (resumed_from): at most this many earlier
# phases, and world sizes up to this (a million ranks).
_MAX_RESUMED = 64
_MAX_WORLD_SIZE = 1 << 20
# Sample names located between two looks at whether the call still wants the plan (an
# S3 name without a suffix costs a LIST to learn whether it is a directory).
_STOP_CHECK_NAMES = 256
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
    # The request's fields beside the image (fields.py); None when it declares none.
    fields: SampleFields | None = None
    # The request's sample transforms (media/transforms/registry.py), run on each decoded row.
    sample_transforms: SampleTransforms | None = None
    # Each sample's name in its batch (batchnames.py); None unless the request asks.
    names: BatchNames | None = None
    # The request's resumed_from phases this plan's order applies (order.py): all of them.
    resumed: int = 0
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
    """``req`` checked into a plan, or the refusal (errors.py) naming the field at fault;
    ``PlanStopped`` once ``stopped()`` (the call ended: planning.py) while a list file
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
    names, listed_labels, prefix = _sample_names(req, storage, limits, stopped, lists, held)
    if not names:
        raise InvalidRequest("samples: the list is empty")
    shards = _tar_shards(req, names, prefix, storage, limits, stopped)  # shards.py, or None
    if shards:
        paths, labels, classes, kind = None, None, [], IMAGE
    else:
        samples = _sample_files(names, prefix, storage, limits.max_samples, stopped, lists,
                                held)
        names, paths = samples.names, samples.paths
        labels, classes = _labels(req, samples, listed_labels, storage)
        try:
            kind = _sample_kind(names)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    if req.batch_size <= 0:
        raise InvalidRequest(f"batch_size must be positive, got {req.batch_size}")
    world_size = req.world_size or 1
    if world_size < 0:
        raise InvalidRequest(f"world_size must be positive, got {world_size}")
    if not 0 <= req.rank < world_size:
        raise InvalidRequest(f"rank must be in [0, world_size={world_size}), got {req.rank}")
    # Every split over ranks carries `padded` (order.py), so a trainer's keys do
    # not depend on whether world_size happens to divide the data set.
    extra = _own_arrays(labels is not None or bool(shards and shards.has_labels),
                        padded=world_size > 1)
    fields = _fields(req, kind, bool(shards))
    if kind == ARRAYS:
        transform = None
        reader = ArrayRows(_first_arrays(paths[0], names[0], storage))
        batch_names = _batch_names(req, storage, paths, reader, prefix)
        layout = _array_layout(req.batch_size, reader, extra, batch_names)
    else:
        transform, reader = _pixels(req, kind, fields)
        if shards:
            reader = ShardRows(transform, shards, fields)
            paths = reader.paths
        batch_names = _batch_names(req, storage, paths, reader, prefix)
        layout = _image_layout(req.batch_size, transform, extra, fields, batch_names)
    sample_transforms = _sample_transforms(req, kind, fields)

    prefetch = req.prefetch or limits.default_prefetch
    if not 0 < prefetch <= limits.max_prefetch:
        raise InvalidRequest(f"prefetch must be in 1..{limits.max_prefetch} (the server's "
                             f"--max-prefetch), got {prefetch}")
    if layout.slot_bytes > limits.max_batch_bytes and fields is not None:
        _check_field_bytes(req.batch_size, fields, layout.slot_bytes, limits.max_batch_bytes)
    if layout.slot_bytes > limits.max_batch_bytes:
        raise LimitExceeded(f"batch_size x output: a batch takes {layout.slot_bytes} bytes, over "
                            f"the server's --max-batch-bytes of {limits.max_batch_bytes}")

    transport = req.transport
    if transport == feed_pb2.TRANSPORT_AUTO:
        transport = feed_pb2.TRANSPORT_INLINE  # a client that did not probe /dev/shm
    if transport not in transports:
        name = feed_pb2.Transport.Name(transport) if transport in feed_pb2.Transport.values() \
            else str(transport)
        offered = ", ".join(feed_pb2.Transport.Name(t) for t in transports)
        raise InvalidRequest(f"transport: {name} is not offered by this server (offered: "
                             f"{offered})")

    compression, compress = _compression(req.compression, transport)
    if shards and len(shards.paths) < world_size:
        raise InvalidRequest(f"world_size: {world_size} ranks but {len(shards.paths)} tar shards; "
                             f"each rank reads whole shards")
    order, resumed = _order(req, world_size, shards, len(names))
    whole = split_batches(order, req.batch_size, req.drop_last)
    batches = _served_batches(req, whole)
    assert paths is not None  # the shards' reader made them above
    plan = StreamPlan(paths=paths, reader=reader, labels=labels, classes=classes,
                      batches=batches,
                      start_batch=_start_batch(req, len(whole), len(batches)), layout=layout,
                      transform=transform,
                      transport=transport,
                      prefetch=prefetch,
                      max_failures=_failure_budget(req, batches.samples_from(0), limits),
                      lease_timeout=limits.lease_timeout, compression=compression,
                      compress=compress, fields=fields, sample_transforms=sample_transforms,
                      names=batch_names, resumed=resumed,
                      defers=batch_decode and type(reader) is ImageRows and fields is None
                      and sample_transforms is None, held=held)
    if isinstance(reader, ShardRows):  # S3 chunks run over the samples the stream reads
        served = [batches[k] for k in range(plan.start_batch, len(batches))]
        reader.will_read(np.concatenate(served) if served else order[:0])
    return plan


def _compression(name: str, transport: int) -> tuple[str, Callable | None]:
    """The compression an inline stream asked for, and its compressor; none for zero-copy."""
    if name and name not in COMPRESSORS:
        raise InvalidRequest(f"compression: {name!r} is not one of "
                             f"{', '.join(sorted(COMPRESSORS))} (or empty for none)")
    if not name or transport != feed_pb2.TRANSPORT_INLINE:
        return "", None
    try:
        return name, COMPRESSORS[name]()
    except ImportError as e:
        raise Unsupported(f"compression: {name} needs {e.name} on the server "
                          f"(pip install 'gpufeed[compression]')") from None


def _order(req: feed_pb2.StreamRequest, world_size: int, shards: ShardSet | None,
           num_files: int) -> tuple[np.ndarray, int]:
    """The stream's sample order (order.py) and how many resumed phases it applies:
    the epoch's own, or, when the request resumes an epoch begun at other world
    sizes (``resumed_from``), the samples its earlier phases had not delivered."""
    phases = _resumed_from(req, world_size, shards)
    epoch = EpochOrder(int(shards.first[-1]) if shards else num_files,
                       shards.first if shards else None, req.shuffle, req.seed, req.epoch)
    try:
        order = resumed_order(epoch, phases, rank=req.rank, world_size=world_size,
                              batch_size=req.batch_size, drop_last=req.drop_last)
    except PhaseOverrun as e:
        raise InvalidRequest(f"resumed_from[{e.index}].batches: {e.batches} batches, but each "
                             f"rank of that phase had {e.available}") from None
    return order, len(phases)


def _resumed_from(req: feed_pb2.StreamRequest, world_size: int, shards: ShardSet | None
                  ) -> list[tuple[int, int]]:
    """The request's resumed phases as (world_size, batches), each checked.

    Planning them deals every sample once per phase (order.py), so their number
    and the world sizes are bounded: a request cannot make a plan cost more than
    ``_MAX_RESUMED`` passes over the list, or a padding of more than
    ``_MAX_WORLD_SIZE`` repeats.
    """
    phases = req.resumed_from
    if not phases:
        return []
    if req.job:
        raise InvalidRequest("resumed_from: a shared job serves the whole pass to whichever "
                             "consumer is free; it has no ranks to resume")
    if len(phases) > _MAX_RESUMED:
        raise InvalidRequest(f"resumed_from: {len(phases)} phases, over the bound of "
                             f"{_MAX_RESUMED}")
    if world_size > _MAX_WORLD_SIZE:
        raise InvalidRequest(f"world_size must be at most {_MAX_WORLD_SIZE} to resume an epoch "
                             f"begun at another world size (resumed_from), got {world_size}")
    for i, phase in enumerate(phases):
        if not 0 < phase.world_size <= _MAX_WORLD_SIZE:
            raise InvalidRequest(f"resumed_from[{i}].world_size must be in "
                                 f"1..{_MAX_WORLD_SIZE}, got {phase.world_size}")
        if phase.batches < 0:
            raise InvalidRequest(f"resumed_from[{i}].batches must be >= 0, got {phase.batches}")
    if shards and phases[0].world_size > len(shards.paths):
        raise InvalidRequest(f"resumed_from[0].world_size: {phases[0].world_size} ranks but "
                             f"{len(shards.paths)} tar shards; each rank read whole shards")
    return [(phase.world_size, phase.batches) for phase in phases]


def _served_batches(req: feed_pb2.StreamRequest, batches: Batches) -> Batches:
    """The pass's batches this stream serves: every ``batch_stride``-th from ``batch_offset``."""
    stride = req.batch_stride or 1
    if stride < 0:
        raise InvalidRequest(f"batch_stride must be >= 0, got {req.batch_stride}")
    if not 0 <= req.batch_offset < stride:
        raise InvalidRequest(f"batch_offset must be in [0, batch_stride={stride}), "
                       f"got {req.batch_offset}")
    if stride > 1 and req.job:
        raise InvalidRequest("batch_stride: a shared job serves the whole pass; give one or the "
                             "other")
    # types: Batches' stub types a slice as an array
    return batches[req.batch_offset::stride]  # pyright: ignore[reportReturnType]


def _start_batch(req: feed_pb2.StreamRequest, in_pass: int, served: int) -> int:
    """The stream's first batch: ``start_batch``, or where ``pass_start_batch`` (a
    position in the whole pass) falls in the part this stream serves."""
    if req.pass_start_batch:
        if req.start_batch:
            raise InvalidRequest("pass_start_batch: give start_batch or pass_start_batch, not both")
        if not 0 <= req.pass_start_batch <= in_pass:
            raise InvalidRequest(f"pass_start_batch must be in 0..{in_pass} (batches in the pass), "
                                 f"got {req.pass_start_batch}")
        # The part's batches are the pass's batch_offset, batch_offset + stride, ...:
        # it starts after those of them that come before the position.
        stride = req.batch_stride or 1
        return min(max(0, -(-(req.pass_start_batch - req.batch_offset) // stride)), served)
    if not 0 <= req.start_batch <= served:
        raise InvalidRequest(f"start_batch must be in 0..{served} (batches in this stream), "
                             f"got {req.start_batch}")
    return req.start_batch


def _failure_budget(req: feed_pb2.StreamRequest, num_samples: int, limits: Limits) -> int:
    if req.max_failures < 0:
        raise InvalidRequest(f"max_failures must be >= 0, got {req.max_failures}")
    if not 0 <= req.max_failure_fraction <= 1:
        raise InvalidRequest("max_failure_fraction must be in [0, 1], got "
                             f"{req.max_failure_fraction}")
    count, fraction = req.max_failures, req.max_failure_fraction
    if count == 0 and fraction == 0:
        count, fraction = limits.default_max_failures, limits.default_max_failure_fraction
    return max(count, int(fraction * num_samples))


def _fields(req: feed_pb2.StreamRequest, kind: str, shards: bool) -> SampleFields | None:
    """The request's fields, checked; None when it declares none."""
    if not req.fields:
        return None
    if kind != IMAGE:
        raise InvalidRequest(f"fields: only image samples take fields; these are "
                             f"{'video clips' if kind == VIDEO else 'array files'}")
    try:
        fields = SampleFields(req.fields, req.output.height, req.output.width)
    except FieldError as e:
        raise InvalidRequest(str(e)) from None
    for name, sidecar in fields.sidecars.items() if shards else ():
        at = fields.declared_at(name)
        if sidecar.tree_from:
            raise InvalidRequest(f"{at}.tree_from: a tar shard's fields are members of its "
                                 "samples; there is no tree to rename")
        if sidecar.suffix[1:].lower() in TAKEN_SUFFIXES:
            raise InvalidRequest(f"{at}.suffix: in a tar shard {sidecar.suffix!r} is an image "
                                 "or label member; name the member's whole extension, such as "
                                 "'.seg.png'")
    return fields


def _check_field_bytes(batch_size: int, fields: SampleFields, slot_bytes: int,
                       limit: int) -> None:
    """Name the field whose room takes most of a batch over --max-batch-bytes."""
    arrays, _, _ = fields.arrays()
    name, dtype, shape = max(arrays, key=lambda a: np.dtype(a[1]).itemsize * int(np.prod(a[2])))
    share = batch_size * np.dtype(dtype).itemsize * int(np.prod(shape))
    at = fields.declared_at(name)
    what = f"{at}.max_items" if name != MASK else f"{at} (the mask, output size)"
    raise InvalidRequest(f"{what}: {name} takes {share} bytes of a batch of {slot_bytes}, over the "
                         f"server's --max-batch-bytes of {limit}; lower it or batch_size")


def _pixels(req: feed_pb2.StreamRequest, kind: str, fields: SampleFields | None = None
            ) -> tuple[OutputTransform, RowReader]:
    """The output transform and row reader of an image or video stream."""
    height, width = req.output.height, req.output.width
    if height == width == 0:
        raise InvalidRequest("output: size is required for images and video: give the output's "
                             "(height, width), one int for a square (size=224); only array files "
                             "take none, got (0, 0)")
    if not (0 < height <= _MAX_SIDE and 0 < width <= _MAX_SIDE):
        raise InvalidRequest(f"output: size must be within 1..{_MAX_SIDE} on each side, "
                             f"got ({height}, {width})")
    if not 0 <= req.output.shorter_side <= _MAX_SIDE:  # images are scaled to it before the crop
        raise InvalidRequest(f"output.shorter_side must be within 0..{_MAX_SIDE}, "
                             f"got {req.output.shorter_side}")
    clip = req.clip
    if kind == VIDEO:
        if clip.frames <= 0 or clip.stride < 0:
            raise InvalidRequest(f"clip: video samples need clip.frames > 0 (and stride >= 0), got "
                                 f"frames={clip.frames}, stride={clip.stride}")
        if req.output.resize != feed_pb2.RESIZE_SQUASH:
            raise InvalidRequest("output.resize: video clips are squashed; crops are for images")
    elif clip.frames:
        raise InvalidRequest("clip: only video samples take a clip spec")
    try:
        transform = OutputTransform(req.output, req.seed, req.epoch,
                                    frames=clip.frames if kind == VIDEO else 0)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if kind == VIDEO:
        return transform, VideoRows(transform, clip.frames, clip.stride or 1, clip.random_start)
    return transform, ImageRows(transform, fields)


def _sample_transforms(req: feed_pb2.StreamRequest, kind: str,
                       fields: SampleFields | None) -> SampleTransforms | None:
    """The request's named transforms, made from their parameters (media/transforms/registry.py)."""
    if not req.sample_transforms:
        return None
    if kind != IMAGE:
        raise InvalidRequest("sample_transforms: only image samples take sample transforms "
                             "(not video clips or array files)")
    try:
        return SampleTransforms.from_request(req.sample_transforms, req.seed, req.epoch,
                                             fields.sidecars if fields else ())
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def _first_arrays(path: str, name: str, storage: Storage) -> dict[str, np.ndarray]:
    """The first sample's arrays, which set the stream's layout."""
    try:
        with os.fdopen(storage.open_checked(path), "rb") as file:
            first = read_arrays(file, posixpath.splitext(path)[1], storage.max_file_bytes)
    except OutsideDataRoots as e:
        raise Forbidden(f"samples[0]: {e}") from None
    except FileNotFoundError:
        raise NotFound(f"samples[0]: {name!r} not found; the first array file sets the "
                       f"batch layout") from None
    except (OSError, DecodeError) as e:
        raise InvalidRequest(f"samples[0]: {name!r}: {e}") from None
    for key, values in first.items():
        if values.dtype.kind not in "biufc":
            raise InvalidRequest(f"samples[0]: {name!r}: {key!r} is {values.dtype}, which has no "
                                 f"tensor type")
        if key in ("index", "label", "padded"):
            raise InvalidRequest(f"samples[0]: {name!r}: the key {key!r} is reserved for "
                                 "gpufeed's own tensors; rename it")
    return first


def _own_arrays(with_labels: bool, padded: bool) -> list[tuple]:
    """gpufeed's per-sample arrays: index; label when labelled; padded when split over ranks."""
    arrays: list[tuple[str, type, tuple[int, ...]]] = [("index", np.int64, ())]
    if with_labels:
        arrays.append(("label", np.int64, ()))
    if padded:
        arrays.append(("padded", np.bool_, ()))
    return arrays


def _batch_names(req: feed_pb2.StreamRequest, storage: Storage, paths: SamplePaths | None,
                 reader: RowReader, prefix: str) -> BatchNames | None:
    """The names' room in a batch when the request asks for names; else None."""
    if not req.names:
        return None
    assert paths is not None  # located, or the shards' reader made them
    return BatchNames(name_room(storage, paths, reader, prefix))


def _array_layout(batch_size: int, reader: ArrayRows, own: list[tuple],
                  names: BatchNames | None = None) -> BatchLayout:
    arrays = [(key, spec.dtype, spec.shape) for key, spec in reader.layout.items()]
    if names is None:
        return BatchLayout(batch_size, arrays + own)
    name_arrays, private, offsets = names.arrays()
    for key, *_ in name_arrays:
        if key in reader.layout:
            raise InvalidRequest(f"names: the array files have a key {key!r}, which the "
                                 "samples' names take; rename it, or leave names off")
    return BatchLayout(batch_size, arrays + own + name_arrays, private, offsets)


def _image_layout(batch_size: int, transform: OutputTransform, own: list[tuple],
                  fields: SampleFields | None = None, names: BatchNames | None = None
                  ) -> BatchLayout:
    """image (as asked), index, label, padded, the fields, the names; uint8 pixels and
    flips as working space."""
    wire = BFLOAT16 if transform.dtype == torch.bfloat16 else ""
    arrays = [("image", transform.image_dtype, transform.image_shape, wire), *own]
    private = ["flip"]
    offsets: tuple[str, ...] = ()
    if fields is not None:
        field_arrays, field_private, offsets = fields.arrays()
        arrays += field_arrays
        private += field_private
    if names is not None:
        name_arrays, name_private, name_offsets = names.arrays()
        arrays += name_arrays
        private += name_private
        offsets += name_offsets
    arrays.append(("flip", np.bool_, ()))
    if transform.converts:
        arrays.append(("decoded", np.uint8, transform.decoded_shape))
        private.append("decoded")
    return BatchLayout(batch_size, arrays, tuple(private), offsets)


def _labels(req: feed_pb2.StreamRequest, samples: SampleFiles, listed: np.ndarray | None,
            storage: Storage) -> tuple[np.ndarray | None, list[str]]:
    """Per-sample labels (or None) and, for folder labels, the class names."""
    source = req.label_source
    if req.labels and source != feed_pb2.LABELS_FROM_REQUEST:
        raise InvalidRequest("labels: give labels or label_source, not both")
    if req.classes and source != feed_pb2.LABELS_FROM_FOLDER:
        raise InvalidRequest("classes: only folder labels (LABELS_FROM_FOLDER) take class names")
    if source == feed_pb2.LABELS_FROM_REQUEST:
        if not req.labels:
            return None, []
        if len(req.labels) != len(samples.paths):
            raise InvalidRequest(f"labels: {len(req.labels)} labels for {len(samples.paths)} "
                                 "samples")
        return np.asarray(req.labels, dtype=np.int64), []
    if source == feed_pb2.LABELS_FROM_LIST_FILE:
        if listed is None:
            raise InvalidRequest("label_source: LABELS_FROM_LIST_FILE needs a list_file")
        if samples.listings:
            raise InvalidRequest(f"list_file: {samples.names[samples.listings[0].start]!r} "
                                 "comes from a directory; labels from the list file need one "
                                 "file per line")
        return listed, []
    if source == feed_pb2.LABELS_FROM_FOLDER:
        try:
            return folder_labels(samples, list(req.classes), storage)
        except OutsideDataRoots as e:
            raise Forbidden(f"label_source: {e}") from None
        except FolderError as e:
            raise (NotFound if e.not_found else InvalidRequest)(str(e)) from None
    raise InvalidRequest(f"label_source: unknown value {source}")


def _sample_names(req: feed_pb2.StreamRequest, storage: Storage, limits: Limits,
                  stopped: Callable[[], bool], lists: SharedLists | None, held: list[Hold]
                  ) -> tuple[SampleNames, np.ndarray | None, str]:
    """The sample names, the list file's labels when label_source asks for them, the prefix.

    A directory given as list_file is one name, located as a list file is
    (without the prefix), and listed later like a directory in ``files``. A
    list file is parsed by listfile.py: the server's shared parse with
    ``lists`` (then held in ``held``), else this stream's own.
    """
    kind = req.WhichOneof("samples")
    if kind == "files":
        return _pack(req.files.paths, limits), None, req.prefix
    if kind != "list_file":
        raise InvalidRequest("samples: give either files or list_file")
    if "\0" in req.list_file:
        raise InvalidRequest(f"list_file: {req.list_file!r} contains a NUL byte")
    labelled = req.label_source == feed_pb2.LABELS_FROM_LIST_FILE
    try:
        path = storage.locate(req.list_file)
        if storage.is_directory(path):
            if labelled:
                raise InvalidRequest(f"list_file: {req.list_file!r} is a directory; labels from "
                                     "the list file need a list file")
            return _pack([req.list_file], limits), None, ""
        if lists is not None:
            hold = lists.list_file(storage, path, labelled, limits, stopped)
            held.append(hold)
            names, labels = hold.value.names, hold.value.labels
        else:
            data = storage.read(path, limits.max_list_bytes, "--max-list-bytes")
            names, labels = parse_list(data, labelled, limits.max_samples, stopped)
    except OutsideDataRoots as e:
        raise Forbidden(f"list_file: {e}") from None
    except (FileNotFoundError, IsADirectoryError):
        raise NotFound(f"list_file: {req.list_file!r}: no such list file or directory "
                       f"under the data roots") from None
    except FileTooLarge as e:
        raise LimitExceeded(f"list_file: {req.list_file!r} is a {e}") from None
    except OSError as e:
        raise InvalidRequest(f"list_file: cannot read {req.list_file!r}: {e}") from None
    except ListFileError as e:
        raise (LimitExceeded if e.limit else InvalidRequest)(e.message(req.list_file)) from None
    return names, labels, req.prefix


def _pack(names: Iterable[str], limits: Limits) -> SampleNames:
    try:
        return SampleNames.pack(names, limit=limits.max_samples)
    except TooManyNames:
        raise LimitExceeded(f"samples: more than {limits.max_samples} samples, over the "
                            f"server's --max-samples {limits.max_samples}") from None


def _names_shards(names: SampleNames) -> bool:
    """shards.py's ``names_shards``, over packed names at once where no name has a brace."""
    if names.contains("{"):
        # types: SampleNames is a sequence of str, not a list
        return names_shards(names)  # pyright: ignore[reportArgumentType]
    shards = names.ends_with(".tar")
    if not len(shards) or not shards.any():
        return False
    if shards.all():
        return True
    first, loose = int(np.argmax(shards)), int(np.argmin(shards))
    return names_shards([names[min(first, loose)], names[max(first, loose)]])  # raises


def _all_sample_files(names: Sequence[str]) -> bool:
    """Whether every name is an image, video or array file's, once per distinct suffix."""
    if isinstance(names, SampleNames):
        answers, _ = names.by_suffix(is_sample_file)
        return all(answers)
    return all(is_sample_file(name) for name in names)


def _sample_kind(names: Sequence[str]) -> str:
    """samples.py's ``sample_kind``, asked once per distinct suffix where the names can
    say which they have (packed names, a listed tree's)."""
    by_suffix = getattr(names, "by_suffix", None)
    if by_suffix is None:
        return sample_kind(names)
    kinds, codes = by_suffix(kind_of)
    first = kinds[int(codes[0])]
    others = [code for code, kind in enumerate(kinds) if kind != first]
    if not others:
        return first
    other = int(np.flatnonzero(np.isin(codes, others))[0])
    return sample_kind([names[0], names[other]])  # raises, naming the first of another kind


def _tar_shards(req: feed_pb2.StreamRequest, names: SampleNames, prefix: str,
                storage: Storage, limits: Limits, stopped: Callable[[], bool]
                ) -> ShardSet | None:
    """The named tar shards, indexed (shards.py); None when the names are loose files."""
    try:
        if not _names_shards(names):
            return None
        # A shard holds at least one sample (an unreadable one counts as one failed
        # sample): names over --max-samples, or --max-shards, are refused before they
        # are made, and so before any is indexed.
        # types: as above
        paths = locate_shards(names, prefix, storage,  # pyright: ignore[reportArgumentType]
                              min(limits.max_samples, limits.max_shards))
    except OutsideDataRoots as e:
        raise Forbidden(f"samples: {e}") from None
    except TooManyShards as e:
        if limits.max_shards < limits.max_samples:
            raise LimitExceeded(f"{e}, over the server's --max-shards {limits.max_shards}"
                                ) from None
        raise LimitExceeded(f"{e}, over the server's --max-samples {limits.max_samples} (each "
                            f"shard counts as one sample at least)") from None
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if req.labels or req.label_source != feed_pb2.LABELS_FROM_REQUEST:
        raise InvalidRequest("labels: tar shards carry their labels (.cls or .txt members); "
                             "give neither labels nor label_source")
    try:  # counted as the headers are read: indexing stops past the limit
        shards = ShardSet.index(storage, paths, limits.max_samples, stopped)
    except IndexCancelled:
        raise PlanStopped("the call ended while its tar shards were indexed") from None
    except TooManySamples as e:
        raise LimitExceeded(f"samples: {e}, over the server's --max-samples "
                            f"{limits.max_samples}") from None
    if len(shards.unreadable()) == len(paths):
        path, why = shards.unreadable()[0]
        raise NotFound(f"samples: no tar shard could be read (first: {path!r}: {why})")
    return shards


def _sample_files(names: SampleNames, prefix: str, storage: Storage, max_samples: int,
                  stopped: Callable[[], bool] = lambda: False, lists: SharedLists | None = None,
                  held: list[Hold] | None = None) -> SampleFiles:
    """Located paths, each directory among them replaced by the files under it.

    Only a name without an image, video or array suffix costs a system call
    (is it a directory?): a long list of files is checked lexically, as before,
    and stays packed. A listing's names and paths are packed once it is done. A
    local directory named alone is the server's shared tree with ``lists``
    (held in ``held``), its names made when asked.
    """
    if "\0" in prefix or names.contains("\0"):  # a list file's line too: no path holds one
        i = next(i for i, name in enumerate(names) if "\0" in prefix + name)
        raise InvalidRequest(f"samples[{i}]: {prefix + names[i]!r} contains a NUL byte")
    if _all_sample_files(names):
        return SampleFiles(names, _located(names, prefix, storage))
    found_names: list[str] = []
    found_paths: list[str] = []
    listings: list[Listing] = []
    for i, name in enumerate(names):
        if i % _STOP_CHECK_NAMES == 0 and stopped():  # a name may cost a LIST on S3
            raise PlanStopped("the call ended while its sample names were located")
        try:
            path = storage.locate(prefix + name)
            if is_sample_file(name) or not names_a_directory(path, name, storage):
                found_names.append(name)
                found_paths.append(path)
                continue
            path = as_directory(path)
            if lists is not None and held is not None and len(names) == 1:
                hold = lists.tree(storage, path, name, max_samples, stopped)
                if hold is not None:
                    held.append(hold)
                    return _tree_files(hold.value, name)
            listed = list_directory(path, name, storage, max_samples - len(found_paths),
                                    stopped)
        except OutsideDataRoots as e:
            raise Forbidden(f"samples[{i}]: {e}") from None
        except TooManyFiles as e:
            raise LimitExceeded(f"samples[{i}]: {e}") from None
        except FolderError as e:
            raise (NotFound if e.not_found else InvalidRequest)(f"samples[{i}]: {e}") from None
        if not listed:
            raise InvalidRequest(f"samples[{i}]: the directory {name!r} holds no image, video or "
                                 f"array files")
        start = len(found_paths)
        found_paths += listed
        found_names += [posixpath.join(name, below(p, path)) for p in listed]
        listings.append(Listing(start, len(found_paths), path))
    if len(found_paths) > max_samples:  # the files named beside the listings
        raise LimitExceeded(f"samples: {len(found_paths)} samples is over the server's "
                            f"--max-samples {max_samples}")
    return SampleFiles(SampleNames.pack(found_names), SampleNames.pack(found_paths), listings)


def _tree_files(tree: ListedTree, name: str) -> SampleFiles:
    """The samples of a shared tree that a request named ``name`` (its only sample name)."""
    if not len(tree.paths):
        raise InvalidRequest(f"samples[0]: the directory {name!r} holds no image, video or "
                             f"array files")
    return SampleFiles(ListedNames(name, tree), tree.paths,
                       [Listing(0, len(tree.paths), tree.directory)], tree)


def _located(names: SampleNames, prefix: str, storage: Storage) -> LocatedPaths:
    """The names' paths, every one checked to lie under the roots (lexically) now.

    A relative name without ``..`` after a relative prefix without one cannot
    leave the roots: when no name has either, the per-name check is skipped.
    An ``s3://`` name (or prefix) is always checked: it names its bucket and
    key itself, which may lie under no root, or on a server with none.
    """
    if not (os.path.isabs(prefix) or ".." in prefix or is_s3(prefix) or names.contains("..")
            or names.contains("s3://") or (not prefix and names.any_starts_with("/"))):
        return LocatedPaths(names, prefix, storage)
    for i, name in enumerate(names):
        try:
            storage.locate(prefix + name)
        except OutsideDataRoots as e:
            raise Forbidden(f"samples[{i}]: {e}") from None
    return LocatedPaths(names, prefix, storage)
