"""Pre-computed arrays (.npy, .npz, torch .pt state dicts), read without pickle.

A pickle can run arbitrary code, and gpufeed reads files it did not write, so
nothing here runs a general unpickler: numpy loads with ``allow_pickle=False``
(object arrays are refused) and torch with ``weights_only=True`` (its restricted
unpickler rebuilds only tensors, containers and numbers). A file that would
need more is a DecodeError that says so.

``.npy`` files are memory-mapped when they are real files, so a sample's bytes
are paged in once, straight into the batch copy, instead of being read into a
temporary array first. ``.npz`` members are zip entries (possibly compressed)
and are read whole.

Every ``.npy`` header is parsed under one lock. numpy parses a header with
``ast.literal_eval``, and CPython 3.11 keeps the AST builder's recursion count
in one place for all threads: two decode threads parsing at once can fail a
good file with "SystemError: AST constructor recursion depth mismatch"
(CPython issue 106905, fixed in 3.12 and later). A header is a few hundred
bytes, so the lock costs nothing measurable; the array data is read outside it.

Sizes are checked before anything is allocated for them: a zip's (``.npz``,
``.pt``) members may declare at most ``max_bytes`` uncompressed in all
(``--max-file-bytes``, the limit on a file on disk), and an ``.npz`` member's
array header may not declare more than its member holds. Otherwise a 1.4 MB
``.npz`` could make numpy allocate 1.4 GB for an array it then fails to fill.

A batch is assembled by key: ``array_layout`` takes names, dtypes and per-sample
shapes from the first sample, and ``check`` refuses any later sample that
differs, naming the key and both layouts.
"""

from __future__ import annotations

import math
import os
import pickle
import threading
import zipfile
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch

from ..storage.paths import DEFAULT_MAX_FILE_BYTES
from .decode import DecodeError, OverLimit

__all__ = ["ArraySpec", "array_layout", "check", "read_arrays"]

_NEEDS_PICKLE = "object arrays need pickle, which gpufeed never loads"
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0,
                   (2, 0): np.lib.format.read_array_header_2_0}
_HEADER_LOCK = threading.Lock()  # see the module docstring: ast is not thread-safe in 3.11


@dataclass(frozen=True)
class ArraySpec:
    """The dtype and per-sample shape every sample's array under one key must have."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes one sample takes in a batch."""
        return self.dtype.itemsize * math.prod(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype} {list(self.shape)}"


def read_arrays(file: BinaryIO | str | os.PathLike, suffix: str,
                max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> dict[str, np.ndarray]:
    """The arrays in one sample's file, by key; ``suffix`` (".npy", ".npz", ".pt") picks the format.

    An ``.npy`` holds one array, returned under the key ``"array"``; it is
    memory-mapped (read-only) when ``file`` is a path or a real file. An
    ``.npz`` gives one entry per member, a ``.pt`` one per state-dict key (a
    bare tensor is ``"array"``). Raises DecodeError for anything that would need
    pickle, a corrupt file, a .pt value that is not a tensor, or sizes declared
    over ``max_bytes``.
    """
    suffix = suffix.lower()
    try:
        if suffix == ".npy":
            arrays = {"array": _read_npy(file)}
        elif suffix == ".npz":
            arrays = _read_npz(file, max_bytes)
        elif suffix in (".pt", ".pth"):
            _check_zip(file, max_bytes)
            arrays = _read_torch(file)
        else:
            raise DecodeError(f"unsupported array file {suffix!r}: use .npy, .npz or .pt")
    except (FileNotFoundError, PermissionError):
        raise  # the caller reports these as read failures, not decode failures
    except ValueError as e:  # numpy's word for "would need pickle", and for bad headers
        raise DecodeError(_numpy_reason(str(e), suffix)) from None
    except (EOFError, OSError, RuntimeError, KeyError, zipfile.BadZipFile) as e:
        # Truncated files, bad zips (KeyError: a zip's missing member).
        raise DecodeError(f"not a valid {suffix} file: {e}") from None
    if not arrays:
        raise DecodeError(f"no arrays in {suffix} file")
    return arrays


def array_layout(first: dict[str, np.ndarray]) -> dict[str, ArraySpec]:
    """The layout a batch takes from its first sample: key → dtype and per-sample shape.

    Batches hold native byte order whatever the files hold: the wire names a
    dtype without one, and the copy into the batch converts a big-endian file.
    """
    return {key: _spec(array) for key, array in first.items()}


def check(sample: dict[str, np.ndarray], layout: dict[str, ArraySpec]) -> None:
    """Raise DecodeError unless ``sample`` has exactly ``layout``'s keys, dtypes and shapes."""
    if sample.keys() != layout.keys():
        raise DecodeError(f"keys {sorted(sample)} differ from the first sample's {sorted(layout)}")
    for key, spec in layout.items():
        got = _spec(sample[key])
        if got != spec:
            raise DecodeError(f"{key!r} is {got}, but the first sample's is {spec}")


def _spec(array: np.ndarray) -> ArraySpec:
    return ArraySpec(array.dtype.newbyteorder("="), tuple(array.shape))


def _numpy_reason(message: str, suffix: str) -> str:
    if "Object arrays" in message:
        return _NEEDS_PICKLE
    if "pickled" in message:  # np.load falls back to pickle for anything not .npy/.npz
        return f"not a {suffix} file (anything else would need pickle, which gpufeed never loads)"
    return f"not a valid {suffix} file: {message}"


def _check_zip(file, max_bytes: int) -> None:
    """Refuse a zip whose members declare more than ``max_bytes`` uncompressed.

    A file that is not a zip is left to torch to refuse (or to load in its legacy
    format, no larger than its file).
    """
    start = file.tell() if hasattr(file, "tell") else None
    try:
        if zipfile.is_zipfile(file):
            with zipfile.ZipFile(file) as archive:
                _check_total(archive, max_bytes)
    finally:
        if start is not None:
            file.seek(start)


def _check_total(archive: zipfile.ZipFile, max_bytes: int) -> None:
    total = sum(info.file_size for info in archive.infolist())
    if total > max_bytes:
        raise OverLimit(f"its members declare {total} bytes uncompressed, over the limit "
                        f"of {max_bytes} (gpufeed-server --max-file-bytes)")


def _read_npz(file, max_bytes: int) -> dict[str, np.ndarray]:
    """An .npz's arrays by member name (without ".npy"), as np.load names them.

    Read here rather than by np.load so that each header is parsed under the
    lock and checked against its member's size before the array is read.
    """
    with zipfile.ZipFile(file) as archive:  # not a zip: BadZipFile, a DecodeError above
        _check_total(archive, max_bytes)
        arrays = {}
        for info in archive.infolist():
            key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            with archive.open(info) as member:
                arrays[key] = _read_npy_stream(member, info.file_size, info.filename)
    return arrays


def _read_header(stream) -> tuple[tuple[int, ...], bool, np.dtype] | None:
    """Shape, Fortran order and dtype from the .npy header at ``stream``'s position,
    or None (nothing read past the magic) for a format version numpy alone reads."""
    with _HEADER_LOCK:
        read_header = _HEADER_READERS.get(np.lib.format.read_magic(stream))
        if read_header is None:
            return None
        shape, fortran_order, dtype = read_header(stream)
    if dtype.hasobject:
        raise DecodeError(_NEEDS_PICKLE)
    return shape, fortran_order, dtype


def _read_npy_stream(stream, size: int, member: str = "") -> np.ndarray:
    """The .npy array in ``stream``'s next ``size`` bytes, read whole (not mapped).

    Its header may not declare more array than ``size`` holds, so a lying
    header cannot make us allocate for data that is not there. ``member`` names
    the .npz member it is, for the message.
    """
    where = f"{member!r} " if member else ""
    header = _read_header(stream)
    if header is None:
        raise DecodeError(f"{where}has an .npy format version gpufeed does not read")
    shape, fortran_order, dtype = header
    declared = dtype.itemsize * math.prod(shape)
    if declared > size:
        raise DecodeError(f"not a valid .npy file: {where}declares an array of {declared} "
                          f"bytes in {size} bytes")
    data = stream.read(declared)
    if len(data) < declared:
        raise DecodeError(f"not a valid .npy file: {where}holds {len(data)} of the "
                          f"{declared} bytes its header declares")
    return np.frombuffer(data, dtype).reshape(shape, order="F" if fortran_order else "C")


def _read_npy(file) -> np.ndarray:
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as f:
            return _read_npy(f)
    try:
        file.fileno()
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError (BytesIO)
        begin = file.tell()
        size = file.seek(0, os.SEEK_END) - begin
        file.seek(begin)
        return _read_npy_stream(file, size)
    return _map_npy(file)


def _map_npy(f) -> np.ndarray:
    """Memory-map the .npy in real file ``f`` (np.load's own mmap needs a path, not a file).

    The mapping outlives ``f``: mmap keeps its own handle, so the caller may close it.
    """
    begin = f.tell()
    header = _read_header(f)
    if header is None:  # a newer header version: numpy reads it, unmapped, under the lock
        f.seek(begin)
        with _HEADER_LOCK:
            return np.load(f, allow_pickle=False)
    shape, fortran_order, dtype = header
    if math.prod(shape) == 0:  # nothing to map (mmap refuses zero bytes)
        return np.empty(shape, dtype)
    return np.memmap(f, dtype=dtype, mode="r", offset=f.tell(), shape=shape,
                     order="F" if fortran_order else "C")


def _read_torch(file) -> dict[str, np.ndarray]:
    # torch maps storages only from a path, and only in its zip format (not the
    # pre-1.6 legacy one, which still loads, unmapped).
    mmap = isinstance(file, (str, os.PathLike)) and zipfile.is_zipfile(file)
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        # torch says the same for a corrupt file and for one holding other objects.
        raise DecodeError("not a weights-only .pt file: corrupt, or holds objects beyond "
                          "tensors that need pickle, which gpufeed never loads") from None
    if isinstance(loaded, torch.Tensor):
        loaded = {"array": loaded}
    if not isinstance(loaded, dict):
        raise DecodeError(f"a .pt file must hold a state dict or a tensor, "
                          f"not {type(loaded).__name__}")
    arrays = {}
    for key, value in loaded.items():
        if not isinstance(value, torch.Tensor):
            raise DecodeError(f"{key!r} holds {type(value).__name__}, not a tensor")
        if value.dtype == torch.bfloat16:
            raise DecodeError(f"{key!r} is bfloat16, which numpy has no dtype for")
        arrays[str(key)] = value.detach().numpy()
    return arrays
