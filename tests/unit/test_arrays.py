"""read_arrays / array_layout / check: pre-computed arrays, bit for bit, never via pickle."""

from __future__ import annotations

import io
import pickle
import sys
import threading

import numpy as np
import pytest
import torch

from gpufeed.server.media.arrays import ArraySpec, array_layout, check, read_arrays
from gpufeed.server.media.decode import DecodeError

_PICKLE = "object arrays need pickle, which gpufeed never loads"


def _sources():
    """Arrays of several dtypes and layouts, including NaN payloads and Fortran order."""
    rng = np.random.default_rng(7)
    floats = rng.standard_normal((3, 5)).astype(np.float32)
    floats[0, 0] = np.nan
    return {
        "feature": floats,
        "half": rng.standard_normal(16).astype(np.float16),
        "tokens": rng.integers(-2**40, 2**40, (2, 3, 4), dtype=np.int64),
        "mask": rng.random((4, 4)) > 0.5,
        "image": np.asfortranarray(rng.integers(0, 256, (8, 6, 3), dtype=np.uint8)),
        "scalar": np.array(3.25, dtype=np.float64),
        "empty": np.zeros((0, 4), np.int32),
    }


def _same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def _as_path(path):
    return str(path)


def _as_file(path):
    return open(path, "rb")


def _as_bytes(path):
    return io.BytesIO(path.read_bytes())


OPENERS = [_as_path, _as_file, _as_bytes]


@pytest.mark.parametrize("opener", OPENERS, ids=["path", "file", "bytes"])
@pytest.mark.parametrize("name", list(_sources()))
def test_npy_bit_for_bit(tmp_path, opener, name):
    source = _sources()[name]
    path = tmp_path / "a.npy"
    np.save(path, source)
    src = opener(path)
    got = read_arrays(src, ".npy")
    if hasattr(src, "close"):
        src.close()  # a mapping must outlive the file it came from
    assert list(got) == ["array"]
    _same_bits(got["array"], source)


def test_npy_is_memory_mapped_read_only(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.arange(100, dtype=np.int16))
    for src in (str(path), path, open(path, "rb")):
        array = read_arrays(src, ".NPY")["array"]
        assert isinstance(array, np.memmap)
        assert not array.flags.writeable


@pytest.mark.parametrize("opener", OPENERS, ids=["path", "file", "bytes"])
@pytest.mark.parametrize("compressed", [False, True])
def test_npz_bit_for_bit(tmp_path, opener, compressed):
    sources = _sources()
    path = tmp_path / "a.npz"
    (np.savez_compressed if compressed else np.savez)(path, **sources)
    got = read_arrays(opener(path), ".npz")
    assert list(got) == list(sources)
    for key, source in sources.items():
        _same_bits(got[key], source)


@pytest.mark.parametrize("opener", OPENERS, ids=["path", "file", "bytes"])
def test_pt_state_dict_bit_for_bit(tmp_path, opener):
    sources = _sources()
    state = {k: torch.from_numpy(v.copy(order="C")) for k, v in sources.items()}
    state["transposed"] = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    state["weight"] = torch.nn.Parameter(torch.ones(2, 2))
    path = tmp_path / "a.pt"
    torch.save(state, path)
    got = read_arrays(opener(path), ".pt")
    assert list(got) == list(state)
    for key, source in sources.items():
        _same_bits(got[key], source)
    np.testing.assert_array_equal(got["transposed"], np.arange(12, dtype=np.int32).reshape(3, 4).T)
    _same_bits(got["weight"], np.ones((2, 2), np.float32))


def test_pt_bare_tensor(tmp_path):
    path = tmp_path / "t.pt"
    torch.save(torch.arange(5, dtype=torch.uint8), path)
    _same_bits(read_arrays(path, ".pt")["array"], np.arange(5, dtype=np.uint8))


@pytest.mark.parametrize("opener", OPENERS, ids=["path", "file", "bytes"])
def test_pickled_object_array_is_refused(tmp_path, opener):
    objects = np.array([{"a": 1}, "text", None], dtype=object)
    npy, npz = tmp_path / "o.npy", tmp_path / "o.npz"
    np.save(npy, objects, allow_pickle=True)
    np.savez(npz, fine=np.ones(3), objects=objects)
    with pytest.raises(DecodeError, match=_PICKLE):
        read_arrays(opener(npy), ".npy")
    with pytest.raises(DecodeError, match=_PICKLE):
        read_arrays(opener(npz), ".npz")


class _Payload:
    """Stands for anything a pickle could rebuild (and so run code for)."""

    ran = False

    def __reduce__(self):
        return (_Payload._run, ())

    @staticmethod
    def _run():
        _Payload.ran = True
        return "ran"


def test_plain_pickle_is_never_unpickled(tmp_path):
    path = tmp_path / "evil.npy"
    path.write_bytes(pickle.dumps(_Payload()))
    for src in (io.BytesIO(path.read_bytes()), path):
        with pytest.raises(DecodeError, match="not a .npy file|not a valid .npy file"):
            read_arrays(src, ".npy")
    with pytest.raises(DecodeError, match="not a valid .npz file"):
        read_arrays(io.BytesIO(path.read_bytes()), ".npz")
    assert not _Payload.ran


def test_pt_with_arbitrary_objects_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.ones(2), "payload": _Payload()}, path)
    with pytest.raises(DecodeError, match="not a weights-only .pt file.*need pickle"):
        read_arrays(path, ".pt")
    assert not _Payload.ran


def test_pt_values_must_be_tensors(tmp_path):
    path = tmp_path / "mixed.pt"
    torch.save({"weight": torch.ones(2), "step": 3}, path)
    with pytest.raises(DecodeError, match="'step' holds int, not a tensor"):
        read_arrays(path, ".pt")


def test_corrupt_and_unknown_files(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.arange(1000, dtype=np.float64))
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])  # header intact, data cut short
    for src in (path, io.BytesIO(path.read_bytes())):
        with pytest.raises(DecodeError, match="not a valid .npy file"):
            read_arrays(src, ".npy")
    with pytest.raises(DecodeError, match="not a valid .npz file"):
        read_arrays(io.BytesIO(b"PK\x03\x04 not really a zip"), ".npz")
    with pytest.raises(DecodeError, match="not a weights-only .pt file"):
        read_arrays(io.BytesIO(b"garbage"), ".pt")
    with pytest.raises(DecodeError, match="not a valid .pt file"):
        read_arrays(io.BytesIO(b"PK\x03\x04 not really a zip"), ".pt")
    with pytest.raises(DecodeError, match="unsupported array file '.csv'"):
        read_arrays(io.BytesIO(b"1,2"), ".csv")
    empty = tmp_path / "empty.npz"
    np.savez(empty)
    with pytest.raises(DecodeError, match="no arrays"):
        read_arrays(empty, ".npz")


def test_missing_file_is_a_read_error_not_a_decode_error(tmp_path):
    for suffix in (".npy", ".npz", ".pt"):
        with pytest.raises(FileNotFoundError):
            read_arrays(str(tmp_path / f"missing{suffix}"), suffix)


def test_layout_and_check():
    first = {"feature": np.zeros((3, 5), np.float32), "label": np.array(4, np.int64)}
    layout = array_layout(first)
    assert layout == {"feature": ArraySpec(np.dtype(np.float32), (3, 5)),
                      "label": ArraySpec(np.dtype(np.int64), ())}
    assert layout["feature"].nbytes == 60 and layout["label"].nbytes == 8
    check(first, layout)
    check({"label": np.array(9, np.int64), "feature": np.ones((3, 5), np.float32)}, layout)

    with pytest.raises(DecodeError) as info:
        check({"feature": np.zeros((3, 6), np.float32), "label": first["label"]}, layout)
    message = str(info.value)
    assert "'feature'" in message and "[3, 6]" in message and "[3, 5]" in message

    with pytest.raises(DecodeError) as info:
        check({"feature": np.zeros((3, 5), np.float64), "label": first["label"]}, layout)
    message = str(info.value)
    assert "'feature'" in message and "float64" in message and "float32" in message

    with pytest.raises(DecodeError, match="keys .*'mask'.* differ"):
        check({**first, "mask": np.ones(2, bool)}, layout)
    with pytest.raises(DecodeError, match="keys .* differ"):
        check({"feature": first["feature"]}, layout)


def test_pt_legacy_format(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.arange(4, dtype=torch.float64)}, path,
               _use_new_zipfile_serialization=False)
    _same_bits(read_arrays(path, ".pt")["w"], np.arange(4, dtype=np.float64))


class _Garbage:
    """A cycle with a finaliser: collecting it runs Python code, where threads switch."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        sum(range(50))


def test_headers_parsed_by_many_threads_at_once_never_fail_a_good_file(tmp_path):
    """Decode threads read headers together. numpy parses them with ast, whose
    recursion count CPython 3.11 shares between threads: a thread switch in the
    middle (here forced by finalisers and a tiny switch interval) used to fail a
    good file with "SystemError: AST constructor recursion depth mismatch"."""
    np.savez(tmp_path / "a.npz", x=np.arange(4, dtype=np.float32))
    npz = (tmp_path / "a.npz").read_bytes()
    failures = []

    def read_many(depth):
        if depth:  # threads at different stack depths, as a server's are
            return read_many(depth - 1)
        for _ in range(300):
            _Garbage()
            try:
                read_arrays(io.BytesIO(npz), ".npz")
            except Exception as e:  # noqa: BLE001 (the bug is a SystemError)
                failures.append(e)
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=read_many, args=(4 * i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
