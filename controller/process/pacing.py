"""Short turns of the event loop: work that comes in bursts yields to the loop between time slices.

The loop runs every callback that is ready in one turn; nothing else (a Lease renewal, a watch, a timer)
runs until the turn ends. A burst of work whose units are each cheap can still make one turn long: a watch
stream's buffered events once a decision releases the cache (hundreds of them, each re-indexing a span at
100,000 spans), the backlog of writes offered meanwhile, the chains of a decision's writes all starting at
once. Counting units (yield every 100) does not bound a turn: several streams and the executor each take
their 100 in the same turn.

A :class:`Pacer` is shared by every source of such work in a process (the informer's streams and its decision
lock's backlog, the executor's chains). Before each unit, :meth:`Pacer.pace` returns at once while the current
turn has spent less than ``slice`` seconds on paced work, and otherwise yields (``asyncio.sleep(0)``): the unit
runs in a later turn, after the I/O that turn polls for. The slice is measured from the first paced unit of the
turn (a callback scheduled then ends the window at the start of the next turn), so work done before it in the
same turn is not counted; what a turn holds at most is that work, one slice, and the unit that crosses it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

#: Seconds of paced work one turn of the loop may hold before the next unit waits for a later turn. Wall time:
#: while a decision's thread holds the GIL in turns and the other processes share the two cores, 5 ms of work
#: took up to 20-40 ms; with a 10 ms slice two turns reached 91 ms at 100,000 spans (bench/README.md).
SLICE = 0.005


class Pacer:
    def __init__(self, slice_s: float = SLICE, clock: Callable[[], float] = time.perf_counter) -> None:
        if slice_s <= 0:
            raise ValueError("a pacer's slice must be positive")
        self.slice = slice_s
        self.clock = clock
        #: When this turn's window began (None: no paced work yet in this turn).
        self._began: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Units that waited for a later turn (the bench reports it).
        self.yields = 0

    def _end_window(self) -> None:
        self._began = None

    def spent(self) -> bool:
        """Whether this turn's slice is used up; opens the turn's window if none is open."""
        now = self.clock()
        loop = asyncio.get_running_loop()
        if self._began is None or loop is not self._loop:
            # The window ends when the loop next runs its ready callbacks: the next turn.
            self._began, self._loop = now, loop
            loop.call_soon(self._end_window)
            return False
        return now - self._began >= self.slice

    async def pace(self) -> None:
        """Return at once while this turn's slice lasts; else continue in a later turn."""
        while self.spent():  # a turn's first unit always runs (it opens the window): no unit waits forever
            self.yields += 1
            await asyncio.sleep(0)
