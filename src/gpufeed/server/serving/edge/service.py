"""The gRPC servicer: Info, and Stream from request to last batch.

A Stream call runs on a gRPC worker thread, which yields the header and then
each published batch. A second thread per stream reads the client's later
messages (attached, release). A stream of shared memory whose client took its
lane (lane.py) sends the batches there instead, and a third thread reads the
releases that come back on it. The stream's slots live in one ``SlotMemory``
(memory/slots.py), chosen by ``SlotMemories`` for the transport; this module
never asks which. Whatever ends the call (last batch, client gone, bad
message, server stopping), ``finally`` closes the stream: decode work is
cancelled and its memory is let go, once a client that maps or opens it has
(or left, or had ``_ATTACH_GRACE`` seconds to), so that the status it gets is
the real one and not "cannot map".

Each stream logs one line when it opens and one when it ends, or one when it
is refused instead (peer, transport, samples, batches, failures, duration,
status); refusals are also counted by status code.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import NoReturn

import grpc

import gpufeed
from gpufeed.v1 import feed_pb2, feed_pb2_grpc
from gpufeed.v1.vocabulary import LANE_MESSAGE_BYTES, UNREAD, transport_name, wire_text

from ...config import Limits
from ...media.samples import Decoders
from ...memory.budget import MemoryBudget, MemoryExhausted
from ...memory.memories import SlotMemories
from ...memory.shm import ShmNamespace
from ...memory.slots import SlotMemory
from ...metrics import ServerMetrics
from ...storage.roots import Storage
from ..errors import (
    BadClientMessage,
    ClientGone,
    Draining,
    FailureBudgetSpent,
    Forbidden,
    InvalidRequest,
    LeaseExpired,
    LimitExceeded,
    NotFound,
    Refused,
    ServerFault,
    StreamEnded,
    UnpaddableBatch,
    Unsupported,
)
from ..planning.lists import IDLE_SECONDS, SharedLists
from ..planning.plan import StreamPlan, plan_stream
from ..planning.thread import Planning, PlanStopped
from ..running.pool import DecodePool
from ..running.sources import DealtBatches, JobRegistry, SharedJob
from ..running.stream import SlotBatch, Stream
from .lane import StreamLane
from .readers import read_client, read_lane
from .watchdog import Watchdog, end_call
from .wire import InlineBatch, serialize

__all__ = ["FeedServicer"]

_log = logging.getLogger(__name__)
# A client whose stream's memory is shared maps or opens it as soon as it reads
# the header; one that has not after this many seconds never will.
_ATTACH_GRACE = 10.0
# A client connects to the lane and sends its token before it says `attached`, so
# both are waiting when the server reads that: this bound is for a client that lied.
_LANE_CONNECT_SECONDS = 2.0
# A status's message travels as an HTTP/2 header, percent-encoded (up to 3 bytes a
# byte). A client drops a response whose headers pass 8 KB (grpc's soft limit: at
# random up to the 16 KB hard one) and reports RESOURCE_EXHAUSTED instead, so a
# message naming a long path (a request may send 64 MiB of them) is shortened to
# this many UTF-8 bytes, its start (the field) and end kept.
_STATUS_MESSAGE_BYTES = 2048
# On a lane: the next batch comes on the call.
_ON_CALL = feed_pb2.ServerMessage(on_call=feed_pb2.OnCall()).SerializeToString()
# The status code a client sees for each way a request is refused or a stream ends
# (serving/errors.py): chosen here only. ClientGone has none: nobody is left to tell.
_STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Forbidden: grpc.StatusCode.PERMISSION_DENIED,
    LimitExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    MemoryExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unsupported: grpc.StatusCode.FAILED_PRECONDITION,
    LeaseExpired: grpc.StatusCode.UNAVAILABLE,
    Draining: grpc.StatusCode.UNAVAILABLE,
    FailureBudgetSpent: grpc.StatusCode.DATA_LOSS,
    UnpaddableBatch: grpc.StatusCode.DATA_LOSS,
    BadClientMessage: grpc.StatusCode.INVALID_ARGUMENT,
    ServerFault: grpc.StatusCode.INTERNAL,
}


def _status(error: Exception) -> grpc.StatusCode | None:
    """The status code for a refusal or a stream's end; None for ClientGone."""
    return next((code for kind, code in _STATUS.items() if isinstance(error, kind)), None)


class FeedServicer(feed_pb2_grpc.FeedServicer):
    """The Feed service: ``Info`` (what this server offers) and ``Stream`` (one pass).

    Contract: a ``Stream`` call's first message is ``open`` with the request; the
    request is checked and planned (``plan_stream``), admitted under
    ``max_streams`` and the memory budget, and then served as a ``Stream`` whose
    rows the shared ``pool`` decodes. Every refusal ends the call with a status
    code and a message naming the cause (INVALID_ARGUMENT for a bad request,
    RESOURCE_EXHAUSTED for a full server, UNAVAILABLE while draining), before
    any batch. Once served, a call ends OK after its last batch, or with the
    status of what ended it; either way its decode work stops and its slot
    memory is freed. Status codes are chosen here, at the gRPC edge; the modules
    below raise. ``drain(grace)`` refuses new streams and ends open ones after
    ``grace`` seconds. Thread-safe: gRPC calls every method from its own threads.

    A list file or directory tree is read once for all the streams that name it
    (planning/lists.py), held by each stream's plan until the stream ends, and kept
    ``list_idle_seconds`` after the last one; it counts once in the memory budget.
    """

    def __init__(self, storage: Storage, pool: DecodePool[Decoders], shm: ShmNamespace,
                 limits: Limits, max_streams: int, metrics: ServerMetrics | None = None,
                 device=None, watchdog: Watchdog | None = None, *, batch_decode: bool = False,
                 list_idle_seconds: float = IDLE_SECONDS):
        self._watchdog = watchdog if watchdog is not None else Watchdog()
        self._storage = storage
        self._device = device  # a torch.device for cuda:N; None on a CPU server
        self._metrics = metrics if metrics is not None else ServerMetrics(pool)
        self._pool = pool
        self._memories = SlotMemories(shm, device, self._metrics.stages["device_copy"].observe)
        self.transports = self._memories.transports
        self._limits = limits
        self._batch_decode = batch_decode  # JPEGs a batch at a time (media/batch_jpeg.py)
        self._max_streams = max_streams
        self._streams: set[Stream] = set()
        self._plannings: set[Planning[StreamPlan]] = set()  # requests being planned
        self._open_streams = 0  # counted from admission, before their Stream exists
        self._planned_on = 0  # planning threads still running after their call ended
        self._draining = False
        self._jobs = JobRegistry()
        self._memory = MemoryBudget(limits.max_memory_bytes)  # every stream's ring and plan
        # The lists streams share, counted once in the budget; unused ones go before a refusal.
        self.lists = SharedLists(self._memory, list_idle_seconds, self._metrics.list_parsed)
        self._memory.reclaim = self.lists.reclaim
        self._metrics.watch_lists(self.lists.held)
        self._lock = threading.Condition()

    def Info(self, request, context):
        return feed_pb2.InfoResponse(
            version=gpufeed.__version__,
            devices=[str(self._device or "cpu")],
            gpu_uuid=self._memories.gpu_uuid,
            transports=self.transports,
            data_roots=self._storage.roots,
            shm_probe=self._memories.shm_probe(),
            decode_threads=self._pool.threads,
        )

    def Stream(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "open":
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                         "the first message of a stream must be `open` with the request")
        refusal = self._enter()
        if refusal is not None:
            self._refuse(context, *refusal)
        reserved = 0
        held: StreamPlan | None = None  # its shared lists are let go when the call ends
        planning = Planning(partial(plan_stream, first.open, self._storage, self._limits,
                                    self.transports, batch_decode=self._batch_decode,
                                    lists=self.lists), discard=StreamPlan.release)
        try:
            with self._lock:
                self._plannings.add(planning)
            if not context.add_callback(planning.stop):  # the call has ended already
                planning.stop()
            try:
                plan = held = self._planned(planning)
                reserved = self._memory.reserve(
                    plan.num_slots * plan.layout.slot_bytes + plan.nbytes,
                    f"this stream ({plan.num_slots} slots of {plan.layout.slot_bytes} bytes, "
                    f"and {plan.nbytes} for its sample list)")
                job = self._jobs.join(first.open, plan) if first.open.job else None
                memory = self._memories.open(plan)
            except (Refused, MemoryExhausted, Draining) as e:
                refusal = _status(e) or grpc.StatusCode.INTERNAL, str(e)  # INTERNAL: not mapped
            except ClientGone:
                return
            else:
                refusal = None
            if refusal is not None:  # refused outside `except`: see _serve
                if held is not None:
                    held.release()
                plan = held = None
                self._refuse(context, *refusal)
            yield from self._serve(plan, job, memory, request_iterator, context)
        finally:
            self._memory.give_back(reserved)
            if held is not None:
                held.release()
            with self._lock:
                self._plannings.discard(planning)
                self._open_streams -= 1
                self._planned_on += 1  # until its planning thread has ended (planning/thread.py)
                self._lock.notify_all()
            planning.when_finished(self._planning_ended)

    def _planned(self, planning: Planning[StreamPlan]) -> StreamPlan:
        """The stream's plan; Draining when the server began to drain meanwhile, and
        ClientGone when the call ended first (nobody is left to tell)."""
        try:
            return planning.wait()
        except PlanStopped:
            if self._draining:
                raise Draining("the server is shutting down") from None
            raise ClientGone("the client left while its stream was planned") from None

    def _planning_ended(self) -> None:
        with self._lock:
            self._planned_on -= 1

    def _refuse(self, context: grpc.ServicerContext, code: grpc.StatusCode,
                message: str) -> NoReturn:
        """Log, count and end a stream that is not served (raises, as context.abort does)."""
        message = _status_message(message)
        _log.warning("stream refused: peer=%s status=%s: %s", context.peer(), code.name, message)
        self._metrics.refused(code)
        context.abort(code, message)

    def drain(self, grace: float) -> None:
        """Refuse new streams; give open ones ``grace`` seconds, then end them UNAVAILABLE."""
        with self._lock:
            self._draining = True
            for planning in self._plannings:  # not yet served: ended now (UNAVAILABLE)
                planning.stop()
            if not self._lock.wait_for(lambda: self._open_streams == 0, timeout=grace):
                for stream in self._streams:
                    stream.cancel(Draining("the server is shutting down; resume from your "
                                           "position"))
                self._lock.wait_for(lambda: self._open_streams == 0, timeout=5.0)
        self.lists.close()  # no idle list is kept for a later stream

    def _offer_lane(self, memory: SlotMemory) -> StreamLane | None:
        """A lane for a stream of shared memory, if this server has a /dev/shm for it."""
        name = self._memories.lane_name() if memory.shared else None
        if name is None:
            return None
        try:
            return StreamLane(name)
        except OSError as e:
            _log.warning("no lane for this stream (%s): its batches go on the call", e)
            return None

    def _enter(self) -> tuple[grpc.StatusCode, str] | None:
        """Admit a stream, or say why not."""
        with self._lock:
            if self._draining:
                return grpc.StatusCode.UNAVAILABLE, "the server is shutting down"
            # A planning thread whose call has ended still counts: calls opened and
            # cancelled in a loop must not pile them up beyond the limit.
            if self._open_streams + self._planned_on >= self._max_streams:
                return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the server already serves {self._max_streams} streams "
                        f"(--max-streams {self._max_streams}); retry later")
            self._open_streams += 1
            return None

    def _serve(self, plan: StreamPlan, job: SharedJob | None, memory: SlotMemory,
               request_iterator, context):
        source = DealtBatches(len(plan.batches), plan.num_slots) if plan.dealt else job
        stream = Stream(plan, self._storage, self._pool, memory, self._metrics, source=source)
        reader = threading.Thread(target=read_client, name="gpufeed-client-reader",
                                  args=(request_iterator, stream), daemon=True)
        with self._lock:
            self._streams.add(stream)
        header_sent_at = None
        log = _StreamLog(context.peer(), plan, job)
        ending = None
        lane = self._offer_lane(memory)
        if lane is not None and not context.add_callback(lane.shutdown):  # the call ended:
            lane.shutdown()  # whatever waits on the lane wakes (a drain, the server stopping)
        # A client that stops reading blocks the handler in `yield` (HTTP/2 flow
        # control) or in the lane's send, where the lease timeout in
        # Stream.published() cannot see it.
        stalled = self._watchdog.alarm(
            lambda: _end_stalled(stream, context, plan.lease_timeout, lane))
        try:
            if job is not None:
                job.add_consumer(stream.wake)
            if not context.add_callback(stream.client_left):  # the call has ended already
                stream.client_left()
            self._metrics.opened(stream, plan.transport)
            stream.start()
            reader.start()
            stalled.arm(plan.lease_timeout)
            header = feed_pb2.StreamHeader(
                # protoc's generated stub types an enum field as its enum class only;
                # protobuf takes the int the plan holds.
                transport=plan.transport,  # pyright: ignore[reportArgumentType]
                num_slots=plan.num_slots,
                slot_bytes=plan.layout.slot_bytes,
                num_samples=0 if job else plan.num_samples,
                num_batches=0 if job else len(plan.batches) - plan.start_batch,
                classes=plan.classes,
                start_batch=0 if job else plan.start_batch,
                resumed_phases=plan.resumed,
                dealt=plan.dealt,
            )
            header.MergeFrom(memory.header())  # where the memory is: its own fields
            if lane is not None:
                header.lane_name, header.lane_token = lane.name, lane.token
            yield feed_pb2.ServerMessage(header=header)
            stalled.disarm()
            header_sent_at = time.monotonic()
            if lane is not None:
                log.lane = False
                lane = _take_lane(lane, stream)
                log.lane = lane is not None
            for batch in stream.published():
                message = _batch_message(*memory.publish(batch), plan)
                sending = time.perf_counter()
                stalled.arm(plan.lease_timeout)
                if lane is None:
                    yield message  # returns once gRPC has taken the message
                else:
                    sent = _sent_on_lane(lane, message, stream)
                    if sent is None:
                        continue  # the lane failed, which ended the stream: published() raises
                    if not sent:
                        yield message  # too large for the lane, which said it comes here
                stalled.disarm()
                log.sent(batch)
                if batch.rows:
                    self._metrics.sent(plan.transport, message, time.perf_counter() - sending)
            log.status = "OK"
        except StreamEnded as e:
            ending = _status(e), str(e)
            log.status = (f"{ending[0].name}: {e}" if ending[0] is not None
                          else "CANCELLED: the client went away")
        except Exception as e:  # a bug: gRPC ends the call with UNKNOWN
            log.status = f"UNKNOWN: {type(e).__name__}: {e}"
            raise
        finally:
            try:
                stalled.close()
                log.ended()
                with self._lock:
                    self._streams.discard(stream)
                self._metrics.closed(stream)
                stream.close()
                if job is not None:
                    job.remove_consumer(stream.wake)
                if header_sent_at is not None and memory.shared:
                    # The client may be opening what the header named: not gone until it has.
                    stream.wait_attached(header_sent_at + _ATTACH_GRACE)
                memory.close()
            finally:
                if lane is not None:  # before the call's status, which the trainer then reads
                    lane.finish(plan.lease_timeout)
        # Aborting inside `except` would leave the exception, this frame and the stream
        # (with its plan) in a reference cycle, freed only at a garbage collection.
        if ending is not None and ending[0] is not None:
            context.abort(ending[0], _status_message(ending[1]))


def _status_message(message: str) -> str:
    """``message``, or its start and end when over ``_STATUS_MESSAGE_BYTES``."""
    message = wire_text(message)
    data = message.encode()
    if len(data) <= _STATUS_MESSAGE_BYTES:
        return message
    half = _STATUS_MESSAGE_BYTES // 2
    head, tail = data[:half].decode(errors="ignore"), data[-half:].decode(errors="ignore")
    return f"{head} ... ({len(data) - 2 * half} bytes left out) ... {tail}"


def _end_stalled(stream: Stream, context, lease_timeout: float,
                 lane: StreamLane | None) -> None:
    """End a stream whose client has not taken a message for ``lease_timeout`` seconds."""
    ending = LeaseExpired(f"lease timeout: the trainer read nothing for {lease_timeout:g} s "
                          f"(server's --lease-timeout); resume from your position")
    stream.cancel(ending)
    if lane is not None:
        lane.shutdown()
    end_call(context, _STATUS[LeaseExpired], str(ending))


def _take_lane(lane: StreamLane, stream: Stream) -> StreamLane | None:
    """The lane, once the client has said it reads there (and connected); None when it
    said it reads the call, or said nothing within ``_ATTACH_GRACE`` (the call it is),
    or the stream ended first."""
    stream.wait_attached_while_serving(time.monotonic() + _ATTACH_GRACE)
    if stream.cancelled or not stream.reads_lane:
        lane.close()
        return None
    lane.accept(_LANE_CONNECT_SECONDS)  # BadClientMessage if it did not connect
    lane.reader = threading.Thread(target=read_lane, name="gpufeed-lane-reader",
                                   args=(lane, stream), daemon=True)
    lane.reader.start()
    return lane


def _sent_on_lane(lane: StreamLane, message: feed_pb2.ServerMessage | InlineBatch,
                  stream: Stream) -> bool | None:
    """Whether ``message`` went on the lane (True), or on the call after the lane said so
    (False: too large for it); None if the lane failed, which ends the stream."""
    data = serialize(message)
    fits = len(data) <= LANE_MESSAGE_BYTES
    try:
        lane.send(data if fits else _ON_CALL)
    except OSError as e:  # the trainer closed the lane, or the stream was ended and shut it
        stream.cancel(ClientGone(f"the lane failed: {e}"))  # no-op if ended: that ending stands
        return None
    return fits


class _StreamLog:
    """The open and end lines of one stream's log, and what it delivered in between."""

    def __init__(self, peer: str, plan: StreamPlan, job: SharedJob | None):
        self._peer = peer
        self._transport = transport_name(plan.transport)
        self._started = time.monotonic()
        self.samples = self.batches = self.failures = 0
        self.lane: bool | None = None  # shared memory: whether its batches went on the lane
        # What ends the stream unless something else does: the generator closed by gRPC.
        self.status = "CANCELLED: the client went away"
        _log.info("stream open: peer=%s transport=%s samples=%s batches=%s start_batch=%d%s",
                  peer, self._transport, "?" if job else plan.num_samples,
                  "?" if job else len(plan.batches) - plan.start_batch, plan.start_batch,
                  f" job={job.name!r}" if job else "")

    def sent(self, batch: SlotBatch) -> None:
        self.samples += batch.rows
        self.batches += 1 if batch.rows else 0
        self.failures += len(batch.failures)

    def ended(self) -> None:
        # A stream its client never read (a loader not iterated yet) ending at the lease
        # timeout is routine: the client reopens it when the trainer gets to it.
        routine = self.status.startswith(("OK", "CANCELLED")) or UNREAD in self.status
        level = logging.INFO if routine else logging.WARNING
        lane = "" if self.lane is None else f" lane={'yes' if self.lane else 'no'}"
        _log.log(level, "stream end: peer=%s transport=%s%s samples=%d batches=%d failures=%d "
                 "duration=%.3fs status=%s", self._peer, self._transport, lane, self.samples,
                 self.batches, self.failures, time.monotonic() - self._started, self.status)


def _batch_message(fields: feed_pb2.Batch, data: list[memoryview] | None,
                   plan: StreamPlan) -> feed_pb2.ServerMessage | InlineBatch:
    """The message of a published batch: its fields, and ``data`` (views of its rows,
    which ``wire.serialize`` writes once, compressed if the plan asks) when its
    memory sends the arrays in the message. One whose every sample failed has no
    tensors: the client notes its failures and yields nothing for it (an empty
    batch would make a NaN loss), and its position still moves past it."""
    if data is None:
        return feed_pb2.ServerMessage(batch=fields)
    return InlineBatch(fields, data, plan.compress, plan.compression)
