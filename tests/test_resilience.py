"""Faults a long training run meets: restarts, drains, idle trainers, bad data, load, auth."""

from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
import torch

from gpufeed.client import FeedClient, FeedError
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from support import shm_prefix, stream_segments, wait_until


def _indices(loader) -> list[int]:
    return [i for b in loader for i in b["index"].tolist()]


def test_server_killed_and_restarted_mid_epoch_loses_and_repeats_nothing(data_dir, image_names):
    files = image_names[:120]
    first = ServerProcess(["--data-root", str(data_dir)]).start()
    address = first.address
    with FeedClient(address) as feed:
        expected = _indices(feed.loader(files=files, batch_size=8, size=(16, 16), shuffle=True,
                                        seed=9, prefetch=2))
        loader = feed.loader(files=files, batch_size=8, size=(16, 16), shuffle=True, seed=9,
                             prefetch=2, reconnect_timeout=60)
        received, second = [], None
        try:
            for k, batch in enumerate(loader):
                received += batch["index"].tolist()
                if k == 4:
                    first.proc.send_signal(signal.SIGKILL)
                    first.proc.wait()
                    second = ServerProcess(["--data-root", str(data_dir),
                                            "--listen", address]).start()
        finally:
            if second is not None:
                second.stop()
            first.kill()
    assert received == expected


def test_server_gone_for_good_is_a_clear_error(data_dir, image_names):
    server = ServerProcess(["--data-root", str(data_dir)]).start()
    with FeedClient(server.address) as feed:
        loader = feed.loader(files=image_names[:80], batch_size=8, size=(16, 16), prefetch=1,
                             reconnect_timeout=1)
        with pytest.raises(FeedError) as info:
            for k, _ in enumerate(loader):
                if k == 1:
                    server.proc.send_signal(signal.SIGKILL)
                    server.proc.wait()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "gave up after 1 s" in str(info.value) and server.address in str(info.value)


def test_sigterm_drains_open_streams_and_exits_zero(data_dir, image_names):
    server = ServerProcess(["--data-root", str(data_dir), "--drain-seconds", "0.5"]).start()
    prefix = shm_prefix(server.address)
    with FeedClient(server.address) as feed:
        loader = feed.loader(files=image_names[:80], batch_size=8, size=(16, 16), prefetch=1,
                             transport="shm", reconnect_timeout=0)
        with pytest.raises(FeedError) as info:
            for k, _ in enumerate(loader):
                if k == 0:
                    server.proc.send_signal(signal.SIGTERM)
                    assert server.proc.wait(30) == 0  # the trainer idles: drain must end it
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert not stream_segments(prefix) and not os.path.exists(f"/dev/shm/{prefix}probe")


@pytest.fixture(scope="module")
def lease_server(data_dir):
    """A server that ends a stream whose client has not released a slot for 0.5 s."""
    with ServerProcess(["--data-root", str(data_dir), "--lease-timeout", "0.5"]) as server:
        yield server


def test_lease_timeout_ends_an_idle_stream(lease_server, image_names):
    with grpc.insecure_channel(lease_server.address) as channel:
        request = feed_pb2.StreamRequest(
            files=feed_pb2.FileList(paths=image_names[:40]), batch_size=4, prefetch=1,
            output=feed_pb2.OutputSpec(height=8, width=8), transport=feed_pb2.TRANSPORT_INLINE)
        # Opens, never releases: the server fills both slots, then waits in vain.
        call = feed_pb2_grpc.FeedStub(channel).Stream(iter([feed_pb2.ClientMessage(open=request)]))
        received = []
        with pytest.raises(grpc.RpcError) as info:
            for message in call:
                received.append(message.WhichOneof("kind"))
    assert received == ["header", "batch", "batch"]  # credits: prefetch 1 + the held one
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "lease timeout" in info.value.details() and "resume from batch 2" in info.value.details()


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_a_loader_not_iterated_past_the_lease_timeout_is_quiet_and_whole(
        lease_server, image_names, transport, caplog):
    """An evaluation loader made before training opens its stream at once; the trainer
    leaves it unread past the server's lease timeout. That is routine: its pass later
    gives every batch, equal to a fresh loader's, and neither side warns."""
    files, server = image_names[:40], lease_server
    logged = len(server.log)  # the lines before are other tests'
    with FeedClient(server.address) as feed:
        idle = feed.loader(files=files, batch_size=4, size=(8, 8), prefetch=1,
                           transport=transport)
        # The server ends the unread stream 0.5 s after it fills its slots.
        assert wait_until(lambda: any("stream end" in line and "lease timeout" in line
                                      for line in server.log[logged:]), 30), \
            "".join(server.log[logged:])
        with caplog.at_level("INFO", logger="gpufeed"):
            got = [{k: t.clone() for k, t in b.items()} for b in idle]
        want = list(feed.loader(files=files, batch_size=4, size=(8, 8), copy=True))
    assert [b["index"].tolist() for b in got] == [b["index"].tolist() for b in want]
    assert all(torch.equal(g["image"], w["image"]) for g, w in zip(got, want))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # Said, quietly. Which batch it resumes at depends on how many reached the client
    # before the lease ran out (a timing matter): any is right, as the pass is whole.
    assert any(re.search(r"resuming at batch \d+", r.getMessage()) for r in caplog.records)
    ended = [line for line in server.log[logged:]
             if "stream end" in line and "lease timeout" in line]
    assert ended and all(" INFO " in line for line in ended), ended


def test_failure_budget_ends_the_stream_with_examples(feed, data_dir, image_names):
    files = image_names[:20] + ["gone1.jpg", "gone2.jpg", "gone3.jpg"]
    with pytest.raises(FeedError) as info:
        _indices(feed.loader(files=files, batch_size=4, size=(8, 8), failure_budget=2))
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert "3 samples failed" in str(info.value)
    assert "sample 20: gone1.jpg: file not found" in str(info.value)
    assert len(_indices(feed.loader(files=files, batch_size=4, size=(8, 8),
                                    failure_budget=3))) == 20
    assert len(_indices(feed.loader(files=files, batch_size=4, size=(8, 8),
                                    failure_budget=0.2))) == 20


def test_a_shm_stream_that_fails_before_the_trainer_maps_it_reports_why(server, image_names):
    """A stream can fail (here: its first sample, over a budget of none) before a busy
    trainer has mapped its segment; the name must stay until it has, so that the
    trainer gets DATA_LOSS, not "cannot map the server's segment" (or, in a drain,
    UNAVAILABLE, which it would resume from)."""
    request = feed_pb2.StreamRequest(
        files=feed_pb2.FileList(paths=["gone.jpg"] + image_names[:3]), batch_size=1,
        output=feed_pb2.OutputSpec(height=8, width=8), transport=feed_pb2.TRANSPORT_SHM,
        max_failure_fraction=0.001)
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox.put(feed_pb2.ClientMessage(open=request))
    with grpc.insecure_channel(server.address) as channel:
        call = feed_pb2_grpc.FeedStub(channel).Stream(iter(outbox.get, None))
        header = next(call).header
        time.sleep(0.5)  # the trainer is busy; the server fails batch 0 meanwhile
        fd = os.open(f"/dev/shm/{header.shm_name}", os.O_RDWR)  # FileNotFoundError before the fix
        os.close(fd)
        outbox.put(feed_pb2.ClientMessage(attached=feed_pb2.Attached()))
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        outbox.put(None)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert not os.path.exists(f"/dev/shm/{header.shm_name}")


_MANY_STREAMS_CLIENT = textwrap.dedent("""
    import sys
    from gpufeed.client import FeedClient
    address, streams, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    feed = FeedClient(address)
    iterators = [iter(feed.loader(files=files, batch_size=2, size=(8, 8), transport="shm",
                                  prefetch=1, copy=True)) for _ in range(streams)]
    firsts = [next(it)["index"].tolist() for it in iterators]  # every stream is open now
    print("open", flush=True)
    sys.stdin.readline()
    for first, it in zip(firsts, iterators):
        rest = [i for b in it for i in b["index"].tolist()]
        assert sorted(first + rest) == list(range(len(files))), (first, rest)
    print("ok", flush=True)
""")


@pytest.mark.slow
def test_64_streams_from_2_processes_and_the_65th_refused(data_dir, image_names):
    files = image_names[:12]
    with ServerProcess(["--data-root", str(data_dir), "--max-streams", "64"]) as server:
        procs = [subprocess.Popen([sys.executable, "-c", _MANY_STREAMS_CLIENT, server.address,
                                   "32", *files], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
                 for _ in range(2)]
        try:
            assert [p.stdout.readline().strip() for p in procs] == ["open"] * 2
            with FeedClient(server.address) as feed, pytest.raises(FeedError) as info:
                _indices(feed.loader(files=files, batch_size=2, size=(8, 8)))
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-streams 64" in str(info.value)
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            assert [p.stdout.readline().strip() for p in procs] == ["ok"] * 2
        finally:
            for p in procs:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    trustme = pytest.importorskip("trustme")
    directory = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    cert.private_key_pem.write_to_path(str(directory / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
    (directory / "token").write_text("s3cret-token\n")
    return directory


def test_tls_and_token(data_dir, tls_files):
    args = ["--data-root", str(data_dir), "--tls-cert", str(tls_files / "cert.pem"),
            "--tls-key", str(tls_files / "key.pem"), "--token-file", str(tls_files / "token")]
    with ServerProcess(args) as server:
        credentials = grpc.ssl_channel_credentials((tls_files / "ca.pem").read_bytes())
        for token in (None, "wrong"):
            with FeedClient(server.address, credentials=credentials, token=token) as feed:
                with pytest.raises(FeedError) as info:
                    feed.info()
                assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(FeedError) as info:
                    _indices(feed.loader(files=["img0000.jpg"], batch_size=1, size=(8, 8)))
                assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        with FeedClient(server.address, credentials=credentials, token="s3cret-token") as feed:
            assert feed.info().version
            assert _indices(feed.loader(files=["img0000.jpg"], batch_size=1, size=(8, 8))) == [0]
        with FeedClient(server.address, token="s3cret-token", connect_timeout=2) as plaintext:
            with pytest.raises(FeedError):
                plaintext.info()  # a TLS server does not speak plaintext


_AUTO_CLIENT = textwrap.dedent("""
    import sys
    from gpufeed.client import FeedClient
    loader = FeedClient(sys.argv[1]).loader(files=["img0000.jpg", "img0001.jpg"], batch_size=2,
                                            size=(8, 8))
    print([b["index"].tolist() for b in loader], loader.transport)
""")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_auto_falls_back_to_inline_without_the_servers_shm(server):
    """A trainer with its own /dev/shm (another container) cannot read the probe."""
    script = f"mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} -c '{_AUTO_CLIENT}' " \
             f"{server.address}"
    result = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True,
                            text=True, env=os.environ)
    if result.returncode != 0 and "mount" in result.stderr + result.stdout:
        pytest.skip(f"cannot make a private /dev/shm here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[[0, 1]] inline"


_RESUMING_TRAINER = textwrap.dedent("""
    import json, sys
    from gpufeed.client import FeedClient
    address, state, files = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    loader = FeedClient(address).loader(files=files, batch_size=8, size=(16, 16), shuffle=True,
                                        seed=state["fingerprint"]["seed"])
    loader.load_state_dict(state)
    print(json.dumps([i for b in loader for i in b["index"].tolist()]))
""")


def test_a_new_trainer_process_resumes_from_a_saved_state(feed, server, image_names):
    import json

    files = image_names[:72]
    full = _indices(feed.loader(files=files, batch_size=8, size=(16, 16), shuffle=True, seed=8,
                                epoch=4))
    first = feed.loader(files=files, batch_size=8, size=(16, 16), shuffle=True, seed=8, epoch=4)
    taken = []
    for k, batch in enumerate(first):
        taken += batch["index"].tolist()
        if k == 3:
            break
    state = json.dumps(first.state_dict())  # what a checkpoint would hold
    result = subprocess.run([sys.executable, "-c", _RESUMING_TRAINER, server.address, state,
                             *files], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert taken + json.loads(result.stdout) == full


def test_a_request_over_the_size_limit_is_refused_naming_it(data_dir):
    with ServerProcess(["--data-root", str(data_dir), "--max-request-bytes", "100000"]) as server, \
            FeedClient(server.address) as feed:
        with pytest.raises(FeedError) as info:
            _indices(feed.loader(files=[f"img{i % 300:04d}.jpg" for i in range(20000)],
                                 batch_size=8, size=(8, 8)))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "100000" in str(info.value)
        assert _indices(feed.loader(files=["img0000.jpg"], batch_size=1, size=(8, 8))) == [0]


def test_a_frozen_server_is_an_error_not_a_hang(data_dir, image_names):
    """SIGSTOP keeps the server's sockets open but silent, as a hung or unplugged host:
    keepalive pings must notice (about 5 s) and the trainer must get an error."""
    server = ServerProcess(["--data-root", str(data_dir)]).start()
    try:
        with FeedClient(server.address) as feed:
            loader = feed.loader(files=image_names[:200], batch_size=4, size=(16, 16), prefetch=1,
                                 reconnect_timeout=1)
            with pytest.raises(FeedError) as info:
                for k, _ in enumerate(loader):
                    if k == 0:
                        server.proc.send_signal(signal.SIGSTOP)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.proc.send_signal(signal.SIGCONT)
        server.kill()
