"""Each sample's name in its batch, on request (``StreamRequest.names``, ``loader(names=True)``).

A trainer that names a directory, a list file or tar shards has no list of its
own to look an ``index`` up in; a prediction it wants to report by file needs
the name with the row. A name is what failures call the sample
(``RowReader.name``): a file's path relative to its data root (a listed
directory's files too), an S3 object's ``s3://`` URL, a tar sample's shard
then ``/`` and its key (WebDataset's ``__key__``).

Names travel as a variable-length field does (media/fields.py): ``names``
uint8 [M], the UTF-8 bytes back to back (bytes that are not UTF-8, from a tar
header or a file name on disk, are sent as they are: ``surrogateescape``), and
``names_offsets`` int64 [B + 1]. A decode thread writes its row's name after
the sample is read, so a failed row has none and a padding row has its real
sample's; the batch's last thread closes up the failed rows with every other
array and packs the names flat (``pack_rows``). Only the packed part is sent.

Room: a slot is a fixed layout, so each row has room for the longest name the
plan can give (``name_room``): worked out from the plan without a name per
sample (the request's longest name and prefix; the longest located path of a
listing; each shard's name and longest key), at most ``MAX_NAME_BYTES``
(PATH_MAX). A name longer than its room (only past that bound) fails its
sample as ``too_large``; it is never cut, as a cut name may name another file.
"""

from __future__ import annotations

import numpy as np

from ...media.decode import OverLimit
from ...media.fields import pack_rows
from ...media.samples import RowReader
from ...media.shard_rows import ShardRows
from ...storage.paths import LocatedPaths, SamplePaths
from ...storage.roots import Storage
from .names import SampleNames

__all__ = ["MAX_NAME_BYTES", "NAMES", "BatchNames", "name_room"]

NAMES = "names"
# The most bytes a name may take: PATH_MAX, the longest path a local file can be opened by
# (an S3 URL is at most ~1100: a 1024-byte key, a 63-byte bucket).
MAX_NAME_BYTES = 4096


class BatchNames:
    """A stream's sample names in its batches: ``room`` bytes a row."""

    def __init__(self, room: int):
        self.room = room

    def arrays(self) -> tuple[list[tuple], tuple[str, ...], tuple[str, ...]]:
        """(layout arrays, private names, offsets names), as ``SampleFields.arrays``."""
        return ([(NAMES, np.uint8, (self.room,)), (f"{NAMES}_offsets", np.int64, ()),
                 (f"{NAMES}_count", np.int64, ())],
                (f"{NAMES}_count",), (f"{NAMES}_offsets",))

    def write(self, arrays: dict[str, np.ndarray], row: int, name: str) -> None:
        """Write ``name`` into row ``row``; OverLimit (the sample fails) past the room."""
        data = name.encode("utf-8", "surrogateescape")
        if len(data) > self.room:
            raise OverLimit(f"name: {len(data)} bytes, over the {self.room} bytes a sample's "
                            f"name may take")
        arrays[NAMES][row, :len(data)] = np.frombuffer(data, np.uint8)
        arrays[f"{NAMES}_count"][row] = len(data)

    def pack(self, arrays: dict[str, np.ndarray], rows: int) -> dict[str, int]:
        """Pack the first ``rows`` rows' names flat; the entries sent (``SlotBatch.lengths``)."""
        return pack_rows(arrays, NAMES, rows)


def name_room(storage: Storage, paths: SamplePaths, reader: RowReader, prefix: str) -> int:
    """The bytes a row needs for the longest name ``reader.name`` can give a sample of
    ``paths`` (not less, perhaps a little more), at most ``MAX_NAME_BYTES``.

    Loose files named by the request: the prefix and the longest name, and what
    locating a relative name under an S3 root adds (its bucket and prefix); a
    name's path relative to its root is never longer than the name (normalising
    only drops parts). A listing's files: their longest located path (the name
    drops its root). Tar samples: each shard's name and its longest key.
    """
    if isinstance(reader, ShardRows):
        longest = reader.longest_name(storage)
    elif isinstance(paths, LocatedPaths) and isinstance(paths.names, SampleNames):
        added = len(storage.shown(storage.locate("x")).encode(errors="surrogateescape")) - 1
        longest = len(prefix.encode(errors="surrogateescape")) + paths.names.longest \
            + max(0, added)
    elif isinstance(paths, SampleNames):
        longest = paths.longest
    else:  # no bound known without a name per sample: the most a name may take
        longest = MAX_NAME_BYTES
    return max(1, min(longest, MAX_NAME_BYTES))
