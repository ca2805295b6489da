"""What keeps each changefeed's data from flowing on this capture, per side (its source or its sink): the
``troubles`` of the progress report every Lease renewal carries (``progress.Trouble``), from which the maintainer
sets the Changefeed's conditions SourceUnavailable and SinkUnavailable.

Two parts of the capture know of troubles, each about its own: the Secrets' reader (``sources.Sources``: a Secret
missing, unreadable or malformed, a changed Secret whose new values do not work) and the data plane
(``dataplane``: a server refusing connections, authentication, TLS, a statement failing). Each sets and clears its
own, under its ``origin``; the report names one per (changefeed, side), one that needs a person before one that is
retried. A trouble is logged when it begins or its words change kind (not at every retry), with the changefeed
under ``changefeed``, and once more when it ends.
"""

from __future__ import annotations

import logging

from controller.capture.logs import fields
from controller.model.progress import TROUBLE_LIMIT, Side, Trouble

log = logging.getLogger("controller.capture")

#: The origins of a trouble: the Secrets' reader, the data plane's connections.
SECRETS, CONNECTION = "secrets", "connection"


class Troubles:
    def __init__(self) -> None:
        self._now: dict[tuple[str, Side, str], Trouble] = {}

    def set(self, changefeed: str, side: Side, origin: str, transient: bool, message: str) -> None:
        trouble = Trouble(changefeed=changefeed, side=side, transient=transient, message=message[:TROUBLE_LIMIT])
        old = self._now.get((changefeed, side, origin))
        self._now[(changefeed, side, origin)] = trouble
        if old is None or (old.transient, old.message.split(":")[0]) != (transient, message.split(":")[0]):
            log.warning(
                f"{side} unavailable",
                extra=fields(changefeed=changefeed, side=side, transient=transient, error=trouble.message),
            )

    def clear(self, changefeed: str, side: Side, origin: str) -> None:
        if self._now.pop((changefeed, side, origin), None) is not None:
            log.info(f"{side} available again", extra=fields(changefeed=changefeed, side=side))

    def has(self, changefeed: str, side: Side, origin: str) -> bool:
        return (changefeed, side, origin) in self._now

    def get(self, changefeed: str, side: Side) -> Trouble | None:
        """The trouble reported for (``changefeed``, ``side``): one that needs a person first."""
        found = [t for (cf, s, _), t in sorted(self._now.items()) if cf == changefeed and s == side]
        return min(found, key=lambda t: t.transient) if found else None

    def forget(self, changefeed: str) -> None:
        """``changefeed`` has nothing on this capture any more: nothing to report of it."""
        for key in [k for k in self._now if k[0] == changefeed]:
            del self._now[key]

    def report(self) -> tuple[Trouble, ...]:
        """One trouble per (changefeed, side) that has any, in order."""
        keys = sorted({(cf, side) for cf, side, _ in self._now})
        return tuple(t for cf, side in keys if (t := self.get(cf, side)) is not None)
