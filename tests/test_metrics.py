"""Metrics, checked against what a real client received and with Prometheus's own tools.

The server runs as a real subprocess with ``--metrics-port``, one for the module's
tests (each checks what its own calls added); the figures on
/metrics must equal what FeedClient got, promtool must accept the exposition,
and Debian's real ``prometheus`` binary must scrape the live server and answer
the samples counter (and every dashboard query) through its HTTP API.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpufeed.client import FeedClient
from gpufeed.server.demo import encode_jpeg, synthetic_photo
from gpufeed.server.metrics import STAGES, ServerMetrics
from gpufeed.server.process import ServerProcess
from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import FAILURE_CATEGORIES

_ROOT = Path(__file__).resolve().parents[1]
_DASHBOARD = _ROOT / "docker" / "grafana" / "dashboards" / "gpufeed.json"
_METRICS_LINE = re.compile(r"gpufeed-server metrics on http://(\S+)/metrics")
_DEADLINE = 60.0  # seconds any bounded poll may take before the test fails

# 12 samples in batches of 2: a corrupt file in batch 1, a missing one in batch 3,
# so every batch keeps a row and both failure categories appear. With prefetch 1
# (two slots) the server must read the client's releases to go past batch 1, so
# it cannot finish, and drop the stream's memory, before the client has mapped it.
_BATCH = 2
_PREFETCH = 1


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for i in range(10):
        (root / f"{i}.jpg").write_bytes(encode_jpeg(synthetic_photo(rng, 40, 56)))
    (root / "bad.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    return root


def _files() -> list[str]:
    good = [f"{i}.jpg" for i in range(10)]
    return good[:3] + ["bad.jpg"] + good[3:6] + ["missing.jpg"] + good[6:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_server(data_root: Path):
    """A running server with metrics on a free port: yields it and its logged metrics address.

    The port is picked by binding port 0 and closing it, so another process may
    take it first: then the server exits saying so, and we try another port.
    The tests share it, so each reads the counters before and after its own calls
    (``_Counts``), and only the server's lines logged since it began.
    """
    server = _start_with_free_metrics_port(["--data-root", str(data_root), "--threads", "2"])
    try:
        match = next(filter(None, map(_METRICS_LINE.search, server.log)), None)
        assert match, "no metrics line before the ready line:\n" + "".join(server.log)
        yield server, match.group(1)
    finally:
        _stop(server)


class _Counts:
    """What a test's own calls added to the shared server's counters: read once when
    made, and :meth:`added` subtracts that from a later scrape."""

    def __init__(self, metrics: str):
        self.metrics = metrics
        self.before = _values(_scrape(metrics))

    def added(self) -> tuple[str, dict]:
        """The exposition now (for its gauges), and each counter's increase since."""
        text = _scrape(self.metrics)
        now = _values(text)
        return text, {key: value - self.before.get(key, 0.0) for key, value in now.items()}


def _start_with_free_metrics_port(args: list[str]) -> ServerProcess:
    for _ in range(3):
        server = ServerProcess([*args, "--metrics-port", str(_free_port())])
        try:
            return server.start()
        except RuntimeError as e:  # start() has killed the child already
            if "cannot serve metrics" not in str(e):
                raise
    raise RuntimeError("no free metrics port after 3 tries")


def _stop(server: ServerProcess) -> None:
    """Stop the child (not ``with server:``, whose __enter__ would start a second one)."""
    try:
        server.stop()
    except subprocess.TimeoutExpired:
        server.kill()
        raise


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        assert reply.status == 200
        return reply.read().decode()


def _values(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def _value(text: str | dict, name: str, **labels: str) -> float:
    """One sample, from an exposition or from ``_Counts.added``'s increases."""
    values = _values(text) if isinstance(text, str) else text
    return values[(name, frozenset(labels.items()))]


def _run_pass(client: FeedClient, data_root: Path, transport: str) -> dict:
    """One full pass; what the client received, counted on the client side."""
    loader = client.loader(_files(), prefix=f"{data_root}/", batch_size=_BATCH, size=(32, 32),
                           transport=transport, prefetch=_PREFETCH)
    got = {"samples": 0, "batches": 0, "bytes": 0}
    for batch in loader:
        got["samples"] += len(batch["index"])
        got["batches"] += 1
        got["bytes"] += sum(t.numel() * t.element_size() for t in batch.values())
    assert loader.transport == transport
    got["failures"] = sorted(failure.category for failure in loader.failures)
    return got


def test_counters_equal_what_the_client_received(data_root, metrics_server):
    server, metrics = metrics_server
    counts = _Counts(metrics)
    with FeedClient(server.address) as client:
        received = {t: _run_pass(client, data_root, t) for t in ("inline", "shm")}
    text, added = counts.added()

    for transport, got in received.items():
        # The pass really exercised both failure kinds, so the checks below mean something.
        assert got["failures"] == ["not_found", "undecodable"]
        assert got["samples"] == 10 and got["batches"] == 6
        assert _value(added, "gpufeed_samples_total", transport=transport) == got["samples"]
        assert _value(added, "gpufeed_batches_total", transport=transport) == got["batches"]
        assert _value(added, "gpufeed_batch_bytes_total", transport=transport) == got["bytes"]
        assert _value(added, "gpufeed_streams_total", transport=transport) == 1
        assert _value(text, "gpufeed_active_streams", transport=transport) == 0
        assert _value(text, "gpufeed_slots_leased", transport=transport) == 0
    # inline messages carry the tensors; shm messages only their metadata.
    assert (_value(added, "gpufeed_message_bytes_total", transport="inline")
            > received["inline"]["bytes"]
            > _value(added, "gpufeed_message_bytes_total", transport="shm") > 0)
    assert _value(text, "gpufeed_samples_total", transport="cuda_ipc") == 0
    # Counted by the category the client received, one series per category from the start.
    assert _value(added, "gpufeed_sample_failures_total", category="undecodable") == 2
    assert _value(added, "gpufeed_sample_failures_total", category="not_found") == 2
    for category in FAILURE_CATEGORIES.keys() - {"undecodable", "not_found"}:
        assert _value(text, "gpufeed_sample_failures_total", category=category) == 0

    stage_count = {s: _value(added, "gpufeed_stage_duration_seconds_count", stage=s)
                   for s in STAGES}
    assert stage_count == {"read": 24, "decode": 22, "batch_decode": 0, "batch": 12,
                           "device_copy": 0, "send": 12}
    assert _value(added, "gpufeed_stage_duration_seconds_bucket", stage="send", le="+Inf") == 12
    assert _value(text, "gpufeed_decode_queue_tasks") == 0
    assert _value(text, "gpufeed_decode_threads") == 2


def test_active_streams_and_leased_slots_follow_an_open_stream(data_root, metrics_server):
    server, metrics = metrics_server
    with FeedClient(server.address) as client:
        loader = client.loader(_files(), prefix=f"{data_root}/", batch_size=_BATCH,
                               size=(32, 32), transport="shm", prefetch=_PREFETCH)
        batches = iter(loader)
        held = next(batches)
        # The trainer holds batch 0's slot; batch 1 has the other. The server
        # cannot go on without a release, so the stream is still open.
        text = _scrape(metrics)
        assert _value(text, "gpufeed_active_streams", transport="shm") == 1
        assert _value(text, "gpufeed_active_streams", transport="inline") == 0
        assert _value(text, "gpufeed_slots_leased", transport="shm") == _PREFETCH + 1
        del held
        batches.close()  # the client cancels the call; the server frees the stream
        _poll(lambda: _value(_scrape(metrics), "gpufeed_active_streams", transport="shm") == 0,
              "active streams back to 0 after the client went away")
        assert _value(_scrape(metrics), "gpufeed_slots_leased", transport="shm") == 0


def test_each_stream_logs_one_line_at_open_and_end_and_refusals_are_counted(data_root,
                                                                          metrics_server):
    from gpufeed.client import FeedError
    from support import wait_until

    server, metrics = metrics_server
    logged, counts = len(server.log), _Counts(metrics)
    with FeedClient(server.address) as client:
        got = _run_pass(client, data_root, "inline")
        for bad in ({"files": _files(), "batch_size": 0}, {"files": "missing.flist",
                                                            "batch_size": 2}):
            with pytest.raises(FeedError):
                list(client.loader(size=(8, 8), **bad))
        assert wait_until(lambda: any("stream end:" in line for line in server.log[logged:]))
        _, added = counts.added()
    log = "".join(server.log[logged:])
    opened = re.findall(r"stream open: peer=ipv[46]:\S+ transport=inline samples=12 "
                        r"batches=6 start_batch=0", log)
    ended = re.findall(r"stream end: peer=ipv[46]:\S+ transport=inline samples=(\d+) "
                       r"batches=(\d+) failures=(\d+) duration=[\d.]+s status=OK", log)
    assert len(opened) == 1 and ended == [(str(got["samples"]), "6", "2")]
    refused = re.findall(r"stream refused: peer=ipv[46]:\S+ status=(\w+): (.*)", log)
    assert [(code, "batch_size" in why or "list_file" in why) for code, why in refused] == \
        [("INVALID_ARGUMENT", True), ("NOT_FOUND", True)]
    assert _value(added, "gpufeed_streams_refused_total", code="INVALID_ARGUMENT") == 1
    assert _value(added, "gpufeed_streams_refused_total", code="NOT_FOUND") == 1
    assert _value(added, "gpufeed_streams_refused_total", code="RESOURCE_EXHAUSTED") == 0


def test_log_level_warning_keeps_only_refusals(data_root):
    from gpufeed.client import FeedError

    with ServerProcess(["--data-root", str(data_root), "--log-level", "warning"]) as server, \
            FeedClient(server.address) as client:
        with pytest.raises(FeedError):
            list(client.loader(files=_files(), batch_size=0, size=(8, 8)))
        assert len(list(client.loader(files=["0.jpg"], batch_size=1, size=(8, 8)))) == 1
        server.stop()
    log = "".join(server.log)
    assert "stream refused:" in log and "stream open:" not in log and "stream end:" not in log


def test_promtool_accepts_the_exposition(data_root, metrics_server):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (.ci/test installs Debian's prometheus)")
    server, metrics = metrics_server
    with FeedClient(server.address) as client:
        _run_pass(client, data_root, "inline")
        text = _scrape(metrics)
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_taken_metrics_port_fails_start_up_with_a_clear_message(data_root):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = ServerProcess(["--data-root", str(data_root),
                                "--metrics-port", str(taken.getsockname()[1])])
        with pytest.raises(RuntimeError, match="cannot serve metrics on 127.0.0.1"):
            server.start()
        server.proc.wait(30)  # it exited by itself (or start() killed it): nothing left behind


def test_each_server_owns_its_registry():
    first, second = ServerMetrics(), ServerMetrics()  # the global registry would refuse this
    first.sent(feed_pb2.TRANSPORT_INLINE, _one_sample_message(), 0.001)
    assert first.registry.get_sample_value("gpufeed_batches_total", {"transport": "inline"}) == 1
    assert second.registry.get_sample_value("gpufeed_batches_total", {"transport": "inline"}) == 0


def test_trainer_wait_counts_only_reported_waits():
    metrics = ServerMetrics()
    # 0 is proto3's "not set": an old client, or a Release that only returns a dropped slot.
    metrics.released(feed_pb2.TRANSPORT_SHM, feed_pb2.Release(seqs=[0]))
    metrics.released(feed_pb2.TRANSPORT_SHM, feed_pb2.Release(seqs=[1], wait_seconds=0.0))
    metrics.released(feed_pb2.TRANSPORT_SHM, feed_pb2.Release(seqs=[], wait_seconds=0.25))
    metrics.released(feed_pb2.TRANSPORT_SHM, feed_pb2.Release(seqs=[2], wait_seconds=0.5))
    get = metrics.registry.get_sample_value
    assert get("gpufeed_trainer_wait_seconds_count", {"transport": "shm"}) == 2
    assert get("gpufeed_trainer_wait_seconds_sum", {"transport": "shm"}) == 0.75
    assert get("gpufeed_trainer_wait_seconds_count", {"transport": "inline"}) == 0


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_trainer_wait_arrives_from_the_real_client(data_root, metrics_server, transport):
    """One reported wait per batch the client received. The server must read the
    releases of all but the last two batches (it has two slots); those two may
    reach it after it ended the call, hence the range."""
    server, metrics = metrics_server
    counts = _Counts(metrics)
    with FeedClient(server.address) as client:
        got = _run_pass(client, data_root, transport)
    _, added = counts.added()
    waits = _value(added, "gpufeed_trainer_wait_seconds_count", transport=transport)
    assert got["batches"] - 2 <= waits <= got["batches"]
    assert _value(added, "gpufeed_trainer_wait_seconds_sum", transport=transport) > 0


def test_failures_are_counted_by_their_wire_category():
    metrics = ServerMetrics()
    metrics.failed([feed_pb2.FAILURE_TOO_LARGE, feed_pb2.FAILURE_TOO_LARGE,
                    feed_pb2.FAILURE_TIMEOUT])
    text = generate_latest(metrics.registry).decode()
    assert _value(text, "gpufeed_sample_failures_total", category="too_large") == 2
    assert _value(text, "gpufeed_sample_failures_total", category="timeout") == 1
    assert _value(text, "gpufeed_sample_failures_total", category="permission_denied") == 0


@pytest.mark.slow
def test_prometheus_scrapes_the_live_server(data_root, metrics_server, tmp_path):
    """Debian's real prometheus scrapes the server; its API returns the server's count
    (the counters test checks that against the client's), and evaluates every query of
    the Grafana dashboard without error."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("Debian's prometheus is not installed (.ci/test installs it with apt-get)")
    server, metrics = metrics_server
    with FeedClient(server.address) as client:
        _run_pass(client, data_root, "inline")
        samples = _value(_scrape(metrics), "gpufeed_samples_total", transport="inline")
        api = _start_prometheus(prometheus, metrics, tmp_path)
        try:
            query = 'gpufeed_samples_total{transport="inline",job="gpufeed"}'
            _poll(lambda: _query_values(api.address, query) == [samples],
                  f"prometheus to report {query} == {samples:g}", api.process)
            # Every panel query, for all servers (the variable's "All") and for this
            # one, evaluates and returns data once Prometheus has two scrapes to rate.
            for expr in _dashboard_exprs():
                for instance in (".*", metrics):
                    query = expr.replace("$__rate_interval", "1m").replace("$instance", instance)
                    reply = _api(api.address, query)
                    assert reply["status"] == "success", (query, reply)
                    _poll(lambda query=query: _query_values(api.address, query),
                          f"data from the dashboard query {query}", api.process)
        finally:
            api.stop()


class _Prometheus:
    def __init__(self, process: subprocess.Popen, address: str, log: Path):
        self.process, self.address, self.log = process, address, log

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _start_prometheus(binary: str, target: str, tmp_path: Path) -> _Prometheus:
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n  - job_name: gpufeed\n"
        f"    static_configs:\n      - targets: [\"{target}\"]\n")
    address = f"127.0.0.1:{_free_port()}"
    log = tmp_path / "prometheus.log"
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address={address}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=log.open("w"))
    return _Prometheus(process, address, log)


def _api(address: str, query: str) -> dict:
    url = f"http://{address}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as e:
        if e.code == 503:  # "Service Unavailable" while its storage starts: not ready yet
            raise  # an OSError, as a port not listening yet is
        return json.load(e)  # 400/422 carry the error as JSON


def _query_values(address: str, query: str) -> list[float] | None:
    try:
        reply = _api(address, query)
    except OSError:  # not listening yet
        return None
    return [float(r["value"][1]) for r in reply.get("data", {}).get("result", [])]


def _poll(condition, what: str, process: subprocess.Popen | None = None) -> None:
    """Wait for ``condition()`` with a deadline; fail saying what never happened."""
    deadline = time.monotonic() + _DEADLINE
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"prometheus exited ({process.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {_DEADLINE:g} s waiting for {what}")
        time.sleep(0.2)


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(_DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def _one_sample_message() -> feed_pb2.ServerMessage:
    batch = feed_pb2.Batch(seq=0)
    batch.tensors.add(name="index", dtype="int64", shape=[1])
    return feed_pb2.ServerMessage(batch=batch)


def test_queue_depth_per_stream_and_per_job():
    """Streams' and jobs' queued decodes, read from a pool with no thread to drain it."""
    from types import SimpleNamespace

    from gpufeed.server.metrics import ServerMetrics
    from gpufeed.server.serving.running.pool import DecodePool

    class Stream:  # what the collector reads of a stream: its source and its ring
        def __init__(self, job: str = ""):
            self.source = SimpleNamespace(name=job) if job else SimpleNamespace()
            self.ring = SimpleNamespace(leased=lambda: 0)

    pool = DecodePool(0, lambda: None)  # no thread, so no per-thread state
    metrics = ServerMetrics(pool)
    private, consumers = Stream(), [Stream("train"), Stream("train")]
    for stream, rows in zip([private, *consumers], (7, 3, 4)):
        metrics.opened(stream, feed_pb2.TRANSPORT_SHM)
        pool.submit(stream, None, range(rows))
    text = generate_latest(metrics.registry).decode()
    assert _value(text, "gpufeed_stream_queue_tasks_max") == 7
    assert _value(text, "gpufeed_job_queue_tasks", job="train") == 7
    assert _value(text, "gpufeed_decode_queue_tasks") == 14
