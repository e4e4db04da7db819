"""A request's fields checked against the server's limits, each refusal naming its field.

Plain checks of what a request asks (batch split over ranks, prefetch, a
batch's bytes, transport and compression, the resume position and phases, the
failure budget, the output size and clip, fields and sample transforms),
separate from what planning reads: nothing here touches storage. Each bound
says what it protects.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpufeed.v1 import feed_pb2

from ...config import Limits
from ...media.fields import MASK, FieldError, SampleFields
from ...media.output import OutputTransform
from ...media.samples import IMAGE, VIDEO, ImageRows, RowReader, VideoRows
from ...media.transforms.runner import SampleTransforms
from ...memory.ring import BatchLayout
from ...storage.shardindex import TAKEN_SUFFIXES
from ...storage.shards import ShardSet
from ..errors import InvalidRequest, LimitExceeded, Unsupported
from .compression import COMPRESSORS

__all__ = ["check_batch_bytes", "check_field_bytes", "compression", "failure_budget", "pixels",
           "prefetch", "resumed_from", "sample_fields", "sample_transforms", "dealt",
           "start_batch", "transport", "world_size"]

# An output side: larger than any model's input, small enough that a row stays bounded.
_MAX_SIDE = 8192
# Resuming an epoch at another world size (resumed_from): at most this many earlier
# phases, and world sizes up to this (a million ranks).
_MAX_RESUMED = 64
_MAX_WORLD_SIZE = 1 << 20


def world_size(req: feed_pb2.StreamRequest) -> int:
    """The request's world size, with its batch size and rank checked."""
    if req.batch_size <= 0:
        raise InvalidRequest(f"batch_size must be positive, got {req.batch_size}")
    world_size = req.world_size or 1
    if world_size < 0:
        raise InvalidRequest(f"world_size must be positive, got {world_size}")
    if not 0 <= req.rank < world_size:
        raise InvalidRequest(f"rank must be in [0, world_size={world_size}), got {req.rank}")
    return world_size


def prefetch(req: feed_pb2.StreamRequest, limits: Limits) -> int:
    """Batches decoded ahead of the one the trainer holds: the request's, or the default."""
    prefetch = req.prefetch or limits.default_prefetch
    if not 0 < prefetch <= limits.max_prefetch:
        raise InvalidRequest(f"prefetch must be in 1..{limits.max_prefetch} (the server's "
                             f"--max-prefetch), got {prefetch}")
    return prefetch


def check_batch_bytes(batch_size: int, layout: BatchLayout, fields: SampleFields | None,
                      limits: Limits) -> None:
    """Refuse a batch over --max-batch-bytes, naming the field that takes most when there
    are fields."""
    if layout.slot_bytes > limits.max_batch_bytes and fields is not None:
        check_field_bytes(batch_size, fields, layout.slot_bytes, limits.max_batch_bytes)
    if layout.slot_bytes > limits.max_batch_bytes:
        raise LimitExceeded(f"batch_size x output: a batch takes {layout.slot_bytes} bytes, over "
                            f"the server's --max-batch-bytes of {limits.max_batch_bytes}")


def transport(req: feed_pb2.StreamRequest, transports: tuple[int, ...]) -> int:
    """The stream's transport: the request's, if this server offers it (auto is inline here:
    a client that did not probe /dev/shm)."""
    transport = req.transport
    if transport == feed_pb2.TRANSPORT_AUTO:
        transport = feed_pb2.TRANSPORT_INLINE  # a client that did not probe /dev/shm
    if transport not in transports:
        name = feed_pb2.Transport.Name(transport) if transport in feed_pb2.Transport.values() \
            else str(transport)
        offered = ", ".join(feed_pb2.Transport.Name(t) for t in transports)
        raise InvalidRequest(f"transport: {name} is not offered by this server (offered: "
                             f"{offered})")
    return transport


def compression(name: str, transport: int) -> tuple[str, Callable | None]:
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


def resumed_from(req: feed_pb2.StreamRequest, world_size: int, shards: ShardSet | None
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


def dealt(req: feed_pb2.StreamRequest) -> bool:
    """Whether the client deals the stream's batches (Deal messages), refusing the fields
    that pick a stream's batches otherwise: they do not apply to a dealt stream."""
    if not req.dealt:
        return False
    for name, given in (("job", req.job), ("start_batch", req.start_batch)):
        if given:
            raise InvalidRequest(f"{name}: a dealt stream makes the batches its client hands "
                                 f"it, so {name} does not apply; leave it unset")
    return True


def start_batch(req: feed_pb2.StreamRequest, num_batches: int) -> int:
    """The stream's first batch of the pass's ``num_batches``: its resume position."""
    if not 0 <= req.start_batch <= num_batches:
        raise InvalidRequest(f"start_batch must be in 0..{num_batches} (batches in this "
                             f"stream), got {req.start_batch}")
    return req.start_batch


def failure_budget(req: feed_pb2.StreamRequest, num_samples: int, limits: Limits) -> int:
    if req.max_failures < 0:
        raise InvalidRequest(f"max_failures must be >= 0, got {req.max_failures}")
    if not 0 <= req.max_failure_fraction <= 1:
        raise InvalidRequest("max_failure_fraction must be in [0, 1], got "
                             f"{req.max_failure_fraction}")
    count, fraction = req.max_failures, req.max_failure_fraction
    if count == 0 and fraction == 0:
        count, fraction = limits.default_max_failures, limits.default_max_failure_fraction
    return max(count, int(fraction * num_samples))


def sample_fields(req: feed_pb2.StreamRequest, kind: str, shards: bool) -> SampleFields | None:
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


def check_field_bytes(batch_size: int, fields: SampleFields, slot_bytes: int,
                      limit: int) -> None:
    """Name the field whose room takes most of a batch over --max-batch-bytes."""
    arrays, _, _ = fields.arrays()
    name, dtype, shape = max(arrays, key=lambda a: np.dtype(a[1]).itemsize * int(np.prod(a[2])))
    share = batch_size * np.dtype(dtype).itemsize * int(np.prod(shape))
    at = fields.declared_at(name)
    what = f"{at}.max_items" if name != MASK else f"{at} (the mask, output size)"
    raise InvalidRequest(f"{what}: {name} takes {share} bytes of a batch of {slot_bytes}, over the "
                         f"server's --max-batch-bytes of {limit}; lower it or batch_size")


def pixels(req: feed_pb2.StreamRequest, kind: str, fields: SampleFields | None = None
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


def sample_transforms(req: feed_pb2.StreamRequest, kind: str,
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
