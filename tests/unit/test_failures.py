"""Failures as data and errors as types, without a process: the sample failure's category,
the status code each refusal and stream end gets at the gRPC edge, the wire vocabulary."""

from __future__ import annotations

import errno
import pickle

import grpc
import numpy as np
import pytest
import torch

from gpufeed.client import SampleFailure
from gpufeed.server.media.decode import DecodeError, OverLimit
from gpufeed.server.memory.budget import MemoryExhausted
from gpufeed.server.serving import errors
from gpufeed.server.serving.edge.service import _status
from gpufeed.server.serving.failures import sample_failure
from gpufeed.server.storage.paths import FileTooLarge, OutsideDataRoots
from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import (
    FAILURE_CATEGORIES,
    TRANSPORTS,
    carrier_dtype,
    failure_category_name,
)


@pytest.mark.parametrize("error, category", [
    (FileNotFoundError(errno.ENOENT, "No such file"), feed_pb2.FAILURE_NOT_FOUND),
    (PermissionError(errno.EACCES, "Permission denied"), feed_pb2.FAILURE_PERMISSION_DENIED),
    (OutsideDataRoots("'x.jpg' resolves outside the data roots"),
     feed_pb2.FAILURE_PERMISSION_DENIED),
    (FileTooLarge("file of 9 bytes, over the limit of 8"), feed_pb2.FAILURE_TOO_LARGE),
    (OverLimit("image declares 9x9 pixels, over the limit of 80"), feed_pb2.FAILURE_TOO_LARGE),
    (TimeoutError(errno.ETIMEDOUT, "Connection timed out"), feed_pb2.FAILURE_TIMEOUT),
    (OSError(errno.ETIMEDOUT, "Connection timed out"), feed_pb2.FAILURE_TIMEOUT),
    (OSError(errno.EIO, "Input/output error"), feed_pb2.FAILURE_UNREADABLE),
    (DecodeError("not a decodable image"), feed_pb2.FAILURE_UNDECODABLE),
    (ZeroDivisionError("a bug"), feed_pb2.FAILURE_INTERNAL),
])
def test_a_sample_error_is_classified_by_its_type(error, category):
    got, detail = sample_failure(error, 0, "/data/x.jpg")
    assert got == category
    assert detail  # a person still gets a sentence


@pytest.mark.parametrize("error, code", [
    # The codes clients saw before the exceptions were the serving code's own.
    (errors.InvalidRequest("batch_size must be positive, got 0"),
     grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound("list_file: 'x' not found"), grpc.StatusCode.NOT_FOUND),
    (errors.Forbidden("samples[0]: outside"), grpc.StatusCode.PERMISSION_DENIED),
    (errors.LimitExceeded("samples: over --max-samples"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (MemoryExhausted("memory: needs more"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unsupported("compression: needs zstandard"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.LeaseExpired("lease timeout"), grpc.StatusCode.UNAVAILABLE),
    (errors.Draining("shutting down"), grpc.StatusCode.UNAVAILABLE),
    (errors.FailureBudgetSpent("11 samples failed"), grpc.StatusCode.DATA_LOSS),
    (errors.BadClientMessage("open: another"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ServerFault("server error"), grpc.StatusCode.INTERNAL),
    (errors.ClientGone(), None),
])
def test_only_the_grpc_edge_picks_status_codes(error, code):
    assert _status(error) == code
    if isinstance(error, errors.StreamEnded):  # raised again as a fresh exception, same kind
        again = error.again()
        assert type(again) is type(error) and str(again) == str(error) and again is not error


def test_a_refusal_carries_the_field_its_message_names():
    assert errors.InvalidRequest("output.dtype must be one of uint8").field == "output.dtype"
    assert errors.Forbidden("samples[3]: 'x' is not under a data root").field == "samples"
    assert errors.LimitExceeded("no memory for slots", field="transport").field == "transport"


def test_the_wire_vocabulary():
    assert TRANSPORTS == {"inline": feed_pb2.TRANSPORT_INLINE, "shm": feed_pb2.TRANSPORT_SHM,
                          "cuda_ipc": feed_pb2.TRANSPORT_CUDA_IPC}
    assert "unspecified" not in FAILURE_CATEGORIES
    assert failure_category_name(feed_pb2.FAILURE_TOO_LARGE) == "too_large"
    assert carrier_dtype("bfloat16") == np.uint16  # numpy has none: the bits travel as uint16
    assert carrier_dtype("float32").itemsize == torch.float32.itemsize


def test_a_client_failure_is_still_an_index_reason_pair():
    failure = SampleFailure.from_wire(feed_pb2.SampleFailure(
        index=3, reason="a.jpg: file not found", category=feed_pb2.FAILURE_NOT_FOUND))
    assert failure == (3, "a.jpg: file not found")
    assert dict([failure]) == {3: "a.jpg: file not found"}
    assert (failure.index, failure.reason, failure.category) == (3, "a.jpg: file not found",
                                                                 "not_found")
    copied = pickle.loads(pickle.dumps(failure))
    assert copied == failure and copied.category == "not_found"
    older = SampleFailure.from_wire(feed_pb2.SampleFailure(index=1, reason="b.jpg: ..."))
    assert older.category == "unspecified"  # from a server older than categories
