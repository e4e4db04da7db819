"""An S3 directory's listing against a store that no real one in the tests can play:
one with endless keys (a bucket of a hundred million), keys with ``..`` segments
(SeaweedFS refuses to store them; AWS does not), keys outside the prefix asked for,
and pages that repeat keys as a listing changes under it. The store is a stand-in
for boto3's ``list_objects_v2`` paginator; what is checked is the request's plan
(``plan_stream``), as a client would be answered.
"""

from __future__ import annotations

import itertools

import pytest

from gpufeed.server.config import Limits
from gpufeed.server.serving.errors import Forbidden, LimitExceeded
from gpufeed.server.serving.planning.plan import plan_stream
from gpufeed.server.storage.roots import Storage
from gpufeed.v1 import feed_pb2

pytest.importorskip("boto3")


class _Pages:
    """The stand-in S3 client: ``pages`` for a listing, ``prefixes`` for one with the
    delimiter "/"; the pages taken are counted, the requests kept."""

    def __init__(self, pages, prefixes=()):
        self._pages, self._prefixes = pages, prefixes
        self.taken = 0
        self.asked: list[dict] = []

    def get_paginator(self, operation: str) -> _Pages:
        assert operation == "list_objects_v2"
        return self

    def paginate(self, **kwargs):
        self.asked.append(kwargs)
        for page in self._prefixes if "Delimiter" in kwargs else self._pages:
            self.taken += 1
            yield page


def _page(*keys: str, prefixes: tuple[str, ...] = ()) -> dict:
    return {"Contents": [{"Key": key} for key in keys],
            "CommonPrefixes": [{"Prefix": prefix} for prefix in prefixes]}


def _plan(client: _Pages, files: str = "s3://data/train/val/", max_samples: int = 1000,
          **kwargs):
    storage = Storage(["s3://data/train"], s3_endpoint="http://127.0.0.1:9",
                      read_ahead_bytes=0)
    storage._client = client
    request = feed_pb2.StreamRequest(list_file=files, batch_size=2,
                                     output=feed_pb2.OutputSpec(height=8, width=8),
                                     transport=feed_pb2.TRANSPORT_INLINE, **kwargs)
    try:
        return plan_stream(request, storage, Limits(max_samples=max_samples),
                           (feed_pb2.TRANSPORT_INLINE,))
    finally:
        storage.close()


def test_a_prefix_of_endless_keys_is_refused_at_the_bound_after_few_pages():
    """Pages of 1000 sample keys that never end: the listing stops once the bound is
    passed, three pages in for a bound of 2500, and the request is refused naming it."""
    client = _Pages(_page(*(f"train/val/c/{p:04d}-{k:03d}.jpg" for k in range(1000)))
                    for p in itertools.count())
    with pytest.raises(LimitExceeded) as refused:
        _plan(client, max_samples=2500)
    assert str(refused.value).startswith("samples[0]: ")
    assert "more than 2500 sample files" in str(refused.value)
    assert "--max-samples" in str(refused.value)
    assert client.taken == 3


@pytest.mark.parametrize("key, words", [
    ("train/val/c/../../../other/secret.jpg", ["'..' segment", "never resolved"]),
    ("train/val/../val/c/again.jpg", ["'..' segment"]),
    ("train/elsewhere/x.jpg", ["not under it"]),  # a store answering outside the prefix
])
def test_a_listed_key_that_could_leave_the_prefix_is_refused(key, words):
    with pytest.raises(Forbidden) as refused:
        _plan(_Pages([_page("train/val/c/a.jpg", key)]))
    assert str(refused.value).startswith("samples[0]: ")
    for word in words:
        assert word in str(refused.value)


def test_keys_a_changing_listing_repeats_are_listed_once_in_imagefolder_order():
    """Pages in no particular order (SeaweedFS's is not AWS's), a key on two of them (the
    listing moved between pages), markers ("directories" by a trailing slash only,
    ``x.jpg/`` among them) and a file that is no sample: each sample once, in the order
    of the same tree on disk."""
    pages = [_page("train/val/cat/b.jpg", "train/val/cat/more/deep.JPEG", "train/val/top.jpg",
                   "train/val/cat/a.jpg"),
             _page("train/val/cat-x/s.jpg", "train/val/cat/b.jpg", "train/val/marker/",
                   "train/val/cat/x.jpg/", "train/val/", "train/val/dog/notes.txt")]
    client = _Pages(pages)
    plan = _plan(client)
    assert list(plan.paths) == ["s3://data/train/val/top.jpg", "s3://data/train/val/cat/a.jpg",
                                "s3://data/train/val/cat/b.jpg",
                                "s3://data/train/val/cat/more/deep.JPEG",
                                "s3://data/train/val/cat-x/s.jpg"]
    assert client.asked == [{"Bucket": "data", "Prefix": "train/val/",
                             "PaginationConfig": {"PageSize": 1000}}]


def test_folder_labels_number_the_first_level_prefixes():
    """The classes are the dataset prefix's first-level "directories" (the delimiter's
    common prefixes; a marker's too), sorted as ImageFolder sorts them."""
    client = _Pages([_page("train/val/dog/d.jpg", "train/val/Zebra/z.jpg", "train/val/cat/c.jpg")],
                    prefixes=[_page("train/val/top.jpg", prefixes=("train/val/dog/",
                                                                   "train/val/Zebra/")),
                              _page(prefixes=("train/val/bird/", "train/val/cat/"))])
    plan = _plan(client, label_source=feed_pb2.LABELS_FROM_FOLDER)
    assert plan.classes == ["Zebra", "bird", "cat", "dog"]
    assert plan.labels.tolist() == [0, 2, 3]
