"""Deadlines for things that block a gRPC worker thread, and the call ending that frees it.

A handler blocked in gRPC (waiting for a client's first message, or sending to
a client that stopped reading, under HTTP/2 flow control) cannot notice time
passing itself: only ending its call wakes it. A ``Watchdog`` is one thread
that checks its armed alarms a few times a second and runs the action of each
whose deadline has passed, typically ``end_call``. Alarms are armed and
disarmed cheaply (once per batch sent), so there is no timer thread per call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

__all__ = ["Alarm", "Watchdog", "end_call"]

_log = logging.getLogger(__name__)
# How often alarms are checked: a deadline fires up to this late.
_TICK = 0.1


class Alarm:
    """An action to run once a deadline passes, unless disarmed before."""

    def __init__(self, watchdog: Watchdog, action: Callable[[], None]):
        self._watchdog = watchdog
        self._action = action
        self._deadline: float | None = None

    def arm(self, seconds: float) -> None:
        self._deadline = time.monotonic() + seconds

    def disarm(self) -> None:
        self._deadline = None

    def close(self) -> None:
        self._deadline = None
        self._watchdog._forget(self)

    def _due(self, now: float) -> bool:
        deadline = self._deadline
        if deadline is None or now < deadline:
            return False
        self._deadline = None
        return True


class Watchdog:
    def __init__(self) -> None:
        self._alarms: set[Alarm] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpufeed-watchdog", daemon=True)
        self._thread.start()

    def alarm(self, action: Callable[[], None]) -> Alarm:
        """A new, disarmed alarm; ``close()`` it when its call ends."""
        alarm = Alarm(self, action)
        with self._lock:
            self._alarms.add(alarm)
        return alarm

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _forget(self, alarm: Alarm) -> None:
        with self._lock:
            self._alarms.discard(alarm)

    def _run(self) -> None:
        while not self._stopped.wait(_TICK):
            now = time.monotonic()
            with self._lock:
                due = [alarm for alarm in self._alarms if alarm._due(now)]
            for alarm in due:
                try:
                    alarm._action()
                except Exception:  # a bug: keep watching the others
                    _log.exception("watchdog action failed")


def end_call(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a call from another thread, with a status the client can act on.

    ``context.abort`` works only on the handler's own thread, which is the one
    blocked; ``context.cancel()`` ends the call from anywhere but the client
    sees CANCELLED, which the client library takes as final. gRPC's server call
    can cancel with a status (grpc_call_cancel_with_status); it is reached
    through the context's private call object, falling back to a plain cancel
    should a grpcio release rename it.
    """
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is not None:
        try:
            call.cancel(code.value[0], details)
            return
        except Exception:  # noqa: BLE001 (any change in grpcio's internals)
            pass
    context.cancel()
