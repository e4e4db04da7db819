"""A pass over several servers, its batches dealt to each by its pace.

The loader opens one ``dealt`` stream per server and hands out the pass's
batches (Deal messages) one at a time, each to the stream expected to deliver
it first: a stream that has ``q`` batches handed and not yet arrived, and
takes ``t`` seconds a batch (a moving average of what it took), is expected
to deliver a new one in ``(q + 1) t``. A stream holds at most its slots'
worth of handed batches; when the stream expected first has no room, the
batch waits for it rather than go to a slower one. So a server twice as fast
makes about twice as many batches, one twenty times slower makes almost none
(handed to it, a batch would hold the pass back), and the pass runs at about
the sum of the servers' paces; on a tie the server listed first is preferred,
so a trainer that lists its local server first draws from it at its full pace
and from the others only what it cannot make. (Dealing in turn, server p
making batches p, p + P, ..., runs a pass at P times the slowest one's pace.)

The trainer still gets the pass's batch k as its k-th: a batch that arrives
before those ahead of it waits in a reorder buffer, and no batch is handed
more than ``window`` past the next one to yield, which bounds what the buffer
holds. The content of batch k is the pass's whatever server makes it, so the
order, and a position saved with any number of servers, are those of one
server.

Each stream has a reader thread, so a batch is taken off the wire as soon as
it arrives (and its slot freed, inline) whichever batch the trainer waits for.
A stream that breaks with UNAVAILABLE gives the batches it had been handed
back, to be handed to the other streams first; servers that are up and have
no stream (one a DNS name now lists) are opened then, and the pass goes on
over the streams it has. Only when none is left does the loader wait for a
server to come back, up to its reconnect timeout.
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import grpc
import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import UNHANDED

from .checks import data_loss
from .errors import FeedError, as_raised, status_of
from .stream import OpenStream

__all__ = ["DealtPass"]

_log = logging.getLogger(__name__)
_MAX_BACKOFF = 2.0
_END_GRACE = 5.0  # seconds a finished pass waits for its streams to end before cancelling them

Batch = tuple[list[feed_pb2.SampleFailure], "dict[str, torch.Tensor] | None"]


class _Dealt:
    """One server's stream in the pass: the batches handed to it that have not arrived,
    and how long it takes a batch."""

    def __init__(self, server: str, stream: OpenStream):
        self.server = server
        self.stream = stream
        self.room = stream.header.num_slots
        # Appended by the trainer's thread, popped by the reader's: (number, when handed).
        self.handed: deque[tuple[int, float]] = deque()
        self.seconds = 0.0  # a batch's time (moving average); 0 until one has arrived
        self._last_arrival = 0.0

    def expected(self, unknown: float) -> float:
        """When a batch handed now would arrive, in seconds from now: after those handed
        before it, or later if the oldest of them is overdue (a server that has stalled
        is passed over). ``unknown`` stands for the batch time of a stream that has
        delivered nothing yet."""
        seconds = self.seconds or unknown
        try:
            waited = time.monotonic() - self.handed[0][1]
        except IndexError:  # nothing handed (or the reader just took the last)
            waited = 0.0
        return max((len(self.handed) + 1) * seconds, waited + seconds)

    def hand(self, numbers: list[int], last: bool = False) -> None:
        now = time.monotonic()
        self.handed.extend((number, now) for number in numbers)  # before the Deal: the
        self.stream.deal(numbers, last)  # reader may pop it at once

    def _arrived(self) -> int:
        """The number of the batch that just arrived; its time goes into the average."""
        number, handed_at = self.handed.popleft()
        now = time.monotonic()
        took = now - max(handed_at, self._last_arrival)  # from when the server could start it
        self.seconds = took if self.seconds == 0 else 0.8 * self.seconds + 0.2 * took
        self._last_arrival = now
        return number

    def read(self, arrivals: queue.SimpleQueue) -> None:
        """Put (self, number, batch) on ``arrivals`` as batches come; then (self, None,
        error), the error None at the stream's end (the reader thread)."""
        error: BaseException | None = None
        try:
            for _, failures, tensors in self.stream.batches():
                if not self.handed:
                    raise data_loss(f"{self.server} sent a batch it was not handed")
                arrivals.put((self, self._arrived(), (list(failures), tensors)))
        except BaseException as e:  # whatever it is, the trainer's thread decides
            error = e
        arrivals.put((self, None, error))


class DealtPass:
    """The batches ``start`` .. ``total - 1`` of a pass, dealt over ``streams`` (by server).

    ``reopen(server)`` opens a dealt stream on a server (raising grpc.RpcError or
    FeedError); ``servers_up()`` lists the servers up now; ``reconnect_timeout``
    bounds a wait with no stream left (0: an outage is an error at once).
    Iterating yields (failures, tensors) per batch in the pass's order; ``close()``
    ends every stream.
    """

    def __init__(self, streams: dict[str, OpenStream], start: int, total: int, *,
                 reopen: Callable[[str], OpenStream], servers_up: Callable[[], list[str]],
                 reconnect_timeout: float):
        self._reopen = reopen
        self._servers_up = servers_up
        self._reconnect_timeout = reconnect_timeout
        self._arrivals: queue.SimpleQueue = queue.SimpleQueue()
        self._live: list[_Dealt] = []
        self._lost: set[str] = set()  # servers whose stream broke this pass: not reopened at once
        self._next = start  # the batch to yield next
        self._new = start  # the lowest batch never handed
        self._total = total
        self._again: list[int] = []  # handed to a stream that broke: hand first, sorted
        self._arrived: dict[int, Batch] = {}
        try:
            for server, stream in streams.items():
                self._add(server, stream)
        except BaseException:
            added = {id(dealt.stream) for dealt in self._live}
            for stream in streams.values():
                if id(stream) not in added:
                    stream.close()
            self.close()
            raise

    @property
    def window(self) -> int:
        """How far past the next batch to yield a batch may be handed: twice the slots of
        the streams (so a slow server's batch does not stop the fast ones at once)."""
        return 2 * sum(dealt.room for dealt in self._live)

    def __iter__(self) -> Iterator[Batch]:
        while self._next < self._total:
            self._hand_out()
            batch = self._arrived.pop(self._next, None)
            if batch is not None:
                self._next += 1
                yield batch
                continue
            dealt, number, arrived = self._arrivals.get()
            if number is not None:
                self._arrived[number] = arrived
            elif dealt in self._live:  # the stream ended, or broke
                self._lose(dealt, arrived)
        self._end_streams()

    def _end_streams(self) -> None:
        """Every batch has arrived: say `last`, and wait (briefly) for each stream to end,
        so that the servers end them OK rather than see the call cancelled."""
        for dealt in self._live:
            dealt.hand([], last=True)
        ending = set(self._live)
        deadline = time.monotonic() + _END_GRACE
        while ending:
            try:
                dealt, number, _ = self._arrivals.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                return  # close() cancels what has not ended
            if number is None:
                ending.discard(dealt)

    def close(self) -> None:
        for dealt in self._live:
            dealt.stream.close()
        self._live.clear()

    def _add(self, server: str, stream: OpenStream) -> None:
        """Read ``stream`` into the pass; DATA_LOSS (the caller closes it) if its server
        counts another number of batches in the pass."""
        if stream.header.num_batches != self._total:
            raise data_loss(f"{server} declares {stream.header.num_batches} batches in the pass, "
                            f"another server {self._total}")
        dealt = _Dealt(server, stream)
        self._live.append(dealt)
        threading.Thread(target=dealt.read, args=(self._arrivals,), daemon=True,
                         name=f"gpufeed-dealt-{server}").start()

    def _hand_out(self) -> None:
        """Hand out the next batches (those given back first, then new ones within the
        window), each to the stream expected to deliver it first, while that one has room."""
        limit = min(self._total, self._next + self.window)
        # A stream that has delivered nothing yet counts as the slowest that has (or near
        # instant when none has): it gets batches when the others are full.
        unknown = max((dealt.seconds for dealt in self._live), default=0.0) or 1e-9
        while self._live and (self._again or self._new < limit):
            # min() keeps the first of equals: on a tie, the server listed first.
            dealt = min(self._live, key=lambda d: d.expected(unknown))
            if len(dealt.handed) >= dealt.room:
                return  # the quickest has no room: the batch waits for it
            if self._again:
                number = self._again.pop(0)
            else:
                number, self._new = self._new, self._new + 1
            dealt.hand([number])

    def _lose(self, dealt: _Dealt, error: BaseException | None) -> None:
        """A stream ended before the pass did: give its batches back to be handed again,
        and go on over the others (after opening the servers that are up and have none)."""
        self._live.remove(dealt)
        dealt.stream.close()
        for number, _ in dealt.handed:
            bisect.insort(self._again, number)
        dealt.handed.clear()
        if error is None:
            error = FeedError(grpc.StatusCode.UNAVAILABLE,
                              f"{dealt.server} ended its stream before the pass did")
        code, details = status_of(error)
        if code == grpc.StatusCode.UNAVAILABLE and UNHANDED in details:
            # Routine: a stream opened ahead, or a server the others outpaced, left
            # without a batch for the server's lease timeout. Open it again.
            _log.info("%s ended a stream it was handed nothing for; opening another",
                      dealt.server)
            if self._join(dealt.server):
                return
        if code != grpc.StatusCode.UNAVAILABLE or self._reconnect_timeout <= 0:
            raise as_raised(error, dealt.server) from None
        _log.warning("stream from %s interrupted (%s); its batches go to the other servers",
                     dealt.server, details)
        self._lost.add(dealt.server)
        self._join_servers_up(skip=self._lost)
        if not self._live:
            self._wait_for_a_server(details)

    def _join_servers_up(self, skip: set[str]) -> None:
        """Open a stream on each server up that has none (and is not in ``skip``)."""
        serving = {dealt.server for dealt in self._live}
        for server in self._servers_up():
            if server not in serving and server not in skip:
                self._join(server)

    def _join(self, server: str) -> bool:
        """Open a stream on ``server`` into the pass; False if it does not serve now. A
        refusal other than an outage is raised when no stream is left, else logged."""
        try:
            stream = self._reopen(server)
            try:
                self._add(server, stream)
            except BaseException:
                stream.close()
                raise
            return True
        except (grpc.RpcError, FeedError) as e:
            code, details = status_of(e)
            if code != grpc.StatusCode.UNAVAILABLE and not self._live:
                raise as_raised(e, server) from None
            level = logging.INFO if code == grpc.StatusCode.UNAVAILABLE else logging.WARNING
            _log.log(level, "%s is not serving this pass (%s)", server, details)
            return False

    def _wait_for_a_server(self, details: str) -> None:
        """No stream left: try every server up, with backoff, until one serves or the
        reconnect timeout has passed."""
        since, backoff = time.monotonic(), 0.05
        while not self._live:
            if time.monotonic() - since >= self._reconnect_timeout:
                raise FeedError(grpc.StatusCode.UNAVAILABLE,
                                f"gave up after {self._reconnect_timeout:g} s with no server "
                                f"serving the pass: {details}")
            self._join_servers_up(skip=set())
            if not self._live:
                time.sleep(backoff)
                backoff = min(2 * backoff, _MAX_BACKOFF)
        self._lost.clear()

