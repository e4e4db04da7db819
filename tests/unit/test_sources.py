"""Shared jobs (src/gpufeed/server/serving/running/sources.py) as units: which requests share a job
(the request fingerprint), how a pass is dealt out and given back, and how long
a job without consumers is kept (idle eviction), on a clock the test moves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpufeed.server.serving.running import sources
from gpufeed.server.serving.running.sources import JobRegistry, SharedJob
from gpufeed.v1 import feed_pb2


def _request(job: str = "train", epoch: int = 0, **fields) -> feed_pb2.StreamRequest:
    request = dict(files=feed_pb2.FileList(paths=["a.jpg", "b.jpg", "c.jpg"]), batch_size=1,
                   output=feed_pb2.OutputSpec(height=8, width=8), shuffle=True, seed=3)
    return feed_pb2.StreamRequest(**{**request, **fields}, job=job, epoch=epoch)


def _plan(batches: int) -> SimpleNamespace:
    return SimpleNamespace(batches=range(batches))  # all a job reads of a plan


@pytest.fixture()
def clock(monkeypatch):
    """sources.py's monotonic clock, moved by hand: ``clock.now += seconds``."""
    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(sources, "time", SimpleNamespace(monotonic=lambda: clock.now))
    return clock


def _leave(job: SharedJob) -> None:
    def wake() -> None:
        pass

    job.add_consumer(wake)
    job.remove_consumer(wake)


def test_consumers_of_the_same_request_share_one_job():
    jobs = JobRegistry()
    first = jobs.join(_request(), _plan(3))
    assert jobs.join(_request(), _plan(3)) is first
    assert jobs.join(_request(epoch=1), _plan(3)) is not first  # a job is per epoch
    assert jobs.join(_request(job="val"), _plan(3)) is not first


def test_the_fingerprint_ignores_per_consumer_fields_only():
    """transport, prefetch, start_batch and the failure budget are each consumer's own;
    anything that changes the samples or their content must match."""
    jobs = JobRegistry()
    job = jobs.join(_request(), _plan(3))
    own = dict(transport=feed_pb2.TRANSPORT_SHM, prefetch=4, start_batch=2, max_failures=5,
               max_failure_fraction=0.5)
    assert jobs.join(_request(**own), _plan(3)) is job
    for different in (dict(seed=4), dict(batch_size=2), dict(shuffle=False),
                      dict(output=feed_pb2.OutputSpec(height=8, width=9)),
                      dict(files=feed_pb2.FileList(paths=["a.jpg", "b.jpg"]))):
        # The error type is the service's to map (RequestError today, a domain error
        # later); what a user sees is the message naming the job.
        with pytest.raises(Exception, match="job 'train' epoch 0 was opened with a different"):
            jobs.join(_request(**different), _plan(3))


def test_a_pass_is_dealt_once_and_given_back_batches_come_first():
    job = SharedJob("train", 4, "fingerprint")
    assert [job.claim(), job.claim(), job.claim()] == [0, 1, 2]
    job.give_back([2, 1])  # a consumer left with two claimed, unsent batches
    assert [job.claim(), job.claim(), job.claim(), job.claim()] == [1, 2, 3, None]
    for index in range(3):
        job.sent(index)
    assert not job.finished()
    job.sent(3)
    assert job.finished()


def test_giving_back_and_finishing_wake_every_consumer():
    job = SharedJob("train", 1, "fingerprint")
    woken = []
    job.add_consumer(lambda: woken.append("a"))
    job.add_consumer(lambda: woken.append("b"))
    job.give_back([job.claim()])
    assert sorted(woken) == ["a", "b"]
    woken.clear()
    job.sent(job.claim())
    assert sorted(woken) == ["a", "b"]


def test_a_job_without_consumers_is_kept_for_ten_minutes_then_forgotten(clock):
    jobs = JobRegistry()
    job = jobs.join(_request(), _plan(5))
    assert job.claim() == 0
    _leave(job)  # its last consumer left: idle from now
    clock.now += 599
    again = jobs.join(_request(), _plan(5))
    assert again is job and again.claim() == 1  # a consumer back in time continues the pass
    _leave(job)
    clock.now += 601
    fresh = jobs.join(_request(), _plan(5))
    assert fresh is not job and fresh.claim() == 0  # forgotten: the pass starts again


def test_a_job_with_a_consumer_is_never_forgotten(clock):
    jobs = JobRegistry()
    job = jobs.join(_request(), _plan(5))
    job.add_consumer(lambda: None)
    clock.now += 10 * 3600
    assert jobs.join(_request(), _plan(5)) is job


def test_idle_jobs_past_the_bound_go_longest_idle_first(clock, monkeypatch):
    monkeypatch.setattr(sources, "_IDLE_KEPT", 2)
    jobs = JobRegistry()
    idle = []
    for name in ("a", "b", "c"):
        job = jobs.join(_request(job=name), _plan(2))
        _leave(job)
        idle.append(job)
        clock.now += 1
    jobs.join(_request(job="d"), _plan(2))  # a new job: the bound is applied
    assert jobs.join(_request(job="a"), _plan(2)) is not idle[0]  # idle longest: forgotten
    assert jobs.join(_request(job="c"), _plan(2)) is idle[2]
