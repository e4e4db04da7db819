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
            _check_zip(file, max_bytes, npy_members=True)
            with np.load(file, allow_pickle=False) as npz:
                arrays = {key: npz[key] for key in npz.files}
        elif suffix in (".pt", ".pth"):
            _check_zip(file, max_bytes, npy_members=False)
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


def _check_zip(file, max_bytes: int, *, npy_members: bool) -> None:
    """Refuse a zip whose members declare more than ``max_bytes`` uncompressed, or (an
    .npz) whose .npy headers declare more array than their members hold.

    A file that is not a zip is left to numpy or torch to refuse (or, a .pt, to
    load in torch's legacy format, no larger than its file).
    """
    start = file.tell() if hasattr(file, "tell") else None
    try:
        if zipfile.is_zipfile(file):
            _check_zip_members(file, max_bytes, npy_members)
    finally:
        if start is not None:
            file.seek(start)


def _check_zip_members(file, max_bytes: int, npy_members: bool) -> None:
    with zipfile.ZipFile(file) as archive:
        members = archive.infolist()
        total = sum(info.file_size for info in members)
        if total > max_bytes:
            raise OverLimit(f"its members declare {total} bytes uncompressed, over the limit "
                            f"of {max_bytes} (gpufeed-server --max-file-bytes)")
        for info in members if npy_members else ():
            with archive.open(info) as member:
                declared = _npy_bytes(member)
            if declared > info.file_size:
                raise DecodeError(f"{info.filename!r} declares an array of {declared} bytes in "
                                  f"a member of {info.file_size}")


def _npy_bytes(member) -> int:
    """The bytes of array the .npy header at the start of ``member`` declares."""
    read_header = _HEADER_READERS.get(np.lib.format.read_magic(member))
    if read_header is None:
        raise DecodeError("unsupported .npy format version")
    shape, _, dtype = read_header(member)
    return dtype.itemsize * math.prod(shape)


def _read_npy(file) -> np.ndarray:
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as f:
            return _read_npy(f)
    try:
        file.fileno()
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError (BytesIO)
        return np.load(file, allow_pickle=False)
    return _map_npy(file)


def _map_npy(f) -> np.ndarray:
    """Memory-map the .npy in real file ``f`` (np.load's own mmap needs a path, not a file).

    The mapping outlives ``f``: mmap keeps its own handle, so the caller may close it.
    """
    begin = f.tell()
    read_header = _HEADER_READERS.get(np.lib.format.read_magic(f))
    if read_header is None:  # a newer header version: let numpy parse it, unmapped
        f.seek(begin)
        return np.load(f, allow_pickle=False)
    shape, fortran_order, dtype = read_header(f)
    if dtype.hasobject:
        raise DecodeError(_NEEDS_PICKLE)
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
