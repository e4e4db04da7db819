"""``Loader``: an iterable of batches; each pass over it is one epoch.

A pass opens a Stream for the loader's current epoch (stream.py: the header,
the stream's memory, its batches) and yields one ``dict[str, torch.Tensor]``
per batch: ``image`` uint8 [N, 3, H, W], ``index`` int64 [N] (each sample's
position in the request's file list) and ``label`` int64 [N] when labels were
given. Samples that failed to read or decode are left out of the batch; they
are logged once each and listed in ``loader.failures`` for the current pass,
each an ``(index, reason)`` pair with its ``category`` (failures.py).

The loader opens its first stream when it is made, so that a refused request
fails at ``loader(...)`` and the header's facts (``classes``, ``len``) are
known before the first batch. A server that has never answered fails it
within the connect timeout.

Epochs and passes: the loader is a position in a sequence of epochs, and a
pass (an ``iter(loader)``) takes batches from that position. A pass that
delivers its epoch's last batch ends it: the next pass is the next epoch, so
a loop that never calls ``set_epoch`` (Accelerate, with a loader that is not a
DataLoader) still gets a new order and new random crops every epoch. A pass
left early (a ``break``, an exception, a peek with ``next(iter(loader))``) only
stops taking: the next pass continues that epoch where it stopped, and
``state_dict()`` says so, so a loader restored from it does what this one
would. ``set_epoch(e)`` (directly, or through ``loader.sampler.set_epoch``, where
Lightning calls it) starts epoch ``e`` from its start, as DistributedSampler's
does, unless ``load_state_dict`` has just placed the loader inside ``e``. The
state never depends on when Python finalises an abandoned iterator: only the
newest pass may be iterated (an older one raises), and leaving one changes
nothing but its streams. ``loader.epoch`` is the epoch of the pass in progress,
or of the next one.

The loader knows its position (batches consumed in the current epoch). When a
stream breaks with UNAVAILABLE (server restarted or draining, or it ended a
stream the trainer left idle past its lease timeout), the loader reconnects
with bounded backoff and reopens at that position, so the pass neither loses
nor repeats a sample; it gives up after ``reconnect_timeout`` seconds without
progress. ``state_dict()`` records the same position, in samples of the pass,
with a fingerprint of the request (fingerprint.py) for a restarted trainer,
which may run another number of ranks (resume.py: the epoch goes on over them).

With several servers, each is handed the pass's next batches as its stream
has room (dealing.py), so each makes batches at its own pace, and the loader
yields them in the pass's order. The order is therefore the same whatever the
number of servers, and a position saved with one resumes with another. When a
server goes away, the batches it had been handed go to the others: nothing is
lost or repeated. The servers are asked again (discovery.py: a DNS name stands
for every address behind it) at each pass from an epoch's start, which is then
dealt over the servers up at that time, and when a server is lost, so that one
that appeared can join the pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterator

import grpc
import numpy as np
import torch

from gpufeed.v1 import feed_pb2
from gpufeed.v1.vocabulary import UNREAD, transport_name

from .dealing import DealtPass
from .discovery import Servers
from .errors import FeedError, as_raised, status_of
from .failures import SampleFailure
from .fingerprint import check_fingerprint, request_fingerprint
from .resume import Position
from .stream import OpenStream, open_stream

__all__ = ["Loader"]

_log = logging.getLogger(__name__)
_MAX_BACKOFF = 2.0
_MIXING = 0x6D6978  # batch_rng's stream: apart from any per-sample generator's


class _Progress:
    """How far the loader has got in its epoch, and where a one-server pass reads from."""

    def __init__(self, server: str):
        self.server = server  # a one-server pass's server; moves on when that one goes away
        self.consumed = 0  # batches of the epoch already yielded
        # A position in the pass (load_state_dict) not yet opened: a stream starts there.
        self.pass_start: int | None = None
        self.total: int | None = None  # batches in the pass (None: a shared job's, or not known)


class _Outage:
    """Reconnect bookkeeping of a one-server pass: since when, and how long to wait next."""

    def __init__(self):
        self.since: float | None = None
        self.backoff, self.tried = 0.05, 0


class _EpochSampler:
    """``loader.sampler``: the object a DataLoader's users and frameworks call
    ``set_epoch`` on (Lightning: ``dataloader.sampler.set_epoch(epoch)`` before each
    training epoch, evaluation too), so that a run resumed from an end-of-epoch
    checkpoint, which Lightning restores without ``load_state_dict``, gets its
    epoch's order and not the first run's."""

    def __init__(self, loader: Loader):
        self._loader = loader

    @property
    def epoch(self) -> int:
        return self._loader.epoch

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


class Loader:
    """An iterable of batches (``dict[str, torch.Tensor]``) over one or more servers.

    Made by ``FeedClient.loader`` with its ``Servers`` (discovery.py) and the
    checked request. Each ``iter(loader)`` is one pass: from the loader's
    position to its epoch's end (the module docstring). The loader keeps the
    pass's position (batches yielded); over one server it reads that server's
    stream, and moves to another server, at its position, when the stream
    breaks with UNAVAILABLE; over several it deals the batches (dealing.py).
    What a stream is on the wire (open, attach, release, each transport's
    tensors) is stream.py's.
    Not thread-safe: one trainer thread iterates it.
    """

    def __init__(self, servers: Servers, request: feed_pb2.StreamRequest, *, copy: bool,
                 reconnect_timeout: float):
        self._opened: dict[str, OpenStream] = {}  # opened ahead for the chosen pass, by server
        self._servers = servers
        self._request = request
        self._copy = copy
        self._reconnect_timeout = reconnect_timeout
        self._fingerprint = request_fingerprint(request)
        self._addresses = self._servers_up()  # the servers of the chosen pass
        self._progress = _Progress(self._addresses[0])
        self._world_size = request.world_size or 1
        # The epoch's earlier phases when it was resumed at another world size (resume.py).
        self._phases: tuple[tuple[int, int], ...] = ()
        # The next pass's start was chosen (by the constructor, set_epoch, load_state_dict
        # or the end of an epoch) and no pass has taken a batch from it since.
        self._chosen = True
        self._pass: object | None = None  # the pass in progress (its iterator's), if any
        self.batch_size = request.batch_size
        self.transport: str | None = None  # of the stream opened last: "inline", "shm", ...
        self.classes: list[str] = []  # with labels="folder": label i is classes[i]
        self.failures: list[SampleFailure] = []  # (index, reason) pairs, with .category
        # The last yielded batch's epoch and place in its pass (batch_rng).
        self._position: tuple[int, int] | None = None
        self._open_ahead()

    def _open_ahead(self) -> None:
        """Open the next pass's streams now (a refused request fails here; the header
        says how many batches a pass has): its server's, or every server's when it
        is dealt. A server of a dealt pass that is down is left out of it."""
        try:
            if not self._dealt():
                if not self._opened:
                    self._opened[self._progress.server] = self._open_retrying()
                return
            for address in self._addresses:
                if address not in self._opened:
                    try:
                        self._opened[address] = self._open(address, _Outage())
                    except (grpc.RpcError, FeedError) as e:
                        self._pass_over(address, e)
            if not self._opened:  # none up: wait for one as a one-server pass would
                self._opened[self._progress.server] = self._open_retrying()
        except BaseException:
            self._close_opened()
            raise

    def _dealt(self) -> bool:
        """Whether the pass is dealt over several servers (a shared job never is: its
        server deals it to its consumers)."""
        return len(self._addresses) > 1 and not self._request.job

    def _servers_up(self) -> list[str]:
        return [server.address for server in self._servers.current()]

    def close(self) -> None:
        """End the streams opened ahead for a pass that has not started (a pass's own
        streams end with it). Dropping the loader does the same."""
        self._close_opened()

    __del__ = close

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, or of the next one."""
        return self._request.epoch

    @property
    def sampler(self) -> _EpochSampler:
        """Where Lightning, and code written for a DataLoader, set the epoch:
        ``loader.sampler.set_epoch(e)`` is ``loader.set_epoch(e)``."""
        return _EpochSampler(self)

    # A DataLoader's other place for a sampler: none here (Lightning looks there too).
    batch_sampler = None

    def __len__(self) -> int:
        """Batches in a pass of this rank (a shared job's depend on its consumers)."""
        if self._request.job:
            raise TypeError("a shared job's loader has no length: its consumers share the batches")
        if self._progress.total is None and self._pass is None:
            self._open_ahead()  # resumed since a stream last said: ask
        return self._progress.total or 0

    def batch_rng(self) -> np.random.Generator:
        """A generator for the batch last yielded, seeded by (seed, epoch, rank, its place in
        the pass): mixup/cutmix (mixing.py) draw from it, so a resumed run repeats them."""
        if self._position is None:
            raise RuntimeError("batch_rng: no batch has been yielded yet")
        request = self._request
        epoch, position = self._position
        return np.random.default_rng([request.seed, epoch, request.rank, position, _MIXING])

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass ``epoch`` (and its shuffle order), from its start, unless
        ``load_state_dict`` has just placed the loader inside ``epoch`` (as Lightning
        calls both when it resumes mid-epoch). A pass in progress is over: its iterator
        raises if asked for more."""
        if not self._chosen or epoch != self._request.epoch:
            self._begin(epoch)

    def state_dict(self) -> dict:
        """{"epoch", "samples_consumed", "world_size", "resumed_from", "fingerprint"}:
        what the next batch will be, in samples of its epoch's order at this world size
        (of the current phase's order in an epoch resumed at another world size; an
        epoch whose last batch was taken is the next one's start; resume.py), and
        what request it is of. A loader restored from it does what this one will."""
        return self._where().state(self.batch_size, self._fingerprint)

    def _where(self) -> Position:
        progress = self._progress
        if progress.pass_start is not None:
            return Position(self._request.epoch, progress.pass_start, self._world_size,
                            self._phases)
        if self._at_end():
            return Position(self._request.epoch + 1, 0, self._world_size)
        return Position(self._request.epoch, progress.consumed, self._world_size, self._phases)

    def _at_end(self) -> bool:
        """Every batch of the epoch has been taken (the pass may not have noticed yet)."""
        progress = self._progress
        return (progress.pass_start is None and progress.total is not None
                and progress.consumed >= progress.total)

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass go on where ``state`` was saved, at any world size (resume.py);
        ValueError naming the field if it was saved for another request."""
        if "fingerprint" not in state:
            raise ValueError("load_state_dict: the state has no fingerprint (saved by an older "
                             "gpufeed); it cannot be checked against this loader's request")
        check_fingerprint(state["fingerprint"], self._fingerprint)
        position = Position.from_state(state, self.batch_size).at(self._world_size)
        self._begin(position.epoch)
        self._phases = position.resumed_from
        self._progress.pass_start = position.batches
        self._progress.total = None  # the header says (a resumed phase has its own count)

    def _begin(self, epoch: int) -> None:
        """Make the next pass ``epoch`` from its start; a pass in progress is over."""
        self._close_opened()
        self._request.epoch = epoch
        self._phases = ()
        self._progress.consumed, self._progress.pass_start = 0, None
        self._chosen = True
        self._pass = None

    def _deal_over_servers_up(self) -> None:
        """A pass that starts at an epoch's start, or at a saved position, is dealt over
        the servers up now (asked again); one that continues a pass left early keeps
        its servers, as do streams already opened for it."""
        progress = self._progress
        if self._opened or (progress.pass_start is None and progress.consumed):
            return
        self._addresses = self._servers_up()
        if progress.server not in self._addresses:
            progress.server = self._addresses[0]

    def _close_opened(self) -> None:
        for stream in self._opened.values():
            stream.close()
        self._opened.clear()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """A pass: batches from the loader's position to its epoch's end. It starts at its
        first ``next()``, so a ``set_epoch`` between ``iter()`` and it (Lightning's order)
        chooses its epoch."""
        this = object()
        if self._at_end():  # every batch taken, but that pass never asked for more
            self._begin(self._request.epoch + 1)
        self._deal_over_servers_up()
        self._pass, self._chosen = this, False
        self.failures = []
        batches: Generator[dict[str, torch.Tensor], None, None] | None = None
        try:
            self._open_ahead()  # the header says how many batches the pass has (len(loader))
            batches = self._dealt_batches() if self._dealt() else self._server_batches()
            while True:
                if self._pass is not this:
                    raise RuntimeError("this pass over the loader is over: a newer pass, "
                                       "set_epoch or load_state_dict has moved the loader on; "
                                       "iterate the loader again")
                batch = next(batches, None)
                if batch is None:
                    break
                self._position = (self._request.epoch, self._progress.consumed - 1)
                yield batch
            self._begin(self._request.epoch + 1)  # the epoch is over: the next pass is the next
        finally:
            if batches is not None:
                batches.close()
            if self._pass is this:
                self._pass = None

    def _server_batches(self) -> Generator[dict[str, torch.Tensor], None, None]:
        """A one-server pass's batches to the end of the epoch, across reconnects and
        failovers."""
        progress = self._progress
        outage = _Outage()
        while True:
            stream = self._opened.pop(progress.server, None)
            try:
                stream = stream or self._open(progress.server, outage)
                for seq, failures, tensors in stream.batches():
                    self._note_failures(failures)
                    progress.consumed = seq + 1
                    outage = _Outage()
                    if tensors is not None:  # None: every sample failed, nothing to train on
                        yield tensors
                if progress.total is not None and progress.consumed < progress.total:
                    raise FeedError(grpc.StatusCode.UNAVAILABLE,
                                    f"the stream ended at batch {progress.consumed} of "
                                    f"{progress.total}")
                return
            except (grpc.RpcError, FeedError) as e:
                self._recover(e, outage)
            finally:
                if stream is not None:
                    stream.close()

    def _dealt_batches(self) -> Generator[dict[str, torch.Tensor], None, None]:
        """A dealt pass's batches to the end of the epoch (dealing.py)."""
        progress = self._progress
        streams, self._opened = self._opened, {}
        total = progress.total
        assert total is not None, "a dealt pass's streams said its batches"

        def reopen(address: str) -> OpenStream:
            try:
                return self._open(address, _Outage())
            finally:  # the pass's count stands: DealtPass refuses a server that differs
                progress.total = total

        dealt = DealtPass(streams, progress.consumed, total, reopen=reopen,
                          servers_up=self._servers_up, reconnect_timeout=self._reconnect_timeout)
        try:
            for failures, tensors in dealt:
                self._note_failures(failures)
                progress.consumed += 1
                if tensors is not None:
                    yield tensors
        finally:
            dealt.close()

    def _open_retrying(self) -> OpenStream:
        """A one-server pass's stream, from its server or the next one up, across outages."""
        outage = _Outage()
        while True:
            try:
                return self._open(self._progress.server, outage)
            except (grpc.RpcError, FeedError) as e:
                self._recover(e, outage)

    def _open(self, address: str, outage: _Outage) -> OpenStream:
        """A stream of the pass from its position on ``address`` (dealt: from wherever it
        is handed); the header's facts noted."""
        server = self._servers.connection(address)
        progress = self._progress
        request = feed_pb2.StreamRequest()
        request.CopyFrom(self._request)
        auto = request.transport == feed_pb2.TRANSPORT_AUTO
        if auto:
            request.transport = server.auto_transport()  # Info, the first time
        if self._dealt() and request.transport == feed_pb2.TRANSPORT_CUDA_IPC:
            # A dealt pass reads batches on a thread per server, and a CUDA batch must be
            # made ready on the trainer's stream: shm (zero copy on the host) instead.
            if not auto:
                raise FeedError(grpc.StatusCode.INVALID_ARGUMENT,
                                "transport: cuda_ipc serves a loader of one server; with "
                                "several, use shm or auto")
            request.transport = feed_pb2.TRANSPORT_SHM
        if not server.answered:  # a wrong address or a server that is down: fail fast
            server.info()
        elif outage.since is not None:  # a server that accepts TCP but never answers
            server.wait_ready(outage.since + self._reconnect_timeout - time.monotonic())
        for size, batches in self._phases:  # an epoch resumed at another world size
            request.resumed_from.add(world_size=size, batches=batches)
        start = progress.consumed if progress.pass_start is None else progress.pass_start
        if self._dealt():
            request.dealt = True  # the client hands it the batches, from ``start`` on
        else:
            request.start_batch = start
        stream = open_stream(server, request, self._copy, auto)
        header = stream.header
        if header.resumed_phases != len(self._phases):
            stream.close()
            raise FeedError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"{server.address} applied {header.resumed_phases} of the "
                            f"{len(self._phases)} earlier phases of an epoch resumed at another "
                            f"world size (a server older than resumed_from ignores them and "
                            f"would repeat samples): upgrade it, or resume at world_size "
                            f"{self._phases[-1][0] if self._phases else self._world_size}")
        if request.dealt and not header.dealt:
            stream.close()
            raise FeedError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"{server.address} does not know `dealt` (a server older than "
                            f"dealing by pace would ignore the batches handed to it): upgrade "
                            f"it, or give the loader one server")
        progress.consumed, progress.pass_start = start, None
        self.classes = list(header.classes)
        self.transport = transport_name(header.transport)
        progress.total = None if request.job else header.start_batch + header.num_batches
        return stream

    def _outage(self, address: str, error: grpc.RpcError | FeedError) -> str:
        """``error``'s details if it is an outage of ``address`` the loader may ride out;
        else raise it as a FeedError. A server the caller named that never answered is a
        wrong address: fail now. One a DNS name listed may have gone since: pass over it,
        as over any lost server."""
        server = self._servers.connection(address)
        code, details = status_of(error)
        never = not server.answered and not self._servers.found_later(address)
        if code != grpc.StatusCode.UNAVAILABLE or self._reconnect_timeout <= 0 or never:
            raise as_raised(error, address) from None
        return details

    def _pass_over(self, address: str, error: grpc.RpcError | FeedError) -> None:
        """Leave ``address`` out of a dealt pass after an outage (the others make its
        batches); raise ``error`` as a FeedError if it is not one."""
        details = self._outage(address, error)
        _log.warning("%s is not serving (%s); the pass is dealt over the others", address,
                     details)

    def _recover(self, error: grpc.RpcError | FeedError, outage: _Outage) -> None:
        """Move a one-server pass to the next server up after an outage, waiting between
        rounds; raise ``error`` as a FeedError if it is not an outage, or has lasted too
        long."""
        progress = self._progress
        server = self._servers.connection(progress.server)
        details = self._outage(progress.server, error)
        now = time.monotonic()
        outage.since = outage.since or now
        if now - outage.since >= self._reconnect_timeout:
            raise FeedError(grpc.StatusCode.UNAVAILABLE,
                            f"gave up after {self._reconnect_timeout:g} s without a batch "
                            f"from {server.address}: {details}") from None
        up = self._servers_up()  # asked once: one may have appeared
        at = up.index(progress.server) if progress.server in up else -1
        progress.server = up[(at + 1) % len(up)]
        # A stream opened ahead that the trainer left unread past the server's lease
        # timeout (an evaluation loader while the trainer trains) is routine: quiet.
        level = logging.INFO if UNREAD in details else logging.WARNING
        _log.log(level, "stream from %s interrupted (%s); resuming at batch %d on %s",
                 server.address, details, progress.consumed, progress.server)
        outage.tried += 1
        if outage.tried >= len(up):  # every server tried: wait before the next round
            time.sleep(outage.backoff)
            outage.backoff, outage.tried = min(2 * outage.backoff, _MAX_BACKOFF), 0

    def _note_failures(self, failures) -> None:
        for failure in map(SampleFailure.from_wire, failures):
            self.failures.append(failure)
            _log.warning("sample %d skipped (%s): %s", failure.index, failure.category,
                         failure.reason)

