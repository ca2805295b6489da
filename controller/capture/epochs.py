"""Strong reads of the changefeeds' published epochs: what fences a stale maintainer's dispatchers out.

Before starting a dispatcher, and again before it becomes Working, the capture reads its Changefeed (GET, not a
cache) and rejects a dispatcher whose ``spec.epoch`` is older than ``status.epoch``: a stale maintainer's writes
never reach Working. One read per changefeed per reconcile pass, shared by the pass's concurrent steps
(``PassReads``). The highest epoch each changefeed has shown is remembered while delivering (``seen``): a paused
dispatcher resumes only if no newer one was published meanwhile; so it is also re-read every ``interval`` for the
changefeeds this capture runs dispatchers of (a term that began before the pause is no reason to drop one). Each
read also says whether the changefeed's replication is paused (``spec.paused``: ``paused_feeds``), so a pause or a
resume reaches the capture within ``interval``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from controller.capture.logs import fields
from controller.kube.client import RESOURCES, TRANSPORT_ERRORS, ApiError, Client
from controller.model.states import Kind

log = logging.getLogger("controller.capture")
CHANGEFEEDS = RESOURCES[Kind.CHANGEFEED]
#: Per reconcile pass: changefeed name -> the strong read of its published epoch.
PassReads = dict[str, "asyncio.Future[int | None]"]


class Epochs:
    def __init__(self, client: Client, namespace: str, interval: float, paused: Callable[[], bool]) -> None:
        self.client = client
        self.namespace = namespace
        self.interval = interval
        #: Whether delivery is paused now (an epoch read then is not remembered: the resume check judges by ``seen``).
        self.paused = paused
        #: Per changefeed, the highest epoch a strong read has shown while delivering.
        self.seen: dict[str, int] = {}
        #: Changefeeds whose replication is paused (``spec.paused``) as their latest read showed, and a count that
        #: moves whenever that set changes (the reconciler holds their runs: ``Reconciler._hold``).
        self.paused_feeds: set[str] = set()
        self.paused_version = 0
        self._at = -1e9

    async def of(self, changefeed: str, reads: PassReads) -> int | None:
        """The changefeed's published epoch by a strong read; None if it does not exist. One read per changefeed
        per pass (``reads``), shared by the pass's concurrent steps."""
        if changefeed not in reads:
            reads[changefeed] = asyncio.ensure_future(self.read(changefeed))
        return await reads[changefeed]

    async def read(self, changefeed: str, remember: bool = True) -> int | None:
        try:
            obj = await self.client.get(CHANGEFEEDS, self.namespace, changefeed)
        except ApiError as exc:
            if not exc.not_found:
                raise
            return None
        epoch = int((obj.get("status") or {}).get("epoch") or 0)
        if bool((obj.get("spec") or {}).get("paused")) != (changefeed in self.paused_feeds):
            self.paused_feeds ^= {changefeed}
            self.paused_version += 1
        if remember and not self.paused():
            self.saw(changefeed, epoch)
        return epoch

    def saw(self, changefeed: str, epoch: int) -> None:
        self.seen[changefeed] = max(self.seen.get(changefeed, 0), epoch)

    def newer(self, changefeed: str, epoch: int) -> bool:
        """Whether ``epoch`` is newer than any this capture has seen of ``changefeed`` while delivering."""
        return epoch > self.seen.get(changefeed, 0)

    async def refresh(self, changefeeds: Callable[[], list[str]], reads: PassReads) -> None:
        """Re-read, every ``interval``, the published epoch of every changefeed of ``changefeeds()``."""
        if time.monotonic() - self._at < self.interval:
            return
        names = changefeeds()
        if not names:
            return
        self._at = time.monotonic()
        for cf in names:
            try:
                await self.of(cf, reads)
            except (ApiError, *TRANSPORT_ERRORS) as exc:
                log.warning("could not read the epoch of changefeed", extra=fields(changefeed=cf, error=repr(exc)))
