"""The facts of the wire that the proto cannot say, shared by server and client.

feed.proto says what the messages hold; this module says what their names and
numbers mean where both sides must agree and the proto has no place for it:

* how transports and failure categories are named in arguments, logs and
  metric labels (``"shm"``, ``"not_found"``): the enum value's name, lower
  case, without its prefix;
* which dtype names a ``TensorMeta`` or ``OutputSpec.dtype`` may carry, and
  the numpy dtype that carries each in memory: numpy has no bfloat16, so a
  bfloat16 array is stored and sent as uint16 bits and the client views them
  as torch.bfloat16;
* where arrays start: inline arrays at multiples of ``INLINE_ALIGN`` bytes of
  ``Batch.data``, slot arrays at multiples of ``SLOT_ALIGN`` bytes of their
  slot, so either side can view any dtype in place;
* the directory POSIX shared memory lives in, where the server creates a
  stream's segment and the client maps it by the header's ``shm_name``;
* the words of a status's details the client acts on, where the status code
  alone cannot tell two cases apart (``UNREAD``, ``NO_SLOT_MEMORY``).

Both ``gpufeed.server`` and ``gpufeed.client`` import it; it needs only numpy
and the generated stubs, as the client does.
"""

from __future__ import annotations

import numpy as np

from . import feed_pb2

__all__ = ["BFLOAT16", "FAILURE_CATEGORIES", "INLINE_ALIGN", "LANE_MESSAGE_BYTES",
           "NO_SLOT_MEMORY", "OUTPUT_DTYPES",
           "SHM_DIR", "SLOT_ALIGN", "TRANSPORTS", "UNHANDED", "UNREAD", "carrier_dtype",
           "failure_category_name", "transport_name", "wire_text"]


def _names(enum, prefix: str) -> dict[str, int]:
    return {name.removeprefix(prefix).lower(): value for name, value in enum.items()}


# The transports a stream can use, by the name a trainer passes (auto is not one:
# the client resolves it before it asks).
TRANSPORTS: dict[str, int] = {name: value for name, value in
                              _names(feed_pb2.Transport, "TRANSPORT_").items() if name != "auto"}
# Why a sample failed, by the name the client lists and the metric counts
# (unspecified, from a server older than the field, is not one).
FAILURE_CATEGORIES: dict[str, int] = {
    name: value for name, value in _names(feed_pb2.FailureCategory, "FAILURE_").items()
    if name != "unspecified"}

# What OutputSpec.dtype may ask for ("" is uint8).
OUTPUT_DTYPES = ("uint8", "float32", "float16", "bfloat16")
BFLOAT16 = "bfloat16"

INLINE_ALIGN = 64
SLOT_ALIGN = 4096
SHM_DIR = "/dev/shm"
# The largest message either side sends on a stream's lane (StreamHeader.lane_name):
# a batch's message over it goes on the call (OnCall), so a lane never truncates.
LANE_MESSAGE_BYTES = 1 << 16

# In an UNAVAILABLE lease timeout's details: the trainer never read the stream (a
# loader opened ahead, not iterated yet). Routine: the client reopens it quietly.
UNREAD = "the trainer has read no batch of this stream"
# The same for a dealt stream its client handed no batch for a lease timeout (a
# loader opened ahead, or a server the others outpace): the client reopens it.
UNHANDED = "the client handed no batch"
# How a RESOURCE_EXHAUSTED refusal begins when the server has no /dev/shm or device
# memory for the stream's slots (not its budget or stream count): the cue for the
# client's transport ``auto`` to ask again inline.
NO_SLOT_MEMORY = "no memory for this stream's"


def transport_name(transport: int) -> str:
    """``feed_pb2.TRANSPORT_SHM`` -> ``"shm"``."""
    return feed_pb2.Transport.Name(transport).removeprefix("TRANSPORT_").lower()


def failure_category_name(category: int) -> str:
    """``feed_pb2.FAILURE_NOT_FOUND`` -> ``"not_found"``."""
    return feed_pb2.FailureCategory.Name(category).removeprefix("FAILURE_").lower()


def carrier_dtype(name: str) -> np.dtype:
    """The numpy dtype holding a wire dtype's bytes: itself, or uint16 for bfloat16."""
    return np.dtype(np.uint16) if name == BFLOAT16 else np.dtype(name)


def wire_text(text: str) -> str:
    """``text`` as a protobuf string or a gRPC status can carry it: valid UTF-8.

    A path made from a file name that is not UTF-8 holds lone surrogates (the
    server keeps such names as Python's ``surrogateescape`` makes them, so the file
    can still be opened); they are written as ``\\udcff``-style escapes here, so a
    failure's reason or a refusal naming such a file still arrives, readable.
    """
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
