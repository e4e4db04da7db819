"""A request is planned off the gRPC handler thread, and planning stops when nobody will
use the plan: the client cancelled, or the server is draining.

A plugin transform's factory runs at plan time, so one that waits for a file the
test creates holds a stream in planning for exactly as long as the test wants.
"""

from __future__ import annotations

import os
import signal
import textwrap

import grpc
import numpy as np
import pytest

from gpufeed.server.config import Limits
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.process import ServerProcess
from gpufeed.server.serving.planning.plan import plan_stream
from gpufeed.server.serving.planning.thread import PlanStopped
from gpufeed.server.storage.roots import Storage
from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from shards import write_shards
from support import wait_until

_PLUGIN = '''
import os
import time

from gpufeed.server import transforms


@transforms.register("slow_to_plan")
def slow_to_plan(entered: str = "", release: str = ""):
    open(entered, "w").close()
    while not os.path.exists(release):  # the test creates it when it is ready
        time.sleep(0.01)
    return lambda sample, rng: sample
'''


def test_a_stopped_plan_indexes_no_shard(tmp_path):
    write_shards(tmp_path, [3, 3, 3])
    request = feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=["train-{0000..0002}.tar"]),
                                     batch_size=2, output=feed_pb2.OutputSpec(height=8, width=8))
    storage = Storage([str(tmp_path)])
    asked = []

    def stopped() -> bool:
        asked.append(True)
        return True

    with pytest.raises(PlanStopped):
        plan_stream(request, storage, Limits(), (feed_pb2.TRANSPORT_INLINE,), stopped)
    assert asked
    plan = plan_stream(request, storage, Limits(), (feed_pb2.TRANSPORT_INLINE,))
    assert plan.num_samples == 9


def test_a_stopped_plan_stops_listing_a_directory_tree(tmp_path):
    for d in range(3):  # an ImageFolder tree
        (tmp_path / "tree" / f"class{d}").mkdir(parents=True)
        (tmp_path / "tree" / f"class{d}" / "a.jpg").write_bytes(
            encode_jpeg(synthetic_photo(np.random.default_rng(d), 8, 8)))
    request = feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=["tree/"]), batch_size=2,
                                     output=feed_pb2.OutputSpec(height=8, width=8))
    storage = Storage([str(tmp_path)])
    with pytest.raises(PlanStopped, match="the call ended while"):
        plan_stream(request, storage, Limits(), (feed_pb2.TRANSPORT_INLINE,), lambda: True)


@pytest.fixture()
def planning_server(data_dir, tmp_path):
    (tmp_path / "planplugin.py").write_text(textwrap.dedent(_PLUGIN))
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    server = ServerProcess(["--data-root", str(data_dir), "--max-streams", "1", "--drain-seconds",
                            "1", "--plugins", "planplugin"], env={"PYTHONPATH": path}).start()
    yield server
    server.kill()


def _open(channel, names, transforms=()) -> grpc.Future:
    request = feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=names), batch_size=2,
                                     output=feed_pb2.OutputSpec(height=16, width=16),
                                     transport=feed_pb2.TRANSPORT_INLINE)
    for name, params in transforms:
        request.sample_transforms.add(name=name, params_json=params)
    return feed_pb2_grpc.FeedStub(channel).Stream(iter([feed_pb2.ClientMessage(open=request)]))


def _first(call) -> grpc.StatusCode | str:
    try:
        return next(call).WhichOneof("kind")
    except grpc.RpcError as e:
        return e.code()


def test_a_cancelled_call_keeps_its_admission_until_its_planning_ends(planning_server,
                                                                      image_names, tmp_path):
    entered, release = tmp_path / "entered", tmp_path / "release"
    slow = [("slow_to_plan", f'{{"entered": "{entered}", "release": "{release}"}}')]
    with grpc.insecure_channel(planning_server.address) as channel:
        planned = _open(channel, image_names[:4], slow)
        assert wait_until(entered.exists, timeout=60)
        planned.cancel()  # the handler returns now, without waiting for the plan
        assert _first(planned) == grpc.StatusCode.CANCELLED
        # --max-streams 1: the planning thread still holds the one admission...
        refused = _open(channel, image_names[:4])
        assert _first(refused) == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.touch()  # ...until it ends, and then the next stream is served
        assert wait_until(lambda: _first(_open(channel, image_names[:4])) == "header", timeout=60)


def test_draining_ends_a_call_still_being_planned(planning_server, image_names, tmp_path):
    entered, release = tmp_path / "entered", tmp_path / "release"
    slow = [("slow_to_plan", f'{{"entered": "{entered}", "release": "{release}"}}')]
    with grpc.insecure_channel(planning_server.address) as channel:
        planned = _open(channel, image_names[:4], slow)
        assert wait_until(entered.exists, timeout=60)
        planning_server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as ended:
            next(planned)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in ended.value.details()
    assert planning_server.proc.wait(timeout=60) == 0
