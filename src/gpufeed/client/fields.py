"""A sample's fields beside its image: declaring them, and splitting them per sample.

``loader(..., fields=...)`` asks the server for a mask, boxes and metadata per
sample, each from a sidecar file (docs/guide/fields.md).
Each field is a tensor of the batch; the variable-length ones are flat with
offsets (``boxes`` float32 [N, 5] and ``boxes_offsets`` int64 [B + 1];
``meta`` uint8 [M] and ``meta_offsets``), which ``split`` and ``metadata``
turn into one entry per sample. ``loader(..., names=True)``'s sample names
travel the same way (``names`` uint8 [M], ``names_offsets``), read by ``names``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpufeed.v1 import feed_pb2

from .checks import OFFSETS, check_offsets

__all__ = ["Field", "field_specs", "metadata", "names", "split"]


@dataclass(frozen=True)
class Field:
    """Where a field's sidecar is and how much room it gets.

    ``suffix`` replaces the sample's own (empty: ".png" for a mask, ".txt" for
    boxes, ".json" for meta); ``tree=("images", "masks")`` looks in a parallel
    tree (the last directory named "images" in the sample's path, below its
    data root, renamed "masks"); ``max_items`` is the most boxes, or bytes of
    metadata, a sample may have (0: the server's default, 256 boxes or 4096 bytes).
    """

    suffix: str = ""
    tree: tuple[str, str] | None = None
    max_items: int = 0


def field_specs(fields: Mapping[str, Field | str] | Sequence[str] | None
                ) -> list[feed_pb2.FieldSpec]:
    """The request's FieldSpecs: from names (every default), or a mapping of name to a
    Field or a suffix."""
    if fields is None:
        return []
    if isinstance(fields, str):
        raise TypeError(f"fields must be a list of names or a dict, got the string {fields!r}")
    items = fields.items() if isinstance(fields, Mapping) else ((name, Field()) for name in fields)
    specs = []
    for name, field in items:
        if isinstance(field, str):
            field = Field(suffix=field)
        tree_from, tree_to = field.tree or ("", "")
        specs.append(feed_pb2.FieldSpec(name=name, suffix=field.suffix, tree_from=tree_from,
                                        tree_to=tree_to, max_items=field.max_items))
    return specs


def split(batch: Mapping[str, torch.Tensor], name: str) -> list[torch.Tensor]:
    """A variable-length field per sample: ``batch[name]`` cut at ``batch[name + "_offsets"]``
    (views, one per row of the batch). FeedError (DATA_LOSS) if the offsets do not cut
    it: checked again here, as the server may rewrite a zero-copy batch's memory."""
    offsets = batch[name + OFFSETS].tolist()
    flat = batch[name]
    check_offsets(name + OFFSETS, np.array(offsets, np.int64), len(flat))
    return [flat[start:end] for start, end in zip(offsets[:-1], offsets[1:])]


def metadata(batch: Mapping[str, torch.Tensor]) -> list[Any]:
    """Each sample's ``meta`` sidecar, parsed from its JSON."""
    return [json.loads(bytes(values.cpu().numpy())) for values in split(batch, "meta")]


def names(batch: Mapping[str, torch.Tensor]) -> list[str]:
    """Each sample's name, in row order (``loader(..., names=True)``): a file's path
    relative to its data root, ``shard/key`` for a tar sample, an S3 object's URL.

    Bytes that are not UTF-8 (a file or tar member named so) come back as
    surrogates, as ``os.fsdecode`` gives them: ``name.encode("utf-8",
    "surrogateescape")`` is the name's bytes. KeyError, saying so, for a batch of
    a loader that did not ask for names; FeedError (DATA_LOSS) if the offsets do
    not cut the names.
    """
    if "names" not in batch:
        raise KeyError("names: this batch carries no names; ask loader(..., names=True)")
    offsets = batch["names" + OFFSETS].cpu().numpy().copy()  # the server may rewrite shm
    flat = batch["names"].cpu().numpy().tobytes()
    check_offsets("names" + OFFSETS, offsets, len(flat))
    return [flat[start:end].decode("utf-8", "surrogateescape")
            for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
