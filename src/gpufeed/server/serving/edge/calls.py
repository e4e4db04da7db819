"""Bounds on the calls that hold a gRPC worker thread without doing work.

gRPC's synchronous server runs each call on a thread of one pool from its
start to its end, including while it waits for the client's first message. A
client that opens calls and sends nothing would, with enough of them, hold
every thread: health checks and Info would queue behind them and an
orchestrator would restart a healthy server. So every call passes this gate:

- It is served as a bidirectional stream whatever its declared shape (the
  wire format is the same), so its handler starts at once: gRPC reads a unary
  call's request before calling the handler, where nothing could time it.
  Its messages are parsed here: one that does not parse ends the call
  INVALID_ARGUMENT, where gRPC would log a traceback for each.
- Until its first message a call is *waiting*, for at most ``open_timeout``
  seconds (then it is ended, DEADLINE_EXCEEDED naming ``--open-timeout``).
- After it, a unary call (Info, health Check) runs its short handler; a Stream
  goes to the servicer's admission (``--max-streams``); the other streaming
  calls (health Watch, server reflection) are *watching* until they end.
- At most ``max_waiting`` calls wait, and as many watch. Past that bound the
  call that has waited (or watched) longest is ended at once,
  RESOURCE_EXHAUSTED naming ``--max-waiting-calls``: not the newcomer, since a
  client's first message comes with or right after its call, so refusing
  newcomers would let a few idle calls lock out every health check, Info and
  trainer, while ending the oldest only ever ends calls that sat idle.

``worker_threads`` sizes the pool so that streams, waiting and watching calls
at their bounds still leave threads for health checks, Info and refusals.
gRPC's own ``maximum_concurrent_rpcs`` is not used: it counts health checks
with everything else, so a flood of calls would get them refused too.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import grpc

from .watchdog import Watchdog, end_call

__all__ = ["CallGate", "worker_threads"]

STREAM_METHOD = "/gpufeed.v1.Feed/Stream"
# Threads beyond the bounds: health checks, Info, refusals, the end of a finished call.
_SPARE_THREADS = 8
_NOTHING = object()


def worker_threads(max_streams: int, max_waiting: int) -> int:
    """gRPC worker threads for these bounds: every bounded call plus spares."""
    return max_streams + 2 * max_waiting + _SPARE_THREADS


class CallGate(grpc.ServerInterceptor):
    def __init__(self, max_waiting: int, open_timeout: float, watchdog: Watchdog):
        self._max = max_waiting
        self._open_timeout = open_timeout
        self._watchdog = watchdog
        self._lock = threading.Lock()
        # kind -> the calls of that kind, oldest first (a dict keeps insertion order)
        self._calls: dict[str, dict[grpc.ServicerContext, None]] = {"waiting": {}, "watching": {}}

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        parse = handler.request_deserializer or (lambda data: data)

        def serve(requests, context):
            return self._serve(handler, method, _parsed(requests, parse, method, context), context)

        return grpc.stream_stream_rpc_method_handler(
            serve, response_serializer=handler.response_serializer)

    def _serve(self, handler, method: str, requests, context):
        argument: Any  # the request iterator, or the one request message
        with self._counted("waiting", context):
            first = self._first(requests, context)
        if handler.request_streaming:
            argument = requests if first is _NOTHING else itertools.chain([first], requests)
        elif first is _NOTHING:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{method} takes one request message; the client sent none")
            return  # not reached: abort raises
        else:
            argument = first
        behaviour = _behaviour(handler)
        if not handler.response_streaming:
            response = behaviour(argument, context)
            if response is not None:
                yield response
        elif method == STREAM_METHOD:
            yield from behaviour(argument, context)
        else:
            with self._counted("watching", context):
                yield from behaviour(argument, context)

    def _first(self, requests, context):
        """The call's first message (``_NOTHING`` if it half-closed without one),
        or the call ends once ``open_timeout`` has passed."""
        alarm = self._watchdog.alarm(lambda: end_call(
            context, grpc.StatusCode.DEADLINE_EXCEEDED,
            f"no request message within {self._open_timeout:g} s of the call's start "
            f"(server's --open-timeout)"))
        alarm.arm(self._open_timeout)
        try:
            return next(requests, _NOTHING)
        finally:
            alarm.close()

    @contextmanager
    def _counted(self, kind: str, context):
        """Count the call as ``kind`` while inside; past the bound, end the oldest."""
        calls = self._calls[kind]
        with self._lock:
            oldest = next(iter(calls)) if len(calls) >= self._max else None
            if oldest is not None:
                del calls[oldest]
            calls[context] = None
        if oldest is not None:
            end_call(oldest, grpc.StatusCode.RESOURCE_EXHAUSTED,
                     f"ended to make room: more than {self._max} calls were {kind} "
                     f"(server's --max-waiting-calls {self._max}), this one longest")
        try:
            yield
        finally:
            with self._lock:
                calls.pop(context, None)


def _parsed(requests, parse, method: str, context):
    """The call's messages, parsed; a message that does not parse ends the call
    INVALID_ARGUMENT (gRPC's own parsing would log a traceback per bad message)."""
    for data in requests:
        try:
            message = parse(data)
        except Exception:  # protobuf's DecodeError, or nesting too deep  # noqa: BLE001
            end_call(context, grpc.StatusCode.INVALID_ARGUMENT,
                     f"{method}: a request message is not a valid protobuf message")
            return
        yield message


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable[[Any, Any], Any]:
    """The handler's method for its kind: the one of the four its two flags name."""
    if handler.request_streaming and handler.response_streaming:
        behaviour = handler.stream_stream
    elif handler.request_streaming:
        behaviour = handler.stream_unary
    elif handler.response_streaming:
        behaviour = handler.unary_stream
    else:
        behaviour = handler.unary_unary
    if behaviour is None:
        raise RuntimeError("a gRPC method handler without the behaviour its streaming "
                           "flags name")
    return behaviour
