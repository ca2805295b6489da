"""How long a capture has been silent, counted only while our view of its Lease was current.

A capture is alive while its Lease keeps being renewed, and the maintainer can only judge that from what
its watch of Leases shows. While that watch is broken (the API server unreachable, the stream dead, the
process cut off from the network) the view stops changing although the captures may be renewing fine:
that time is the maintainer's blindness, not the captures' silence, and it must not count towards
"lost". Otherwise every outage of the API longer than a lease duration ends with the maintainer taking
every capture's Lease and re-placing every span the moment the API returns, though nobody lost anything.

So silence is measured on a :class:`ViewClock`, a clock that runs only while the view is current: the
stream delivered something (an event, a bookmark, a fresh listing) within ``fresh`` seconds and has not
failed since. ``fresh`` covers a stream that dies silently (no error, nothing delivered): when the
maintainer leads, its own Lease renewals and the captures' keep the Lease stream busy every couple of
seconds, so a quiet stream is a stale one.

Why this is only about liveness, not safety: counted silence never exceeds the real time elapsed since the
renewal was observed, which is after the capture sent it; a capture stops delivering ``renew_deadline``
(< the lease duration) after it *sent* its last successful renewal. And the maintainer's verdict is acted
on only through a compare-and-swap on the Lease version it judged (``intents.FenceCapture``): if the
capture renewed meanwhile, taking the Lease fails. A wrong verdict costs a retry, never two owners.

Pure: callers pass the time (a monotonic clock in production, the simulated one in the simulator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class ViewClock:
    """Accumulated time during which a view was current. Time stamps passed in must not decrease.

    ``count_all``: count every second, current or not (the simulator's mutant ``outage-counts-as-silence``:
    what a maintainer that ignores its own blindness would do).
    """

    fresh: float
    count_all: bool = False
    total: float = 0.0
    mark: float = -math.inf  # the time up to which ``total`` is accumulated
    until: float = -math.inf  # current until then (unless broken meanwhile)

    def _current_between(self, start: float, end: float) -> float:
        if self.count_all:
            return max(0.0, end - start) if start > -math.inf else 0.0
        stop = min(end, self.until)
        return max(0.0, stop - start) if start > -math.inf else 0.0

    def _advance(self, now: float) -> None:
        if now > self.mark:
            self.total += self._current_between(self.mark, now)
            self.mark = now

    def heard(self, now: float) -> None:
        """The stream delivered something (or a listing replaced the view): current for ``fresh`` more seconds."""
        self._advance(now)
        self.until = max(self.until, now + self.fresh)

    def broken(self, now: float) -> None:
        """The stream failed: not current from now until it delivers again."""
        self._advance(now)
        self.until = min(self.until, now)

    def reading(self, now: float) -> float:
        """Current time accumulated up to ``now``."""
        if now <= self.mark:
            return self.total
        return self.total + self._current_between(self.mark, now)

    def current(self, now: float) -> bool:
        return self.count_all or now < self.until


@dataclass
class Silence:
    """Per Lease, the view clock's reading when its renewTime was last seen to change.

    Liveness is judged on *our* clock (as client-go does): a Lease is renewed when its renewTime changes,
    whatever time it says, so clock skew between the capture and us never makes a live capture look lost.
    A Lease seen for the first time counts as just renewed (a restarted maintainer waits a full lease
    duration before it calls anything lost).
    """

    clock: ViewClock
    seen: dict[str, tuple[object, float]] = field(default_factory=dict)

    def observe(self, name: str, renew: object, now: float) -> None:
        old = self.seen.get(name)
        if old is None or old[0] != renew:
            self.seen[name] = (renew, self.clock.reading(now))

    def forget(self, name: str) -> None:
        self.seen.pop(name, None)

    def of(self, name: str, now: float) -> float | None:
        """Seconds of current view since ``name``'s renewTime last changed; None if never observed."""
        old = self.seen.get(name)
        return None if old is None else self.clock.reading(now) - old[1]
