"""The loader's failover (src/gpufeed/client/loader.py) with two real servers: a part whose
server dies moves to the other at its own position, and what arrives there is
what the dead server would have sent (content too, not only indices);
``reconnect_timeout=0`` turns failover off; an error that is not an outage is
never retried elsewhere."""

from __future__ import annotations

import signal

import grpc
import pytest
import torch

from gpufeed.client import FeedClient, FeedError
from gpufeed.server.process import ServerProcess

OPTIONS = dict(batch_size=6, size=(16, 16), shuffle=True, seed=8, resize="random_resized_crop",
               flip=0.5, prefetch=1)


def _kill(server: ServerProcess) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()


def test_a_dead_servers_batches_are_made_by_the_other_with_the_same_content(two_servers,
                                                                            image_names):
    files = image_names[:60]
    with FeedClient([s.address for s in two_servers]) as feed:
        whole = [{k: v.clone() for k, v in b.items()} for b in feed.loader(files=files, **OPTIONS)]
        received = []
        for k, batch in enumerate(feed.loader(files=files, reconnect_timeout=30, **OPTIONS)):
            received.append({k: v.clone() for k, v in batch.items()})
            if k == 2:  # server 1 holds batches it was handed and has not sent
                _kill(two_servers[1])
    assert len(received) == len(whole) == 10
    for got, want in zip(received, whole):
        assert torch.equal(got["index"], want["index"])
        assert torch.equal(got["image"], want["image"])  # same crops and flips elsewhere


def test_reconnect_timeout_zero_fails_instead_of_moving(two_servers, image_names):
    with FeedClient([s.address for s in two_servers]) as feed:
        loader = feed.loader(files=image_names[:60], reconnect_timeout=0, **OPTIONS)
        with pytest.raises(FeedError) as info:
            for k, _ in enumerate(loader):
                if k == 0:
                    _kill(two_servers[1])
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_an_error_that_is_not_an_outage_is_not_retried_elsewhere(two_servers, image_names):
    """Three missing files in batch 0 (server 0's) over a budget of two end that stream
    DATA_LOSS; the other server would say the same, so the loader raises it."""
    files = ["gone1.jpg", "gone2.jpg", "gone3.jpg"] + image_names[:21]
    with FeedClient([s.address for s in two_servers]) as feed:
        loader = feed.loader(files=files, reconnect_timeout=30, failure_budget=2,
                             **{**OPTIONS, "shuffle": False})
        with pytest.raises(FeedError) as info:
            list(loader)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert "gone1.jpg: file not found" in str(info.value)
