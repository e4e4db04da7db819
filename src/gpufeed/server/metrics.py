"""Prometheus metrics of one server, and the HTTP endpoint that exposes them.

Every metric lives in a ``CollectorRegistry`` owned by the ``ServerMetrics``
object, not in prometheus-client's global default registry: several servers in
one process (the tests start many) would otherwise collide on metric names, and
a server's figures would outlive it.

Names follow Prometheus conventions: the ``gpufeed_`` prefix, base units
(seconds, bytes), ``_total`` on counters. Labels stay low-cardinality: the
transport, a failure category, a pipeline stage; never a file name or a stream
id. Every label value is created up front, so each series exists (at zero)
from the first scrape and dashboards never show "no data" for an idle path.

Gauges about live state (open streams, leased slots, queued decode tasks) are
computed at scrape time from the live objects rather than kept by inc/dec
calls, so no unusual way for a stream to end can leave them drifting.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

import gpufeed
from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import (
    FAILURE_CATEGORIES,
    TRANSPORTS,
    carrier_dtype,
    failure_category_name,
    transport_name,
)

__all__ = ["LIST_KINDS", "REFUSAL_CODES", "STAGES", "ServerMetrics"]

# read: one sample's bytes; decode: one sample decoded and scaled into its row;
# batch: a batch from its first row queued to its last row done (queueing included);
# device_copy: host-to-device copy of a batch (only where a GPU is attached);
# send: a batch message handed to gRPC until gRPC takes the next (flow control included).
STAGES = ("read", "decode", "batch_decode", "batch", "device_copy", "send")
# The statuses a Stream is refused with (serving/edge/service.py), each a series from the start.
REFUSAL_CODES = ("INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                 "UNAVAILABLE")
# What planning reads a stream's sample list from (serving/planning/lists.py): a list file parsed,
# a directory tree listed.
LIST_KINDS = ("list_file", "directory")
# From tens of microseconds (a cached read, a small image) to tens of seconds (a
# large batch on a busy pool): one set of buckets fits per-sample and per-batch stages.
_STAGE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                  0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                 1.0, 2.5, 5.0, 10.0)


class SentBatch(Protocol):
    """What ``sent`` reads of a batch message: a ServerMessage, or one not yet
    serialized (serving/edge/wire.py's InlineBatch)."""

    @property
    def batch(self) -> feed_pb2.Batch: ...

    def ByteSize(self) -> int: ...


class ServerMetrics:
    """The metrics of one server. Thread-safe: decode, handler and reader threads record."""

    def __init__(self, pool=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self._samples = Counter("gpufeed_samples", "Samples delivered to trainers in batches "
                                "(failed samples excluded).", ["transport"], registry=r)
        self._batches = Counter("gpufeed_batches", "Batches delivered to trainers.",
                                ["transport"], registry=r)
        self._batch_bytes = Counter("gpufeed_batch_bytes", "Tensor bytes of the batches "
                                    "delivered, whatever carried them.", ["transport"], registry=r)
        self._message_bytes = Counter("gpufeed_message_bytes", "Serialized size of the batch "
                                      "messages sent over gRPC (inline carries the tensors; "
                                      "shm only their metadata).", ["transport"], registry=r)
        self._streams = Counter("gpufeed_streams", "Streams opened.", ["transport"], registry=r)
        self._refused = Counter("gpufeed_streams_refused", "Streams refused before their "
                                "header (a bad request, a limit, draining), by gRPC status "
                                "code.", ["code"], registry=r)
        self._failures = Counter("gpufeed_sample_failures", "Samples that failed to read or "
                                 "decode and were left out of their batch, by the category "
                                 "their SampleFailure carries.", ["category"], registry=r)
        self._stage = Histogram("gpufeed_stage_duration_seconds", "Time spent per pipeline "
                                "stage: read and decode per sample; batch, device_copy and "
                                "send per batch.", ["stage"], buckets=_STAGE_BUCKETS, registry=r)
        self._wait = Histogram("gpufeed_trainer_wait_seconds", "Time a trainer waited for a "
                               "batch, as the trainer reports it (a data stall when large).",
                               ["transport"], buckets=_WAIT_BUCKETS, registry=r)
        self._list_parses = Counter("gpufeed_list_parses", "Sample lists read to plan streams: "
                                    "list files parsed, directory trees listed (once per "
                                    "list and version while streams share it).", ["kind"],
                                    registry=r)
        Info("gpufeed_build", "The running gpufeed version.", registry=r).info(
            {"version": gpufeed.__version__})
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        for transport in TRANSPORTS:
            for family in (self._samples, self._batches, self._batch_bytes,
                           self._message_bytes, self._streams, self._wait):
                family.labels(transport)
        for category in FAILURE_CATEGORIES:
            self._failures.labels(category)
        for code in REFUSAL_CODES:
            self._refused.labels(code)
        for kind in LIST_KINDS:
            self._list_parses.labels(kind)
        # Stream code times its stages with ``with metrics.stages["read"].time():``.
        self.stages = {stage: self._stage.labels(stage) for stage in STAGES}
        self._live = _LiveState(pool)
        r.register(self._live)
        self._http = None
        self.address = ""

    def opened(self, stream, transport: int) -> None:
        """A stream started serving: it counts as active until ``closed``."""
        name = transport_name(transport)
        self._streams.labels(name).inc()
        self._live.add(stream, name)

    def refused(self, code) -> None:
        """A Stream call refused with ``code`` (a grpc.StatusCode)."""
        self._refused.labels(code.name).inc()

    def list_parsed(self, kind: str) -> None:
        """A sample list was read to plan a stream (``kind``: one of ``LIST_KINDS``)."""
        self._list_parses.labels(kind).inc()

    def watch_lists(self, held) -> None:
        """Report the server's kept lists: ``held()`` gives (lists, bytes) at each scrape."""
        self._live.held_lists = held

    def closed(self, stream) -> None:
        """Safe to call for a stream never opened, and more than once."""
        self._live.discard(stream)

    def sent(self, transport: int, message: SentBatch, seconds: float) -> None:
        """A batch message went out: count what the trainer received, and how long it took."""
        name = transport_name(transport)
        batch = message.batch
        rows = 0
        nbytes = 0
        for tensor in batch.tensors:
            count = math.prod(tensor.shape)
            nbytes += count * carrier_dtype(tensor.dtype).itemsize
            if tensor.name == "index":
                rows = count
        self._samples.labels(name).inc(rows)
        self._batches.labels(name).inc()
        self._batch_bytes.labels(name).inc(nbytes)
        self._message_bytes.labels(name).inc(message.ByteSize())
        self.stages["send"].observe(seconds)

    def failed(self, categories: list[int]) -> None:
        """Samples of a finished batch that failed, by ``feed_pb2.FailureCategory``
        (counted even if the batch is never sent)."""
        for category in categories:
            self._failures.labels(failure_category_name(category)).inc()

    def released(self, transport: int, release: feed_pb2.Release) -> None:
        """Record the trainer's wait for a batch, carried by its Release.

        ``wait_seconds`` is a plain proto3 double, so 0 is also "not reported":
        an older client, or the later Release that only returns a shm slot the
        trainer dropped. A real wait is measured with a monotonic clock around a
        blocking call and is never exactly 0, so only positive values count;
        each received batch is then observed once.
        """
        seconds = getattr(release, "wait_seconds", 0.0)  # absent from stubs older than the field
        if seconds > 0 and math.isfinite(seconds):
            self._wait.labels(transport_name(transport)).observe(seconds)

    def serve(self, host: str, port: int) -> str:
        """Serve /metrics on ``host:port`` (a thread); returns the address bound."""
        host = host.strip("[]") or "0.0.0.0"
        try:
            self._http, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {host}:{port} (--metrics-port): "
                          f"{e.strerror or e}") from None
        self._thread = thread
        bound = self._http.server_port
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        return self.address

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._thread.join()
            self._http = None


class _LiveState(Collector):
    """Gauges read from the live streams and the decode pool at scrape time."""

    def __init__(self, pool):
        self._pool = pool
        self._streams: dict[Any, str] = {}  # a stream (serving/running/stream.py) -> its transport
        self._lock = threading.Lock()
        self.held_lists = lambda: (0, 0)  # the servicer's kept lists: (lists, bytes)

    def add(self, stream, transport: str) -> None:
        with self._lock:
            self._streams[stream] = transport

    def discard(self, stream) -> None:
        with self._lock:
            self._streams.pop(stream, None)

    def collect(self):
        with self._lock:
            streams = list(self._streams.items())
        active: dict[str, int] = dict.fromkeys(TRANSPORTS, 0)
        leased: dict[str, int] = dict.fromkeys(TRANSPORTS, 0)
        for stream, transport in streams:
            active[transport] += 1
            # len() of the ring's lease dict: atomic under the GIL, good enough for a gauge.
            leased[transport] += stream.ring.leased()
        yield _by_transport("gpufeed_active_streams", "Streams being served.", active)
        yield _by_transport("gpufeed_slots_leased", "Ring slots leased to batches (being "
                            "filled, or held by the trainer until it releases them).", leased)
        lists, nbytes = self.held_lists()
        yield GaugeMetricFamily("gpufeed_shared_lists", "Sample lists kept for the streams "
                                "that read them (in use, or idle until dropped).", value=lists)
        yield GaugeMetricFamily("gpufeed_shared_list_bytes", "Bytes those lists hold, counted "
                                "once against --max-memory-bytes.", value=nbytes)
        if self._pool is not None:
            yield GaugeMetricFamily("gpufeed_decode_queue_tasks", "Sample decodes waiting for "
                                    "a decode thread.", value=self._pool.queued())
            yield from self._queues_by_stream(streams)
            yield GaugeMetricFamily("gpufeed_decode_threads", "Decode threads shared by all "
                                    "streams.", value=self._pool.threads)

    def _queues_by_stream(self, streams):
        """The deepest stream queue (fairness at a glance) and the queue of each shared job.

        A job label per job name: jobs are few and named by operators. Private
        streams are not labelled one by one, which would be unbounded.
        """
        queued = self._pool.queued_by_owner()
        deepest = 0
        jobs = GaugeMetricFamily("gpufeed_job_queue_tasks", "Sample decodes waiting, summed "
                                 "over the consumers of each shared job.", labels=["job"])
        by_job: dict[str, int] = {}
        for stream, _ in streams:
            rows = queued.get(stream, 0)
            deepest = max(deepest, rows)
            job = getattr(stream.source, "name", "")
            if job:
                by_job[job] = by_job.get(job, 0) + rows
        for job, rows in sorted(by_job.items()):
            jobs.add_metric([job], rows)
        yield GaugeMetricFamily("gpufeed_stream_queue_tasks_max", "Sample decodes waiting for "
                                "the one stream with the most.", value=deepest)
        yield jobs

    def describe(self):
        # Collision checks at registration only need the names, not live values.
        return list(self.collect())


def _by_transport(name: str, documentation: str, values: dict[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["transport"])
    for transport, value in values.items():
        family.add_metric([transport], value)
    return family
