"""Tenure: a process whose heap is mostly long-lived records keeps them out of the collector's full passes.

CPython's garbage collector makes a full (generation 2) pass whenever the objects promoted since the last
one exceed a quarter of those it found then; a pass visits every tracked object, so its pause grows with the
heap: about 1 s at 100,000 spans in one maintainer, which is a second no Lease renewal, watch
event or decision gets. The records are not garbage (they live as long as their objects) and hold no
reference cycles (reference counting frees them when they are replaced or deleted), so visiting them again
and again buys nothing.

Every ``period`` seconds, or as soon as BATCH young collections have promoted objects (whichever comes first),
:meth:`Tenure.step` makes a full pass (which visits only what is not frozen yet: what was made since the last
step and is still alive, so it is short) and then freezes every object left (``gc.freeze``): they are out of
every later pass.

The period, not the young collections, is what keeps a step short. The collector counts allocations *net* of
deallocations: a record that replaces a frozen one (a status write, a watch event) adds one and frees one, so
the count stays near zero while generation 0 grows, and no young collection comes. 100,000 spans being placed
gathered about 40,000 such objects between two steps, and each step held the loop 22 to 99 ms (20 ms of its
thread's CPU: the visits from young objects into the frozen heap of a million objects miss the CPU's caches).
A step every 0.5 s visits what half a second brings. Reference counting still frees a frozen object.
What is given up is the collection of a reference *cycle* among frozen objects that dies later: ``gc.freeze``
takes every object alive at the step, whatever its age, so a request, a task or an exception with its
traceback that is in flight at a step and ends in a cycle is never collected (nor is a socket in it closed, if
nothing closed it before). That cost is measured, not guessed: ``python bench/run.py`` ends by thawing the
maintainer and counting what one full pass then finds (``gc_leak``; bench/README.md gives the figures), and
``--gc-tenure 0`` turns the steps off.

A step is also due after BATCH young collections: a full audit at 100,000 spans allocates (net) for seconds
in its thread, and a step after each couple of young collections keeps what it has to visit small.

At a cold start the records arrive faster than any period: the maintainer's runner has its informer call
:meth:`Tenure.freeze_now` after each LIST page of records it has converted. The steps cover what arrives
afterwards: watch events and the maintainer's own writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

#: Seconds between steps at most (the command lines' default ``--gc-tenure``; 0: off).
PERIOD = 0.5
#: Young (generation 1) collections that make a step due at once, before the period is over (each promotes at
#: most about 7,700 objects, with the default thresholds 700 and 10). A step waits for the loop's current turn
#: to end, which the pacer keeps short (``controller.process.pacing``).
BATCH = 2


class Tenure:
    """The periodic step (:meth:`run` as a task); its figures for the metrics and the bench."""

    def __init__(self, period: float = PERIOD) -> None:
        if period <= 0:
            raise ValueError("the tenure period must be positive")
        self.period = period
        #: Young collections (generation 1 or 2) since the last step.
        self.promoted = 0
        self.steps = 0
        self.longest_s = 0.0
        self.total_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due: asyncio.Event | None = None
        self._woken = False
        self._stepping = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # Any thread's collection (a decision's too): the step is woken through the loop. Not the step's own.
        if phase == "stop" and info.get("generation", 0) >= 1 and not self._stepping:
            self.promoted += 1
            if self.promoted >= BATCH and not self._woken and self._loop is not None and self._due is not None:
                self._woken = True
                self._loop.call_soon_threadsafe(self._due.set)

    async def run(self) -> None:
        self._loop, self._due = asyncio.get_running_loop(), asyncio.Event()
        gc.callbacks.append(self._on_gc)
        try:
            while True:
                # ``asyncio.timeout``, not ``wait_for`` (Python 3.11's swallows a cancellation that comes as the
                # event is set), as ``controller.kube.client.sleep_or``: this package imports nothing of the project.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.period):
                        await self._due.wait()
                self._due.clear()
                self._woken = False
                try:
                    self.step()
                except Exception:  # an optimisation: never the end of the task (a capture fences on that)
                    log.exception("tenure step failed")
        finally:
            gc.callbacks.remove(self._on_gc)

    def freeze_now(self) -> None:
        """Freeze what is alive now, after a young collection only (cheap: it visits nothing already frozen), so that
        no fresh garbage cycle is frozen for good. For a burst of long-lived objects that cannot wait for the period:
        the records of a LIST page live as long as their objects do and hold no reference cycles (reference counting
        still frees them); each full pass over 200,000 records holds the loop for hundreds of milliseconds."""
        gc.collect(1)
        gc.freeze()

    def step(self) -> None:
        """One step: a full pass over what is not frozen, then freeze what is left."""
        began = time.perf_counter()
        self._stepping = True
        try:
            gc.collect(2)
            gc.freeze()
        finally:
            self._stepping = False
        self.promoted = 0
        took = time.perf_counter() - began
        self.steps += 1
        self.total_s += took
        if took > self.longest_s:
            self.longest_s = took
            if took > 0.05:
                log.info("slow tenure step", extra={"seconds": round(took, 3)})
