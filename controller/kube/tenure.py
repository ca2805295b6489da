"""Tenure: a process whose heap is mostly long-lived records keeps them out of the collector's full passes.

CPython's garbage collector makes a full (generation 2) pass whenever the objects promoted since the last
one exceed a quarter of those it found then; a pass visits every tracked object, so its pause grows with the
heap: about 1 s at 100,000 spans in one maintainer (issue 25), which is a second no Lease renewal, watch
event or decision gets. The records are not garbage (they live as long as their objects) and hold no
reference cycles (reference counting frees them when they are replaced or deleted), so visiting them again
and again buys nothing.

Every ``period`` seconds (more often while steps take longer than TARGET), if a young collection promoted
anything since the last step, :meth:`Tenure.step` makes a full pass (which visits only what is not frozen yet:
what survived since the last step, so it is short) and then freezes every object left (``gc.freeze``): they
are out of every later pass. Reference counting still frees a frozen object. What is given up is the
collection of a reference *cycle* among frozen objects that dies later: ``gc.freeze`` takes every object alive
at the step, whatever its age, so a request, a task or an exception with its traceback that is in flight at a
step and ends in a cycle is never collected (nor is a socket in it closed, if nothing closed it before). That
cost is measured, not guessed: ``python bench/run.py`` ends by thawing the maintainer and counting what one
full pass then finds (``gc_leak``; bench/README.md gives the figures), and ``--gc-tenure 0`` turns the steps
off.

While a decision runs in its thread (the maintainer wraps it in :func:`steps_deferred`), no step runs: a full
audit at 100,000 spans allocates for 3 s, and a step over what it held then stalled the loop 110 ms; once it is
over, its temporaries are gone (reference counting) and the next step visits only what survived.

The informer's LIST pages freeze the same way (``controller.kube.informer``), at each page, for the cold
start; this covers what arrives afterwards: watch events and the maintainer's own writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

#: Seconds between steps at most (the command lines' default ``--gc-tenure``; 0: off).
PERIOD = 2.0
#: A step that took longer than this halves the wait before the next (down to MIN_WAIT); one that took less
#: than a quarter of it doubles it back (up to the period): a step's pause is what survived since the last
#: one, so while the heap grows fast (placing thousands of spans) steps come more often and each stays short.
TARGET = 0.02
MIN_WAIT = 0.25


_deferred = 0


@contextlib.contextmanager
def steps_deferred() -> Iterator[None]:
    """No tenure step while inside (nested and overlapping uses count). The collector itself stays on: turning
    it off for a 3 s audit made the first young collection afterwards visit everything allocated meanwhile
    (a 230 ms stall at 100,000 spans), slowed the audit by half and left cycles to die frozen."""
    global _deferred
    _deferred += 1
    try:
        yield
    finally:
        _deferred -= 1


def paused() -> bool:
    return _deferred > 0


class Tenure:
    """The periodic step (:meth:`run` as a task); its figures for the metrics and the bench."""

    def __init__(self, period: float = PERIOD) -> None:
        if period <= 0:
            raise ValueError("the tenure period must be positive")
        self.period = period
        #: The wait before the next step (between MIN_WAIT and ``period``: see TARGET).
        self.wait = period
        #: Young collections (generation 1 or 2) since the last step: nothing was promoted if none.
        self.promoted = 0
        self.steps = 0
        self.longest_s = 0.0
        self.total_s = 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "stop" and info.get("generation", 0) >= 1:
            self.promoted += 1

    async def run(self) -> None:
        gc.callbacks.append(self._on_gc)
        try:
            while True:
                await asyncio.sleep(MIN_WAIT if self.promoted and paused() else self.wait)
                try:
                    self.step()
                except Exception:  # an optimisation: never the end of the task (a capture fences on that)
                    log.exception("tenure step failed")
        finally:
            gc.callbacks.remove(self._on_gc)

    def step(self) -> bool:
        """One step: a full pass over what is not frozen, then freeze what is left. False: nothing to do, or
        not now (a decision runs: ``steps_deferred``; the step comes MIN_WAIT later)."""
        if not self.promoted or paused():
            return False
        began = time.perf_counter()
        gc.collect(2)
        gc.freeze()
        self.promoted = 0
        took = time.perf_counter() - began
        if took > TARGET:
            self.wait = max(min(MIN_WAIT, self.period), self.wait / 2)
        elif took < TARGET / 4:
            self.wait = min(self.period, self.wait * 2)
        self.steps += 1
        self.total_s += took
        if took > self.longest_s:
            self.longest_s = took
            if took > 0.05:
                log.info("slow tenure step", extra={"seconds": round(took, 3)})
        return True
