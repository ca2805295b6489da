"""One LIST+WATCH stream, for ever: client-go's reflector, the one both processes use.

A :class:`Reflector` lists its stream (a kind in a namespace, with a label selector), then watches it from the
LIST's resourceVersion, and feeds what it reads to a :class:`Target` (the cache). It knows nothing of what the
cache holds; the cache knows nothing of the network. The rules it keeps, and why:

* **Watches are ended by the server**, as client-go's are: each asks for a ``timeoutSeconds`` drawn between
  ``watch_timeout`` and twice that (5 to 10 minutes by default: the streams of a restarted API server do not all
  end at once), and a stream the server ends is resumed from its last resourceVersion (a resume, not a relist). A
  real kube-apiserver guarantees no BOOKMARKs at any interval or at all (its watch cache sends none for a kind it
  has seen no event for), so a quiet stream is normal. The client-side idle limit, the server's timeout plus
  ``IDLE_MARGIN`` (or the target's shorter ``idle``), only catches a connection that died without an error, and
  ends the stream the same way.
* **A broken stream** (an error status, a transport error, an ``ERROR`` event) asks the target whether to list
  again (``Target.broke``: a cache of records that may have missed deletes does; one that can resume does not);
  ``410 Gone`` always lists again. Transport errors (``TRANSPORT_ERRORS``) and error statuses back off
  (``MIN_BACKOFF`` doubling to ``MAX_BACKOFF``: an API that returns is seen within about a second).
* **Nothing is skipped in silence.** The resourceVersion moves past an event only once the target has applied
  it. Anything the target raises while applying a LIST or an event (``ApplyFailed``: a bug of ours, never a
  transport error, whatever its type) is logged with its traceback, counted (``Target.failed_to_apply``), and the
  stream lists again after a back-off (``MAX_APPLY_BACKOFF``): what failed arrives with that LIST (resumed past
  instead, an event whose application raised would never be in the cache).
* **One LIST at a time** when a ``list_gate`` is shared by several reflectors (the maintainer's: at 50,000 spans a
  LIST's raw objects are a few hundred MB until converted), each waiting at most ``LIST_PATIENCE`` for another.
* **Short turns.** LIST pages are handed over ``CHUNK`` objects at a time and each chunk and each event is
  preceded by ``Target.ready`` (the maintainer paces there, and waits while a decision holds the cache's lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import AsyncGenerator, Iterator
from typing import Any, Protocol

from controller.kube.client import LIST_PAGE, TRANSPORT_ERRORS, ApiError, Client, Resource

log = logging.getLogger("controller.kube.reflector")
JSON = dict[str, Any]

#: Back-off of a broken stream, doubling (seconds).
MIN_BACKOFF = 0.25
MAX_BACKOFF = 1.0
#: The least ``timeoutSeconds`` a watch asks for (it asks between this and twice this), as client-go's reflector
#: (its minWatchTimeout is 5 minutes).
WATCH_TIMEOUT = 300.0
#: Seconds past its ``timeoutSeconds`` after which a silent watch is taken for a dead connection.
IDLE_MARGIN = 15.0
#: The longest back-off after failures to apply (doubling from ``MIN_BACKOFF``).
MAX_APPLY_BACKOFF = 30.0
#: Seconds a LIST waits for another stream's LIST (through a shared ``list_gate``) before it goes ahead.
LIST_PATIENCE = 5.0
#: Objects of a LIST page handed to the target at a time.
CHUNK = 25


class ApplyFailed(Exception):
    """Applying a LIST page or a watch event to the cache raised: a bug of ours, not the network's. The stream's
    resourceVersion has not passed what failed; the stream lists again."""


@contextlib.contextmanager
def applying(what: str) -> Iterator[None]:
    """Whatever is raised inside is the cache's failure to apply ``what`` (``ApplyFailed``), never a transport
    error: an ``OSError`` or a ``ValueError`` raised by a store is no connection reset."""
    try:
        yield
    except Exception as exc:
        raise ApplyFailed(what) from exc


class Target(Protocol):
    """What one stream feeds: a cache, and what it must know of the stream's health."""

    async def ready(self) -> None:
        """Before each LIST chunk and each watch event (pacing; a decision holding the cache's lock makes it wait)."""

    def begin_listing(self) -> Any:
        """A LIST begins; what it returns is handed to ``list_chunk`` and ``end_listing``."""

    def list_chunk(self, listing: Any, items: list[JSON]) -> None:
        """Up to ``CHUNK`` objects of a LIST page (the list may be emptied as they are converted)."""

    def page_read(self, listing: Any) -> None:
        """A LIST page has been handed over whole."""

    def end_listing(self, listing: Any, rv: str) -> None:
        """The LIST (a snapshot at ``rv``) is read: what it did not name is gone."""

    def listed(self, again: bool) -> None:
        """The LIST has been applied (``again``: not the stream's first)."""

    def put(self, obj: JSON) -> None:
        """ADDED or MODIFIED."""

    def delete(self, obj: JSON) -> None:
        """DELETED (``obj`` as it was last)."""

    def heard(self) -> None:
        """The stream delivered something (a LIST, an event, a bookmark)."""

    def interrupted(self) -> None:
        """The stream stopped delivering: ended by the server, or broken."""

    def broke(self) -> bool:
        """The stream broke (an error, not the server's timeout): True to list again rather than resume."""

    def failed_to_apply(self) -> None:
        """Applying a LIST or an event raised (a bug; logged by the reflector): counted by the target."""


class Reflector:
    """LIST then WATCH ``resource`` in ``namespace`` (``selector``) into ``target``, until cancelled."""

    def __init__(
        self,
        client: Client,
        resource: Resource,
        namespace: str,
        target: Target,
        *,
        name: str = "",
        selector: str = "",
        watch_timeout: float = WATCH_TIMEOUT,
        idle: float = math.inf,
        idle_quietly: bool = False,
        page_size: int = LIST_PAGE,
        list_gate: asyncio.Lock | None = None,
        logger: logging.Logger = log,
    ) -> None:
        self.client = client
        self.resource = resource
        self.namespace = namespace
        self.target = target
        self.name = name or resource.plural
        self.selector = selector
        self.watch_timeout = watch_timeout
        #: Seconds of silence after which a watch is resumed (at most its timeout plus ``IDLE_MARGIN``).
        self.idle = idle
        #: Say so at DEBUG, not INFO, when ``idle`` runs out (a stream resumed on purpose when quiet: the Leases).
        self.idle_quietly = idle_quietly
        self.page_size = page_size
        self.list_gate = list_gate
        self.log = logger

    def _timeout(self) -> int:
        """The ``timeoutSeconds`` of one watch: between ``watch_timeout`` and twice that, as client-go draws it."""
        return max(1, int(self.watch_timeout * (1.0 + random.random())))

    async def _gate(self) -> bool:
        # ``asyncio.timeout``, not ``wait_for``: on 3.11 ``wait_for`` swallows a cancellation that lands as the lock
        # is granted, and a stream cancelled then would run on, unowned.
        if self.list_gate is None:
            return False
        try:
            async with asyncio.timeout(LIST_PATIENCE):
                await self.list_gate.acquire()
        except TimeoutError:
            return False
        return True

    async def _list(self) -> str:
        """One LIST into the target, page by page, a chunk at a time; its resourceVersion."""
        target = self.target
        await target.ready()
        with applying(f"the start of a LIST of {self.name}"):
            listing = target.begin_listing()
        listed_rv = ""
        pages = self.client.list_pages(
            self.resource, self.namespace, label_selector=self.selector, limit=self.page_size
        )
        async for items, page_rv in pages:
            for i in range(0, len(items), CHUNK):
                await target.ready()
                chunk = items[i : i + CHUNK]
                items[i : i + CHUNK] = [{}] * len(chunk)  # the raw objects go as they are converted
                with applying(f"a LIST page of {self.name}"):
                    target.list_chunk(listing, chunk)
                del chunk
            listed_rv = page_rv
            del items
            with applying(f"a LIST page of {self.name}"):
                target.page_read(listing)
        await target.ready()
        with applying(f"the end of a LIST of {self.name}"):
            target.end_listing(listing, listed_rv)
        return listed_rv

    async def _events(self, rv: str) -> AsyncGenerator[JSON, None]:
        """The watch's events, until the server ends it (its ``timeoutSeconds``: a quiet stream too) or it delivers
        nothing for its idle limit (a connection that died silently, or a quiet stream resumed on purpose). Either
        way it just ends, and the caller resumes it from ``rv``: neither is an error."""
        timeout = self._timeout()
        idle = min(self.idle, timeout + IDLE_MARGIN)
        events = self.client.watch(
            self.resource, self.namespace, rv, label_selector=self.selector, timeout_seconds=timeout
        )
        try:
            while True:
                limit = asyncio.timeout(idle)
                try:
                    async with limit:
                        ev = await anext(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if not limit.expired():
                        raise  # the client's own (its socket read timeout): an error
                    level = logging.DEBUG if self.idle_quietly else logging.INFO
                    self.log.log(
                        level, "watch %s silent for %.0fs (timeoutSeconds %d): resuming", self.name, idle, timeout
                    )
                    return
                yield ev
        finally:
            close = getattr(events, "aclose", None)  # an async generator: release its connection now
            if close is not None:
                await close()

    def _failed(self, failures: int, error: object, backoff: float) -> None:
        """The first failure of a run of them, then one in 20: an outage retries every second."""
        if failures == 1 or failures % 20 == 0:
            self.log.warning("watch %s broke (%d attempts): %r; retrying in %.2fs", self.name, failures, error, backoff)

    async def run(self) -> None:
        """LIST, then WATCH from the LIST's resourceVersion, for ever (until cancelled)."""
        target = self.target
        rv = ""
        backoff = MIN_BACKOFF
        failures = 0
        failed_applies = 0  # failures to apply in a row (reset once a LIST has been applied whole)
        lists = 0
        while True:
            try:
                if not rv:
                    held = await self._gate()
                    try:
                        listed_rv = await self._list()  # only a LIST read to its end is watched from
                    finally:
                        if held and self.list_gate is not None:
                            self.list_gate.release()
                    lists += 1
                    target.heard()
                    if failures:
                        self.log.info("watch %s back (relisted) after %d failed attempts", self.name, failures)
                        failures = 0
                    with applying(f"the LIST of {self.name}"):
                        target.listed(again=lists > 1)
                    rv = listed_rv
                    if failed_applies:
                        self.log.info("watch %s relisted after %d failures to apply", self.name, failed_applies)
                        failed_applies = 0
                # Closed on the way out, whatever the way (an ERROR event, a failure to apply): its connection now.
                async with contextlib.aclosing(self._events(rv)) as events:
                    async for ev in events:
                        # Events already buffered come without a pause: a burst (thousands, after a decision held the
                        # lock, or a decision's writes) would hold the loop for as long as it takes.
                        await target.ready()
                        target.heard()
                        if failures:
                            self.log.info("watch %s back after %d failed attempts", self.name, failures)
                            failures = 0
                        typ = ev.get("type")
                        obj = ev.get("object") or {}
                        if typ == "ERROR":
                            code = obj.get("code")
                            target.interrupted()
                            relist = target.broke() or code == 410
                            self.log.info(
                                "watch %s ended with %s; %s", self.name, code, "relisting" if relist else "resuming"
                            )
                            rv = "" if relist else rv
                            if code != 410:
                                await asyncio.sleep(backoff)
                            break
                        new_rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                        if typ == "BOOKMARK":
                            rv = new_rv
                            continue
                        with applying(f"{typ} {self.name} {(obj.get('metadata') or {}).get('name')!r}"):
                            if typ == "DELETED":
                                target.delete(obj)
                            else:
                                target.put(obj)
                        rv = new_rv  # only now: a resumed watch must not start after an event not applied
                    else:
                        target.interrupted()  # the server ended the stream (its timeout): resume from rv at once
                backoff = MIN_BACKOFF
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                target.interrupted()
                if target.broke() or exc.status == 410:
                    rv = ""
                if exc.status == 410:
                    continue
                failures += 1
                self._failed(failures, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
            except TRANSPORT_ERRORS as exc:  # connection reset, server restart: relist or resume, as the target says
                target.interrupted()
                if target.broke():
                    rv = ""
                failures += 1
                self._failed(failures, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
            except Exception as exc:  # ApplyFailed, or another bug of this loop: never skipped in silence
                target.interrupted()
                target.broke()
                rv = ""  # whatever the target: what was not applied arrives with the LIST
                failed_applies += 1
                with contextlib.suppress(Exception):
                    target.failed_to_apply()
                delay = min(MIN_BACKOFF * 2 ** min(failed_applies - 1, 16), MAX_APPLY_BACKOFF)
                what = f"could not apply {exc}" if isinstance(exc, ApplyFailed) else f"failed: {exc!r}"
                self.log.exception(
                    "watch %s %s (%d in a row): relisting in %.2fs", self.name, what, failed_applies, delay
                )
                await asyncio.sleep(delay)
