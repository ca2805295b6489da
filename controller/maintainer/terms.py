"""What the parts of a maintainer process share about its terms: which changefeeds it leads, each loop's wake-up,
and the handoffs its balance asked for.

The per-changefeed loops (``changefeeds.py``) begin and end terms here; the balance (``membership.py``) reads what
is led and asks for handoffs; the change router (``runner.py``) wakes loops. No part reaches into another's
fields: this board is the only thing they hold in common, and each write has one owner.
"""

from __future__ import annotations

import asyncio


class Terms:
    def __init__(self) -> None:
        #: The changefeeds this replica leads now (written by their loops only).
        self.leading: set[str] = set()
        self._wakeups: dict[str, asyncio.Event] = {}
        self._hand_over: dict[str, asyncio.Event] = {}

    def wakeup(self, name: str) -> asyncio.Event:
        """The event ``name``'s loop sleeps on between decisions (made on first use)."""
        ev = self._wakeups.get(name)
        if ev is None:
            ev = self._wakeups[name] = asyncio.Event()
        return ev

    def wake(self, name: str) -> None:
        """Wake ``name``'s loop, if it has one."""
        ev = self._wakeups.get(name)
        if ev is not None:
            ev.set()

    def wake_all(self) -> None:
        for ev in self._wakeups.values():
            ev.set()

    def has_loop(self, name: str) -> bool:
        return name in self._wakeups

    def forget(self, name: str) -> None:
        """``name``'s loop is gone (its changefeed deleted)."""
        self._wakeups.pop(name, None)

    # -- terms and handoffs ---------------------------------------------------------------------------

    def begin(self, name: str) -> asyncio.Event:
        """A term of ``name`` begins: it is led, and a handoff asked for an earlier term is not this one's. Returns
        the event a handoff of this term sets (the loop ends the term at its next decision boundary)."""
        self.leading.add(name)
        ev = self._hand_over[name] = asyncio.Event()
        return ev

    def end(self, name: str) -> bool:
        """The term of ``name`` ended; whether it was handed over (a handoff had been asked)."""
        self.leading.discard(name)
        ev = self._hand_over.pop(name, None)
        return ev is not None and ev.is_set()

    def hand_over(self, name: str) -> None:
        """The balance asks ``name``'s term to end at its next decision boundary."""
        self._hand_over.setdefault(name, asyncio.Event()).set()
        self.wake(name)

    def handing(self) -> frozenset[str]:
        """The changefeeds whose handoff is asked and not yet done."""
        return frozenset(n for n, e in self._hand_over.items() if e.is_set())
