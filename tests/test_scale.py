"""Many trainers, many servers: static scale-out, shared jobs, fair decode."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from gpufeed.client import FeedClient, FeedError
from gpufeed.server.process import ServerProcess


def _indices(loader) -> list[int]:
    return [i for b in loader for i in b["index"].tolist()]


def test_an_epoch_spread_over_two_servers(server_pair, image_names):
    two_servers = server_pair
    files = image_names[:100]
    with FeedClient([s.address for s in two_servers]) as feed:
        loader = feed.loader(files=files, batch_size=8, size=(16, 16), shuffle=True, seed=4,
                             rank=1, world_size=2)
        first = _indices(loader)
        loader.set_epoch(0)
        again = _indices(loader)
        alone = _indices(FeedClient(two_servers[0].address).loader(
            files=files, batch_size=8, size=(16, 16), shuffle=True, seed=4, rank=1, world_size=2))
    assert sorted(first) == list(range(1, 100, 2))  # rank 1's shard, every sample once
    assert again == first  # a static split: deterministic
    assert alone == first  # and the order one server gives


def test_a_server_killed_mid_epoch_has_its_batches_made_by_the_other(two_servers, image_names):
    files = image_names[:120]
    with FeedClient([s.address for s in two_servers]) as feed:
        expected = _indices(feed.loader(files=files, batch_size=8, size=(16, 16), prefetch=1))
        loader = feed.loader(files=files, batch_size=8, size=(16, 16), prefetch=1,
                             reconnect_timeout=30)
        received = []
        for k, batch in enumerate(loader):
            received += batch["index"].tolist()
            if k == 3:
                two_servers[1].proc.send_signal(signal.SIGKILL)
                two_servers[1].proc.wait()
    assert sorted(received) == list(range(120))
    assert received == expected  # the same order: the lost batches made elsewhere


@pytest.mark.parametrize("saved_on, resumed_on", [(2, 2), (1, 2), (2, 1)])
def test_a_position_resumes_with_another_number_of_servers(server_pair, image_names, saved_on,
                                                           resumed_on):
    """The pass's order does not depend on the number of servers, and the position is
    counted in samples of it: save with one server, resume with two (and back), or
    with two and two."""
    options = dict(files=image_names[:100], batch_size=8, size=(8, 8), shuffle=True, seed=6,
                   epoch=3)
    addresses = [s.address for s in server_pair]
    with FeedClient(addresses[:saved_on]) as feed:
        full = _indices(feed.loader(**options))
        partial = feed.loader(**options)
        taken = []
        for k, batch in enumerate(partial):
            taken += batch["index"].tolist()
            if k == 4:
                break
        state = partial.state_dict()
        assert state["samples_consumed"] == 40
    with FeedClient(addresses[:resumed_on]) as feed:
        assert _indices(feed.loader(**options)) == full  # one order, whatever the servers
        resumed = feed.loader(**options)
        resumed.load_state_dict(state)
        assert taken + _indices(resumed) == full
    assert sorted(full) == list(range(100))


def _consume(feed, files, job, received, delay=0.0):
    loader = feed.loader(files=files, batch_size=4, size=(8, 8), job=job, prefetch=1)
    for batch in loader:
        received.append(batch["index"].tolist())
        if delay:
            time.sleep(delay)  # a slow trainer: the stimulus, not a synchronisation


def test_shared_job_gives_every_sample_once_and_spares_the_fast(feed, image_names):
    files = image_names[:160]
    received = {name: [] for name in ("slow", "fast1", "fast2")}
    threads = [threading.Thread(target=_consume, args=(feed, files, "job-a", received[name],
                                                       0.3 if name == "slow" else 0.0))
               for name in received]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    everything = sorted(i for batches in received.values() for b in batches for i in b)
    assert everything == list(range(160))  # 40 batches between three consumers, each once
    slow, fast = len(received["slow"]), [len(received["fast1"]), len(received["fast2"])]
    assert slow < min(fast), (slow, fast)
    assert sum(fast) >= 2 * slow  # the fast were not held to the slow one's pace


def test_a_job_consumer_with_another_request_is_refused(feed, image_names):
    first = iter(feed.loader(files=image_names[:40], batch_size=4, size=(8, 8), job="job-b"))
    next(first)
    with pytest.raises(FeedError) as info:
        _indices(feed.loader(files=image_names[:40], batch_size=8, size=(8, 8), job="job-b"))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "job 'job-b'" in str(info.value)
    first.close()


def test_a_stream_with_many_credits_does_not_starve_one_with_few(data_dir, image_names):
    """Decode threads serve streams in turn, whatever each has queued."""
    big_files = image_names * 10  # 3000 samples: longer than the small stream by far
    with ServerProcess(["--data-root", str(data_dir), "--threads", "2"]) as server, \
            FeedClient(server.address) as feed:
        big = iter(feed.loader(files=big_files, batch_size=32, size=(16, 16), prefetch=16))
        next(big)  # its 16 batches (512 rows) are queued now
        small_done = threading.Event()
        big_batches_meanwhile = []

        def drain_big():
            for batch in big:
                if small_done.is_set():
                    return
                big_batches_meanwhile.append(len(batch["index"]))

        runner = threading.Thread(target=drain_big)
        runner.start()
        small = _indices(feed.loader(files=image_names[:160], batch_size=32, size=(16, 16),
                                     prefetch=1))
        small_done.set()
        runner.join(120)
    assert sorted(small) == list(range(160))
    # Served in turn, the big stream decodes about as much as the small one meanwhile
    # (5 batches, plus what it had queued); first come first served, it would decode
    # its whole queue before each small batch: 5 x 16 = 80 batches.
    assert len(big_batches_meanwhile) <= 40, len(big_batches_meanwhile)


def test_a_job_consumer_over_its_failure_budget_leaves_the_others_whole(feed, image_names):
    """The batch that ends one consumer (DATA_LOSS) goes back to the job, and another
    consumer, with a budget of its own, receives it: the pass stays whole."""
    files = ["missing-a.jpg"] + image_names[:39]  # batch 0 holds the missing file
    strict = feed.loader(files=files, batch_size=2, size=(8, 8), job="job-c", prefetch=1,
                         failure_budget=0.001)  # 0.1% of 40 samples: not one failure
    with pytest.raises(FeedError) as info:
        next(iter(strict))
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    lenient = feed.loader(files=files, batch_size=2, size=(8, 8), job="job-c", prefetch=1,
                          failure_budget=5)
    assert sorted(_indices(lenient)) == list(range(1, 40))
    assert lenient.failures == [(0, "missing-a.jpg: file not found")]
