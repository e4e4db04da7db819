"""``SampleFailure``: a sample the server left out of its batch, and why.

``loader.failures`` lists the current pass's. Each is the ``(index, reason)``
pair it has always been (``dict(loader.failures)`` maps index to reason;
``reason`` is "<path>: <what went wrong>", for people), and also carries
``category``: why, as a name a program can branch on, the one the server's
``gpufeed_sample_failures_total`` counts by. The names are
``gpufeed.v1.vocabulary.FAILURE_CATEGORIES`` ("not_found",
"permission_denied", "unreadable", "undecodable", "too_large", "timeout",
"internal", "transform"), or "unspecified" from a server older than categories.
"""

from __future__ import annotations

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import failure_category_name

__all__ = ["SampleFailure"]


class SampleFailure(tuple):
    """``(index, reason)``, with ``category`` beside them (not part of the pair)."""

    category: str

    def __new__(cls, index: int, reason: str, category: str) -> SampleFailure:
        failure = super().__new__(cls, (index, reason))
        failure.category = category
        return failure

    @classmethod
    def from_wire(cls, failure: feed_pb2.SampleFailure) -> SampleFailure:
        return cls(failure.index, failure.reason, failure_category_name(failure.category))

    @property
    def index(self) -> int:
        return self[0]

    @property
    def reason(self) -> str:
        return self[1]

    def __getnewargs__(self) -> tuple[int, str, str]:
        return self[0], self[1], self.category

    def __repr__(self) -> str:
        return (f"SampleFailure(index={self[0]}, reason={self[1]!r}, "
                f"category={self.category!r})")
