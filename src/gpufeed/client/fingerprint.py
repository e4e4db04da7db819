"""What decides a pass's order and content, so that a saved position proves its request.

A loader's ``state_dict()`` carries the fingerprint of its request, and
``load_state_dict`` refuses a state whose fingerprint differs, naming the
field: a position means nothing for another list, batch size or seed. The
fingerprint holds only what decides which samples a pass holds, in what order
and with what content. Left out: how batches are delivered (transport,
prefetch, compression, which is lossless, the failure budget, how a pass is
split over servers, a shared job, each sample's name beside it), the position
itself, and the split over ranks (rank, world_size): the state carries its
world size, and a loader at another goes on from it (resume.py).

A field added to the request later is its own entry, so it is never left out
by mistake; while it is at its default it matches a state saved before it
existed, which has no such entry.
"""

from __future__ import annotations

import hashlib

from gpufeed.v1 import feed_pb2

__all__ = ["check_fingerprint", "request_fingerprint"]

# Shown as they are, so that a mismatch reads as values.
_VALUES = ("batch_size", "shuffle", "seed", "drop_last")
# Compared by digest, grouped under one name each.
# A sample's fields (mask, boxes, metadata) are its annotations, as labels are: in that
# group, a request without fields keeps the digest states saved before fields existed had.
_GROUPS = {"files": ("files", "list_file", "prefix"),
           "labels": ("labels", "label_source", "fields"),
           "transforms": ("output", "clip")}
# Position, ranks and delivery: not part of what a pass holds.
_DELIVERY = {"epoch", "start_batch", "resumed_from", "rank", "world_size", "transport",
             "prefetch", "compression", "max_failures", "max_failure_fraction", "job", "dealt",
             "names"}
# A request with no value in a group of fields serializes to nothing: its digest.
_NOTHING = hashlib.sha256(b"").hexdigest()[:16]


def request_fingerprint(request: feed_pb2.StreamRequest) -> dict[str, int | bool | str]:
    """Each field that decides order or content: a value, or a digest of a group of fields.

    A request field not named here (added to the proto later) is its own entry,
    so it is never left out by mistake.
    """
    fingerprint: dict[str, int | bool | str] = {name: getattr(request, name) for name in _VALUES}
    grouped = {field for fields in _GROUPS.values() for field in fields}
    groups = {name: list(fields) for name, fields in _GROUPS.items()}
    for field in feed_pb2.StreamRequest.DESCRIPTOR.fields:
        if field.name not in grouped and field.name not in _DELIVERY and \
                field.name not in _VALUES:
            groups[field.name] = [field.name]
    for name, fields in groups.items():
        part = feed_pb2.StreamRequest()
        part.CopyFrom(request)
        for field in feed_pb2.StreamRequest.DESCRIPTOR.fields:
            if field.name not in fields:
                part.ClearField(field.name)
        digest = hashlib.sha256(part.SerializeToString(deterministic=True)).hexdigest()
        fingerprint[name] = digest[:16]
    return fingerprint


def check_fingerprint(saved: dict, ours: dict[str, int | bool | str]) -> None:
    """ValueError naming the first field where a saved state's request differs from ours.

    Entries a state saved by an older gpufeed has and ours has not (rank, world_size,
    compression) no longer decide anything; one ours has and it has not is a field
    added since, which it had at its default (no value)."""
    for name, value in ours.items():
        if saved.get(name, None if name in _VALUES or name in _GROUPS else _NOTHING) != value:
            if name in _VALUES:
                detail = f"it was saved with {name}={saved.get(name)!r}, this loader has {value!r}"
            else:
                detail = f"it was saved with other {name} than this loader's"
            raise ValueError(f"load_state_dict: the state belongs to another request: {name} "
                             f"differs ({detail})")
