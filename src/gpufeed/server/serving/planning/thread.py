"""Planning a stream on a thread of its own, stopped when nobody will use the plan.

A request can take seconds to plan: a long list file parsed, a directory tree
listed, thousands of tar shards indexed (over S3, a GET each). That work runs
off the gRPC handler thread, which waits for the plan or for the call to end
(the client cancelled or went away, the server began draining), whichever
comes first. When the call ends first, the handler does not wait for a plan
nobody will use: the planning is told to stop, and the loops that can run long
(indexing, listing, locating names) check ``stopped`` and give up with
``PlanStopped``; whatever had no such check finishes and is dropped.

A planning thread still running after its call ended keeps counting against
``--max-streams`` until it ends (edge/service.py), so that calls opened and
cancelled in a loop cannot pile up planning threads beyond the limit; a
draining server does not wait for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["PlanStopped", "Planning"]

Plan = TypeVar("Plan")


class PlanStopped(Exception):
    """The planning was told to stop: its call ended, or the server is draining."""


class Planning(Generic[Plan]):
    """``make(stopped)`` run on a new thread; ``wait()`` for its plan or for ``stop()``.

    ``make`` gets a ``stopped()`` callable to check in its long loops (raising
    ``PlanStopped`` when true). ``when_finished(callback)`` runs ``callback``
    once the thread has ended (at once if it has). ``discard(plan)`` is given a
    plan made after ``stop()``, which nobody will take (to let go of what it
    holds: a shared list).
    """

    def __init__(self, make: Callable[[Callable[[], bool]], Plan],
                 discard: Callable[[Plan], None] = lambda plan: None):
        self._make = make
        self._discard = discard
        self._cond = threading.Condition()
        self._stopped = False
        self._finished = False
        self._plan: Plan | None = None
        self._error: BaseException | None = None
        self._on_finished: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="gpufeed-plan", daemon=True)
        self._thread.start()

    def stopped(self) -> bool:
        return self._stopped

    def stop(self) -> None:
        """Tell the planning to stop, and wake ``wait()``."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def wait(self) -> Plan:
        """The plan, or what making it raised; ``PlanStopped`` once ``stop()`` is called
        (without waiting for the thread to notice)."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished or self._stopped)
            unwanted, self._plan = (self._plan, None) if self._stopped else (None, self._plan)
            stopped = self._stopped
        if stopped:  # a plan made just before stop() is not taken either
            if unwanted is not None:
                self._discard(unwanted)
            raise PlanStopped("the call ended while its stream was being planned")
        with self._cond:
            if self._error is not None:
                error, self._error = self._error, None  # its traceback holds frames
                raise error
            plan, self._plan = self._plan, None
            assert plan is not None, "a planning that finished without an error made its plan"
            return plan

    def when_finished(self, callback: Callable[[], None]) -> None:
        with self._cond:
            if not self._finished:
                self._on_finished = callback
                return
        callback()

    def _run(self) -> None:
        try:
            plan = self._make(self.stopped)
        except BaseException as e:  # handed to wait(), which raises it on the handler thread
            plan, error = None, e
        else:
            error = None
        with self._cond:
            self._finished = True
            unwanted = self._stopped
            if not unwanted:  # else nobody will ask: drop it now
                self._plan, self._error = plan, error
            callback, self._on_finished = self._on_finished, None
            self._cond.notify_all()
        if unwanted and plan is not None:
            self._discard(plan)
        del plan, error
        if callback is not None:
            callback()
