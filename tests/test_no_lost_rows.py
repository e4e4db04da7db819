"""No name or error leaves a batch unfinished: a trainer never waits for a row that will
not come.

An ``s3://`` name is located when the stream opens, like every other name, so
one outside the data roots is refused there instead of failing when its row is
read. And whatever a decode thread meets while reading a sample (an error
whose message cannot be made, a plugin's ``sys.exit()``) fails that sample
alone: its row is counted, the batch goes out, the pass ends, and the server
goes on serving.
"""

from __future__ import annotations

import os
import textwrap

import grpc
import pytest

from gpufeed.client import FeedClient, FeedError
from gpufeed.server.process import ServerProcess

N = 24

_PLUGIN = '''
import sys


class Undescribable(Exception):
    def __str__(self):
        raise Undescribable()


def _failing(error):
    def factory(p: float = 0.5):
        def apply(sample, rng):
            if rng.random() < p:
                error()
            return sample
        return apply
    return factory


def _exit():
    sys.exit(3)


def _undescribable():
    raise Undescribable()


from gpufeed.server import transforms

transforms.register("exit_sometimes")(_failing(_exit))
transforms.register("undescribable_sometimes")(_failing(_undescribable))
'''


@pytest.mark.parametrize("name", ["s3://data/img0000.jpg", "s3://other-bucket/a/b.jpg"])
def test_s3_names_on_a_server_without_s3_roots_are_refused_at_open(feed, image_names, name):
    with pytest.raises(FeedError) as refused:
        feed.loader(files=[image_names[0], name], batch_size=2, size=(16, 16))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "samples[1]" in str(refused.value) and "not under" in str(refused.value)
    with pytest.raises(FeedError) as refused:
        feed.loader(files=image_names[:2], prefix="s3://data/", batch_size=2, size=(16, 16))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def plugin_server(data_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("plugins")
    (path / "rowplugins.py").write_text(textwrap.dedent(_PLUGIN))
    python_path = os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))
    with ServerProcess(["--data-root", str(data_dir), "--threads", "2",
                        "--plugins", "rowplugins"], env={"PYTHONPATH": python_path}) as server:
        yield server


@pytest.mark.timeout(120)  # on failure the trainer waits for its batch forever
@pytest.mark.parametrize("transform", ["exit_sometimes", "undescribable_sometimes"])
def test_whatever_a_decode_thread_meets_fails_that_sample_alone(plugin_server, image_names,
                                                                 transform):
    with FeedClient(plugin_server.address) as feed:
        loader = feed.loader(files=image_names[:N], batch_size=4, size=(16, 16), seed=5,
                             transforms=[(transform, {"p": 0.3})], failure_budget=N)
        delivered = [i for batch in loader for i in batch["index"].tolist()]
        failed = [index for index, _ in loader.failures]
        assert failed and delivered  # p = 0.3 of 24 samples, drawn per (seed, index)
        assert sorted(delivered + failed) == list(range(N))  # each sample once
        assert {f.category for f in loader.failures} == {"internal"}
        # The decode threads are all still there: a clean pass on the same server is whole.
        again = [i for batch in feed.loader(files=image_names[:N], batch_size=4, size=(16, 16))
                 for i in batch["index"].tolist()]
        assert sorted(again) == list(range(N))
