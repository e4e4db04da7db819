"""A stream's batch layout: which arrays a batch holds, of what dtype and shape.

gpufeed's own arrays (index, label, padded), then the samples' (an image as
the output asks, with its fields and names, and the decoder's working space;
or an array file's keys, as the first array file has them). The ring
(memory/ring.py) lays each array out in a slot from this.
"""

from __future__ import annotations

import os
import posixpath

import numpy as np
import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import BFLOAT16

from ...media.arrays import read_arrays
from ...media.decode import DecodeError
from ...media.fields import SampleFields
from ...media.output import OutputTransform
from ...media.samples import ArrayRows, RowReader
from ...memory.ring import BatchLayout
from ...storage.paths import OutsideDataRoots, SamplePaths
from ...storage.roots import Storage
from ..errors import Forbidden, InvalidRequest, NotFound
from .batchnames import BatchNames, name_room

__all__ = ["array_layout", "first_arrays", "image_layout", "own_arrays", "requested_names"]


def first_arrays(path: str, name: str, storage: Storage) -> dict[str, np.ndarray]:
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


def own_arrays(with_labels: bool, padded: bool) -> list[tuple]:
    """gpufeed's per-sample arrays: index; label when labelled; padded when split over ranks."""
    arrays: list[tuple[str, type, tuple[int, ...]]] = [("index", np.int64, ())]
    if with_labels:
        arrays.append(("label", np.int64, ()))
    if padded:
        arrays.append(("padded", np.bool_, ()))
    return arrays


def requested_names(req: feed_pb2.StreamRequest, storage: Storage, paths: SamplePaths | None,
                    reader: RowReader, prefix: str) -> BatchNames | None:
    """The names' room in a batch when the request asks for names; else None."""
    if not req.names:
        return None
    assert paths is not None  # located, or the shards' reader made them
    return BatchNames(name_room(storage, paths, reader, prefix))


def array_layout(batch_size: int, reader: ArrayRows, own: list[tuple],
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


def image_layout(batch_size: int, transform: OutputTransform, own: list[tuple],
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
