"""Processes come and go: nothing leaks, the server keeps serving, signals stop it cleanly."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gpufeed.client import FeedClient
from gpufeed.server.process import ServerProcess
from gpufeed.v1.vocabulary import SHM_DIR
from support import shm_prefix, stream_segments, wait_until

# A trainer that opens a shm stream with raw gRPC, prints the names of the segment
# and the lane and then stops reading without ever attaching or releasing: the
# worst client.
_SILENT_CLIENT = textwrap.dedent("""
    import sys, time, grpc
    from gpufeed.v1 import feed_pb2, feed_pb2_grpc
    request = feed_pb2.StreamRequest(files=feed_pb2.FileList(paths=sys.argv[2:]), batch_size=2,
                                     output=feed_pb2.OutputSpec(height=32, width=32),
                                     transport=feed_pb2.TRANSPORT_SHM)
    def messages():
        yield feed_pb2.ClientMessage(open=request)
        time.sleep(3600)
    call = feed_pb2_grpc.FeedStub(grpc.insecure_channel(sys.argv[1])).Stream(messages())
    header = next(call).header
    print(header.shm_name, header.lane_name, flush=True)
    time.sleep(3600)
""")

# A trainer using the client library that prints each batch and holds it forever.
_LIBRARY_CLIENT = textwrap.dedent("""
    import sys, time
    from gpufeed.client import FeedClient
    loader = FeedClient(sys.argv[1]).loader(files=sys.argv[2:], batch_size=2, size=(32, 32),
                                            transport="shm")
    for batch in loader:
        print(batch["index"].tolist(), flush=True)
        time.sleep(3600)
""")


def _start_client(script: str, address: str, files: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", script, address, *files],
                            stdout=subprocess.PIPE, text=True)
    first_line = proc.stdout.readline().strip()
    assert first_line, "the client process printed nothing"
    return proc, first_line


def _serves(address: str, files: list[str]) -> list[int]:
    with FeedClient(address) as feed:
        return [i for b in feed.loader(files=files, batch_size=4, size=(16, 16)) for i in
                b["index"].tolist()]


@pytest.mark.parametrize("script", [_SILENT_CLIENT, _LIBRARY_CLIENT], ids=["silent", "library"])
def test_killed_client_leaves_nothing_and_server_serves_on(server, image_names, script):
    prefix = shm_prefix(server.address)
    proc, line = _start_client(script, server.address, image_names[:40])
    if script is _SILENT_CLIENT:  # not attached: the server still holds the names
        assert stream_segments(prefix) == set(line.split())
    proc.kill()
    proc.wait()
    assert wait_until(lambda: not stream_segments(prefix)), stream_segments(prefix)
    assert _serves(server.address, image_names[:8]) == list(range(8))


def test_sigterm_stops_the_server_cleanly(data_dir):
    server = ServerProcess(["--data-root", str(data_dir)]).start()
    prefix = shm_prefix(server.address)
    assert _serves(server.address, ["img0000.jpg"]) == [0]
    assert server.stop() == 0
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]  # probe gone too


def test_next_server_removes_what_a_killed_one_left(data_dir, image_names):
    victim = ServerProcess(["--data-root", str(data_dir)]).start()
    proc, line = _start_client(_SILENT_CLIENT, victim.address, image_names[:8])
    names = set(line.split())  # the stream's segment and lane
    prefix = shm_prefix(victim.address)
    # Servers that other test processes start meanwhile would sweep the victim's names
    # too. So this test waits for the victim's probe lock, and holds it from the moment
    # the victim dies until the successor is started.
    probe = os.open(os.path.join(SHM_DIR, prefix + "probe"), os.O_RDONLY)
    try:
        with ThreadPoolExecutor(1) as waiting:
            locked = waiting.submit(fcntl.flock, probe, fcntl.LOCK_EX)
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
            locked.result(timeout=30)
        proc.kill()
        proc.wait()
        assert stream_segments(prefix) == names  # SIGKILL left them behind
    finally:
        os.close(probe)
    with ServerProcess(["--data-root", str(data_dir)]) as successor:
        assert not stream_segments(prefix)
        assert _serves(successor.address, ["img0000.jpg"]) == [0]


def test_health_and_reflection_are_served(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "gpufeed.v1.Feed"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (response,) = list(reflect.ServerReflectionInfo(iter([request]), timeout=5))
        names = {s.name for s in response.list_services_response.service}
    assert "gpufeed.v1.Feed" in names and "grpc.health.v1.Health" in names


def test_info_describes_the_server(feed, data_dir):
    info = feed.info()
    assert info.data_roots == [str(data_dir.resolve())]
    assert info.decode_threads == 2
    assert info.shm_probe.name in os.listdir("/dev/shm")


def test_finished_streams_let_go_of_their_memory(data_dir, image_names):
    """A stream's segment is unmapped when the stream ends, not at some later garbage collection:
    no descriptor or mapping of a deleted segment stays with the server."""
    with ServerProcess(["--data-root", str(data_dir)]) as server:
        for _ in range(6):
            assert len(_serves(server.address, image_names[:16])) == 16

        def held() -> list[str]:
            fds = f"/proc/{server.proc.pid}/fd"
            links = []
            for fd in os.listdir(fds):
                try:
                    links.append(os.readlink(f"{fds}/{fd}"))
                except FileNotFoundError:  # closed since the listing: not held
                    pass
            with open(f"/proc/{server.proc.pid}/maps") as maps:
                mapped = [line for line in maps
                          if "/dev/shm/gpufeed-" in line and "probe" not in line]
            return [link for link in links
                    if "/dev/shm/gpufeed-" in link and "probe" not in link] + mapped

        assert wait_until(lambda: not held()), held()


_STUCK_PLUGIN = '''
import threading
from pathlib import Path

from gpufeed.server import transforms


@transforms.register("never_returns")
def never_returns(marker: str = ""):
    def apply(sample, rng):
        Path(marker).touch()  # the test waits for this, not for time
        threading.Event().wait()  # a transform stuck for good on a decode thread
    return apply
'''


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_sigterm_ends_the_server_even_when_a_decode_thread_never_returns(data_dir, image_names,
                                                                         tmp_path):
    """A stop waits for the decode threads; one that never returns must not keep the
    process alive: it exits --drain-seconds plus a few seconds after the signal."""
    (tmp_path / "stuckplugin.py").write_text(_STUCK_PLUGIN)
    marker = tmp_path / "entered"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    server = ServerProcess(["--data-root", str(data_dir), "--threads", "1", "--drain-seconds",
                            "1", "--plugins", "stuckplugin"], env={"PYTHONPATH": path}).start()
    try:
        with FeedClient(server.address) as feed:
            feed.loader(files=image_names[:4], batch_size=2, size=(16, 16),
                        transforms=[("never_returns", {"marker": str(marker)})])
            # The server's log says why, should the transform never be reached.
            assert wait_until(marker.exists, timeout=60), "".join(server.log)
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(timeout=90)  # without the watchdog: forever
    finally:
        server.kill()
    assert code == 1
    assert any("still stopping" in line and "exiting" in line for line in server.log)
