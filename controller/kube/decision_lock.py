"""The decision lock: while a decision reads the informer's store from another thread, nothing changes the store.

A decision runs in a thread (``asyncio.to_thread``) so that the event loop keeps renewing Leases and reading watches
meanwhile; it must see one snapshot. While the lock is held the informer's streams wait before each watch event and
LIST chunk (``released``), and every change offered meanwhile (the maintainer's own writes, a changefeed tracked or
untracked) waits in a backlog (``apply``). When the last holder leaves, the backlog is applied in order, paced (a
decision placing thousands of spans offers thousands of objects); a change offered while it drains joins its end.
Holds nest, and a hold taken while the backlog drains stops the draining where it is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable

from controller.process.pacing import Pacer


class DecisionLock:
    def __init__(self, pacer: Pacer) -> None:
        #: What keeps the draining's turns of the loop short.
        self.pacer = pacer
        self._holders = 0
        self._draining = False
        self._released = asyncio.Event()
        self._released.set()
        self._backlog: deque[Callable[[], None]] = deque()

    @property
    def locked(self) -> bool:
        """Whether a decision holds the lock."""
        return self._holders > 0

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Nothing changes the store while inside: the streams wait, and what is applied meanwhile waits in the
        backlog until the last holder leaves (applied on its way out)."""
        self._holders += 1
        self._released.clear()
        try:
            yield
        finally:
            self._holders -= 1
            if not self._holders:
                await self._drain()

    def apply(self, change: Callable[[], None]) -> None:
        """``change`` (to the store) now, or after the backlog once the lock is released."""
        if self._holders or self._draining:
            self._backlog.append(change)
        else:
            change()

    async def released(self) -> None:
        """Until no decision holds the lock and the backlog has been applied."""
        if not self._released.is_set():
            await self._released.wait()

    async def _drain(self) -> None:
        """Apply the backlog in order, paced; what is applied meanwhile joins its end. Stops, leaving the rest, if
        another hold began."""
        self._draining = True
        try:
            while self._backlog and not self._holders:
                await self.pacer.pace()
                if self._holders:
                    break
                self._backlog.popleft()()
        finally:
            self._draining = False
            if not self._holders:
                if self._backlog:  # cancelled midway: nothing may be lost or reordered
                    backlog, self._backlog = self._backlog, deque()
                    for change in backlog:
                        change()
                self._released.set()
