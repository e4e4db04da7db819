"""A list file, or a directory tree, is read once for every stream of a server that names
it, kept read-only while streams use it, and counted once in the memory budget.

The server tests watch ``gpufeed_list_parses_total`` (what was read) and
``gpufeed_shared_lists`` (what is kept) on a real server's /metrics. The list
files and directories they write are dated an hour back (``_age``): a list
changed within the last two seconds is read for each stream alone
(serving/planning/lists.py: too fresh to trust its timestamps), and a real rewrite moves
the mtime forward again. The rest drive ``SharedLists`` and the parser directly:
one read for concurrent askers, the idle drop observed in the memory budget,
and the fast parse against the line-at-a-time reference on random and hostile
lists.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import socket
import threading
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufeed.client import FeedClient, FeedError
from gpufeed.server.config import Limits
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess
from gpufeed.server.storage.roots import Storage
from gpufeed.v1 import feed_pb2
from support import wait_until

_IMAGES = 24
_METRICS_LINE = re.compile(r"gpufeed-server metrics on http://(\S+)/metrics")
_AN_HOUR_AGO = 3600 * 10**9


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lists")
    rng = np.random.default_rng(5)
    for i in range(_IMAGES):
        (root / f"img{i:02d}.jpg").write_bytes(encode_jpeg(synthetic_photo(rng, 16, 20)))
    return root


def _images(count: int, start: int = 0) -> list[str]:
    return [f"img{i:02d}.jpg" for i in range(start, start + count)]


def _age(*paths: Path, back: int = _AN_HOUR_AGO) -> None:
    """Date ``paths`` ``back`` ns ago (mtime; the ctime stays now)."""
    when = _now_ns() - back
    for path in paths:
        os.utime(path, ns=(when, when))


def _now_ns() -> int:
    import time

    return time.time_ns()


def _write_list(path: Path, lines: list[str], back: int = _AN_HOUR_AGO) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    _age(path, back=back)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(root: Path, *extra: str):
    """A server on ``root`` with /metrics; yields (its address, its metrics address)."""
    for _ in range(3):
        server = ServerProcess(["--data-root", str(root), "--threads", "2", *extra,
                                "--metrics-port", str(_free_port())])
        try:
            server.start()
            break
        except RuntimeError as e:  # another process took the port first
            if "cannot serve metrics" not in str(e):
                raise
    else:
        raise RuntimeError("no free metrics port after 3 tries")
    try:
        match = next(filter(None, map(_METRICS_LINE.search, server.log)))
        yield server.address, match.group(1)
    finally:
        server.stop()


def _metric(metrics: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"no {name}{labels} on /metrics")


def _parses(metrics: str, kind: str = "list_file") -> float:
    return _metric(metrics, "gpufeed_list_parses_total", kind=kind)


@pytest.fixture(scope="module")
def served(root):
    with _server(root) as addresses:
        yield addresses


def _pass(feed: FeedClient, files, **options) -> list[dict]:
    return [{key: value.tolist() for key, value in batch.items()
             if key in ("index", "label", "padded")}
            for batch in feed.loader(files, size=8, **options)]


def test_a_list_is_parsed_once_for_every_stream_that_names_it(root, served):
    """Four ranks opening together, then one more later: one parse, one kept list."""
    address, metrics = served
    names = _images(_IMAGES)
    _write_list(root / "ranks.flist", [f"{name}\t{i}" for i, name in enumerate(names)])
    before = _parses(metrics)
    results: list[list[dict]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def rank(r: int) -> None:
        with FeedClient(address) as feed:
            start.wait()
            results[r] = _pass(feed, "ranks.flist", labels="list_file", batch_size=3,
                               shuffle=True, seed=2, rank=r, world_size=4)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    served_labels = sorted(label for batches in results for b in batches for label in b["label"])
    assert served_labels == list(range(_IMAGES))  # every rank its own part, each sample once
    with FeedClient(address) as feed:
        again = _pass(feed, "ranks.flist", labels="list_file", batch_size=3, shuffle=True,
                      seed=2, rank=1, world_size=4)
    assert again == results[1]
    assert _parses(metrics) - before == 1
    assert _metric(metrics, "gpufeed_shared_lists") >= 1
    assert _metric(metrics, "gpufeed_shared_list_bytes") > 0


@pytest.mark.slow
def test_a_rewritten_list_is_parsed_again_and_its_new_lines_served(root):
    path = _write_list(root / "changing.flist", [f"{n}\t{i}" for i, n in enumerate(_images(4))])
    with _server(root) as (address, metrics), FeedClient(address) as feed:
        (first,) = _pass(feed, "changing.flist", labels="list_file", batch_size=8)
        assert first["label"] == [0, 1, 2, 3]
        # The same path, rewritten in place (its inode kept): other lines, other labels.
        _write_list(path, [f"{n}\t{10 + i}" for i, n in enumerate(_images(6, start=4))],
                    back=_AN_HOUR_AGO // 2)
        (second,) = _pass(feed, "changing.flist", labels="list_file", batch_size=8)
        assert second["label"] == [10, 11, 12, 13, 14, 15]
        (third,) = _pass(feed, "changing.flist", labels="list_file", batch_size=8)
        assert third == second
        assert _parses(metrics) == 2
        # The first version was dropped, its stream over: one list is kept, the new one.
        assert _metric(metrics, "gpufeed_shared_lists") == 1


def test_a_listed_tree_is_kept_until_a_file_is_added(root, served):
    address, metrics = served
    tree = root / "tree"
    for folder, count in (("cat", 2), ("dog", 1)):
        (tree / folder).mkdir(parents=True)
        for i in range(count):
            os.link(root / f"img{i:02d}.jpg", tree / folder / f"{i}.jpg")
    _age(tree, tree / "cat", tree / "dog")
    before = _parses(metrics, "directory")
    with FeedClient(address) as feed:
        labels = [_pass(feed, "tree/", labels="folder", batch_size=8)[0]["label"]
                  for _ in range(2)]
        assert labels == [[0, 0, 1]] * 2
        assert _parses(metrics, "directory") - before == 1
        os.link(root / "img05.jpg", tree / "dog" / "5.jpg")  # dog's mtime moves to now
        (batch,) = _pass(feed, "tree/", labels="folder", batch_size=8)
        assert batch["label"] == [0, 0, 1, 1]
        assert _parses(metrics, "directory") - before == 2
        # Changed within the last seconds, tree/dog's timestamps cannot tell a second change
        # yet: each stream lists it, until it is older (dated back here) ...
        (batch,) = _pass(feed, "tree/", labels="folder", batch_size=8)
        assert _parses(metrics, "directory") - before == 3
        _age(tree / "dog")
        for name in ("tree/", "./tree"):  # ... then it is kept, however it is named
            (batch,) = _pass(feed, name, labels="folder", batch_size=8)
            assert batch["label"] == [0, 0, 1, 1]
        assert _parses(metrics, "directory") - before == 4


def test_order_labels_and_resume_are_those_of_the_same_names_given_inline(root, served):
    """The shared list changes where the names come from, not which batch holds what."""
    address, _ = served
    names = _images(_IMAGES)
    _write_list(root / "order.flist", [f"{name} {100 - i}" for i, name in enumerate(names)])
    options = dict(batch_size=5, shuffle=True, seed=11, epoch=3, rank=1, world_size=3)
    with FeedClient(address) as feed:
        inline = _pass(feed, names, labels=[100 - i for i in range(_IMAGES)], **options)
        listed = _pass(feed, "order.flist", labels="list_file", **options)
        assert listed == inline
        first = feed.loader("order.flist", labels="list_file", size=8, **options)
        before = []
        for batch in first:
            before.append({key: batch[key].tolist() for key in ("index", "label", "padded")})
            if len(before) == 1:
                break
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        resumed = feed.loader("order.flist", labels="list_file", size=8,
                              **{**options, "epoch": 0})
        resumed.load_state_dict(state)
        after = [{key: b[key].tolist() for key in ("index", "label", "padded")} for b in resumed]
    assert before + after == listed


def test_a_shared_list_counts_once_against_max_memory_bytes(root, tmp_path):
    """Four ranks of a 100,000-line list in a budget that holds the list once, not twice:
    each stream's plan counts its own order, the list once. (Each line names one of a
    few real files by a long path: ~8 MB of names and labels as kept.)"""
    folder = tmp_path / ("a-folder-with-a-name-long-enough-to-weigh" + "-x" * 8)
    folder.mkdir()
    for i in range(4):
        os.link(root / f"img{i:02d}.jpg", folder / f"img{i}.jpg")
    lines = [f"{folder.name}/img{i % 4}.jpg\t{i % 1000}" for i in range(100_000)]
    _write_list(tmp_path / "big.flist", lines)
    with _server(tmp_path, "--max-memory-bytes", str(12 << 20)) as (address, metrics), \
            FeedClient(address) as feed:
        loaders = [feed.loader("big.flist", labels="list_file", batch_size=2, size=8,
                               prefetch=1, shuffle=True, rank=r, world_size=4)
                   for r in range(4)]  # each opens its stream, and holds it
        assert [len(loader) for loader in loaders] == [12_500] * 4
        assert _metric(metrics, "gpufeed_active_streams", transport="shm") == 4
        assert _parses(metrics) == 1
        kept = _metric(metrics, "gpufeed_shared_list_bytes")
        assert 7 << 20 < kept < 9 << 20
        for loader in loaders:
            loader.close()


def test_a_list_over_the_budget_is_refused_naming_the_flag(tmp_path):
    _write_list(tmp_path / "big.flist", [f"x/img{i:07d}.jpg" for i in range(100_000)])
    with _server(tmp_path, "--max-memory-bytes", str(1 << 20)) as (address, _), \
            FeedClient(address) as feed:
        with pytest.raises(FeedError) as refused:
            feed.loader("big.flist", batch_size=2, size=8)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-memory-bytes" in str(refused.value)


# -- SharedLists itself ------------------------------------------------------------


def _request(list_file: str, **fields) -> feed_pb2.StreamRequest:
    return feed_pb2.StreamRequest(list_file=list_file, batch_size=2,
                                  output=feed_pb2.OutputSpec(height=8, width=8), **fields)


class _CountingStorage(Storage):
    """Local storage whose list reads are counted, and wait for ``go`` when it is given."""

    def __init__(self, root: Path, go: threading.Event | None = None):
        super().__init__([str(root)])
        self.reads = 0
        self.reading = threading.Event()
        self._go = go

    def read(self, path, max_bytes=None, flag="--max-file-bytes"):
        self.reads += 1
        self.reading.set()
        if self._go is not None:
            assert self._go.wait(30)
        return super().read(path, max_bytes, flag)


def test_streams_asking_for_a_list_being_read_wait_for_that_read(tmp_path):
    from gpufeed.server.memory.budget import MemoryBudget
    from gpufeed.server.serving.planning.lists import SharedLists
    from gpufeed.server.serving.planning.plan import plan_stream

    _write_list(tmp_path / "a.flist", _images(10))
    go = threading.Event()
    storage = _CountingStorage(tmp_path, go)
    budget = MemoryBudget(1 << 30)
    lists = SharedLists(budget)
    plans: dict[int, object] = {}

    def plan(rank: int) -> None:
        plans[rank] = plan_stream(_request("a.flist", rank=rank, world_size=4), storage,
                                  Limits(), (feed_pb2.TRANSPORT_INLINE,), lists=lists)

    threads = [threading.Thread(target=plan, args=(r,)) for r in range(4)]
    threads[0].start()
    assert storage.reading.wait(30)  # rank 0 reads; the others ask meanwhile
    for thread in threads[1:]:
        thread.start()
    assert wait_until(lambda: lists.waiting() == 4)
    go.set()
    for thread in threads:
        thread.join()
    assert storage.reads == 1 and len(plans) == 4
    names = {id(p.paths.names) for p in plans.values()}  # type: ignore[attr-defined]
    assert len(names) == 1  # one packed list, held by every plan
    assert lists.held() == (1, budget.reserved)
    for p in plans.values():
        p.release()  # type: ignore[attr-defined]


def test_a_read_stops_when_every_stream_waiting_for_it_has_stopped(tmp_path):
    from gpufeed.server.serving.planning.lists import SharedLists
    from gpufeed.server.serving.planning.thread import PlanStopped

    _write_list(tmp_path / "a.flist", _images(10))
    go = threading.Event()
    storage = _CountingStorage(tmp_path, go)
    lists = SharedLists()
    path = storage.locate("a.flist")
    stopped = {0: False, 1: False, 2: False}
    outcome: dict[int, object] = {}

    def ask(who: int) -> None:
        try:
            outcome[who] = lists.list_file(storage, path, False, Limits(),
                                           lambda: stopped[who])
        except PlanStopped as e:
            outcome[who] = e

    first = threading.Thread(target=ask, args=(0,))
    first.start()
    assert storage.reading.wait(30)
    second = threading.Thread(target=ask, args=(1,))
    second.start()
    assert wait_until(lambda: lists.waiting() == 2)
    stopped[0] = True  # the reader's call ended: it reads on for the other
    go.set()
    first.join()
    second.join()
    assert storage.reads == 1 and not isinstance(outcome[1], PlanStopped)
    for hold in outcome.values():
        hold.release()  # type: ignore[attr-defined]
    lists.reclaim()

    go = threading.Event()  # this time the one stream waiting stops: the read stops
    storage = _CountingStorage(tmp_path, go)
    stopped[2] = False
    alone = threading.Thread(target=ask, args=(2,))
    alone.start()
    assert storage.reading.wait(30)
    stopped[2] = True
    go.set()
    alone.join()
    assert isinstance(outcome[2], PlanStopped) and lists.held() == (0, 0)


def test_a_shared_list_is_dropped_after_its_idle_time(tmp_path):
    from gpufeed.server.memory.budget import MemoryBudget
    from gpufeed.server.serving.planning.lists import SharedLists
    from gpufeed.server.serving.planning.plan import plan_stream

    _write_list(tmp_path / "a.flist", _images(10))
    storage = Storage([str(tmp_path)])
    budget = MemoryBudget(1 << 30)
    lists = SharedLists(budget, idle_seconds=3600)

    def plan(rank: int):
        return plan_stream(_request("a.flist", rank=rank, world_size=2), storage, Limits(),
                           (feed_pb2.TRANSPORT_INLINE,), lists=lists)

    plans = [plan(0), plan(1)]
    count, kept = lists.held()
    assert count == 1 and kept > 0 and budget.reserved == kept
    assert all(plan.nbytes < kept for plan in plans)  # a plan counts its own order only
    plans[0].release()
    plans[0].release()  # once is enough
    assert lists.held() == (1, kept)  # the other stream still holds it
    plans[1].release()
    assert lists.held() == (1, kept)  # idle: kept for its idle time
    lists.idle_seconds = 0.1
    again = plan(1)  # held again (its idle time starts over when it is let go)
    assert lists.held() == (1, kept)
    again.release()
    assert wait_until(lambda: lists.held() == (0, 0), timeout=30)  # dropped after 0.1 s idle
    assert budget.reserved == 0


def test_an_idle_list_gives_its_memory_to_a_stream_that_needs_it(tmp_path):
    from gpufeed.server.memory.budget import MemoryBudget
    from gpufeed.server.serving.planning.lists import SharedLists

    _write_list(tmp_path / "a.flist", _images(10))
    storage = Storage([str(tmp_path)])
    budget = MemoryBudget(1 << 20)
    lists = SharedLists(budget)
    budget.reclaim = lists.reclaim
    hold = lists.list_file(storage, storage.locate("a.flist"), False, Limits())
    hold.release()
    kept = budget.reserved
    assert kept > 0 and lists.held()[0] == 1  # idle, kept for 60 s ...
    budget.reserve(budget.limit - kept // 2, "a stream")  # ... unless its room is needed
    assert lists.held() == (0, 0)


def test_a_list_changed_within_the_last_seconds_is_read_for_each_stream(tmp_path):
    from gpufeed.server.serving.planning.lists import SharedLists

    _write_list(tmp_path / "a.flist", _images(10), back=0)  # just written
    storage = _CountingStorage(tmp_path)
    lists = SharedLists()
    path = storage.locate("a.flist")
    holds = [lists.list_file(storage, path, False, Limits()) for _ in range(2)]
    assert storage.reads == 2 and not any(hold.shared for hold in holds)
    assert lists.held() == (0, 0)


# -- the fast parse against the reference ---------------------------------------------


def _outcome(parse, data: bytes, labelled: bool, limit: int):
    from gpufeed.server.serving.planning.listfile import ListFileError

    try:
        names, labels = parse(data, labelled, limit)
    except ListFileError as e:
        return "refused", e.message("the.flist"), e.limit
    return list(names), None if labels is None else labels.tolist()


# What names are made of: the plain pieces of every list, and hostile ones (whitespace
# and line breaks that only str.strip / splitlines know, NUL, digits that are not ASCII,
# labels int() reads but an int64 does not hold).
_PLAIN = ["img", "a", "dir/", "x.jpg", ".JPEG", " ", "my file 3.jpg", "7", "é", "-0"]
_HOSTILE = ["\t", " \t", "-3", "+4", "_1", "٣", "\xa0", "\u2028", "\x85", "\x1f", "\x1c",
            "\x0b", "\x0c", "\r", "\0", "99999999999999999999", "9223372036854775807"]
_PLAIN_LABELS = ["", "0", "-12", "+7", "007", "123456789012345678"]
_HOSTILE_LABELS = ["x", "1_0", "12345678901234567890", "٣", "9223372036854775808", " 5", "-"]
_BAD_BYTES = [b"\xff", b"\xc3", b"\xed\xa0\x80"]


def _random_list(rng: random.Random, hostile: bool) -> bytes:
    """A list of up to 12 lines; ``hostile``: of every kind of piece, and sometimes bytes
    that are not UTF-8."""
    pieces = _PLAIN + _HOSTILE if hostile else _PLAIN
    labels = _PLAIN_LABELS + _HOSTILE_LABELS if hostile else _PLAIN_LABELS
    lines = []
    for _ in range(rng.randint(0, 12)):
        if rng.random() < 0.15:
            lines.append(rng.choice(["", " ", "\t "]))
            continue
        name = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4)))
        label = rng.choice(labels) or str(rng.randint(-50, 50))
        sep = rng.choice(["\t", " ", "  ", " \t ", "\t "])
        if rng.random() < 0.1:  # a path alone
            sep = label = ""
        lines.append(rng.choice(["", " "]) + name + sep + label + rng.choice(["", " ", "\t"]))
    ending = rng.choice(["\n", "\r\n", "\r"] if hostile else ["\n", "\r\n"])
    data = ending.join(lines).encode() + rng.choice([b"", ending.encode()])
    if hostile and rng.random() < 0.1:
        at = rng.randint(0, len(data))
        data = data[:at] + rng.choice(_BAD_BYTES) + data[at:]
    return data


def test_the_fast_parse_is_the_reference_on_random_and_hostile_lists():
    from gpufeed.server.serving.planning.listfile import (
        ListFileError,
        _parse_fast,
        parse_list,
        parse_reference,
    )

    rng = random.Random(20240611)
    for trial in range(4000):
        hostile = trial % 2 == 1
        data = _random_list(rng, hostile)
        labelled = rng.random() < 0.6
        limit = rng.choice([3, 8, 10_000])
        expected = _outcome(parse_reference, data, labelled, limit)
        assert _outcome(parse_list, data, labelled, limit) == expected, (data, labelled, limit)
        try:
            fast = _parse_fast(data, labelled, limit, lambda: False)
        except ListFileError as e:  # it refuses only as the reference does
            assert expected == ("refused", e.message("the.flist"), e.limit), (data, labelled)
            continue
        if fast is not None:
            names, labels = fast
            assert (list(names), None if labels is None else labels.tolist()) == expected, \
                (data, labelled, limit)
        else:  # left to the reference: never a plain list it serves
            assert hostile or expected[0] == "refused", (data, labelled, limit)


@pytest.mark.parametrize("text, labelled, names, labels", [
    ("a.jpg\t1\r\nb c.jpg\t-2\r\n\r\nd.jpg\t+3", True, ["a.jpg", "b c.jpg", "d.jpg"], [1, -2, 3]),
    ("  a.jpg 1  \n\n\tmy file 3.jpg \t 4\nx.jpg 007", True,
     ["a.jpg", "my file 3.jpg", "x.jpg"], [1, 4, 7]),
    ("a.jpg\t 5\nb.jpg\t9223372036854775\n", True, ["a.jpg", "b.jpg"], [5, 9223372036854775]),
    ("café.jpg\nsub dir/b.jpg  \r\n\n", False, ["café.jpg", "sub dir/b.jpg"], None),
    ("", True, [], []),
], ids=["crlf_tabs_signs", "spaces_blanks", "long_label", "utf8_unlabelled", "empty"])
def test_well_formed_lists_are_read_by_the_fast_path(text, labelled, names, labels):
    from gpufeed.server.serving.planning.listfile import _parse_fast, parse_reference

    data = text.encode()
    fast = _parse_fast(data, labelled, 100, lambda: False)
    assert fast is not None
    reference = parse_reference(data, labelled, 100)
    for got in (fast, reference):
        assert list(got[0]) == names
        assert (None if got[1] is None else got[1].tolist()) == labels


@pytest.mark.parametrize("data, labelled, words", [
    (b"a.jpg 99999999999999999999\n", True, ["line 1", "a.jpg 99999999999999999999"]),
    (b"a.jpg\t1\nb.jpg 2\n", True, ["line 2", "path<TAB>integer label"]),
    (b"a\xff.jpg\n", False, ["cannot read 'the.flist'", "can't decode byte 0xff"]),
    (b"a.jpg\t3\n", False, ["'the.flist' has labels"]),
    (b"a.jpg\nb.jpg\nc.jpg\n", False, ["more than 2 samples", "--max-samples 2"]),
], ids=["huge_label", "tab_file_space_line", "not_utf8", "labelled_unasked", "over_limit"])
def test_a_bad_list_is_refused_as_it_always_was(data, labelled, words):
    from gpufeed.server.serving.planning.listfile import ListFileError, parse_list

    with pytest.raises(ListFileError) as refused:
        parse_list(data, labelled, 2)
    for word in words:
        assert word in refused.value.message("the.flist")
