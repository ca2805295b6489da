"""Apply the engine's intended writes to the API, exactly as ``controller.engine.intents`` specifies.

Chains run concurrently (bounded: ``concurrency`` chains of all decisions at once, each decision's started
in order by as many workers, never one task per chain: a task per chain, a decision placing 1,000 spans would
start 1,000 tasks in one turn of the event loop); the writes of one chain run in order and the chain stops at its first
failure. Each write, and each response's write-through, waits its turn on the informer's pacer
(``controller.process.pacing``), so that completions arriving together do not make one long turn of the loop.
Idempotence rules: AlreadyExists on create (unless the create is exclusive) and NotFound on delete are success;
a status write carries the resourceVersion the decision saw (or the one an earlier create in the same chain
returned), and a status write after a create that found the object already there fails as a conflict instead
of landing blindly on someone else's object. Every successful response is written through into the informer's
cache.

A failed write (an API error status, a timeout or a broken connection) abandons its chain; the next
decision starts from a fresh snapshot. Each failure is counted by reason (``Executor.errors``), which the
maintainer's metrics read at scrape time (``api_write_errors_total``), so this package needs no metrics library.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from controller.engine import intents as I
from controller.engine import teardown
from controller.engine.maintainer import REFUSAL_CODES, Decision, Refusal
from controller.kube.client import EVENTS, LEASES, LIST_PAGE, RESOURCES, ApiError, BadResponse, Client
from controller.kube.liveness import LEASE
from controller.kube.store import Cache
from controller.model import resources as conv
from controller.model.states import API_VERSION
from controller.process.pacing import Pacer

log = logging.getLogger(__name__)
JSON = dict[str, Any]
ALREADY_EXISTS = "AlreadyExists"
#: Reasons of the failures that carry no API status (distinct from the API's own "Timeout" reason).
TIMEOUT = "ClientTimeout"
CONNECTION_ERROR = "ConnectionError"
BAD_RESPONSE = "BadResponse"
STALE_VIEW = "StaleView"


class StaleView(Exception):
    """A consistent read (``ConfirmNoneLeft``, ``ConfirmPresent``, ``ConfirmGone``) found what the decision's view did
    not show."""


#: What a failed write raises; the chain is abandoned and the next decision starts from a fresh snapshot.
WRITE_ERRORS = (ApiError, BadResponse, TimeoutError, aiohttp.ClientError, ConnectionError, StaleView)


def failure_reason(exc: BaseException) -> str | None:
    """The reason a write failed: the API's status reason (Conflict, NotFound, InternalError...), else the
    status code; ClientTimeout or ConnectionError for a request that got no answer; BadResponse for an
    answer that is not the API's; None for anything else."""
    if isinstance(exc, ApiError):
        return exc.reason or str(exc.status)
    if isinstance(exc, TimeoutError):  # aiohttp's timeouts included (asyncio.TimeoutError is TimeoutError)
        return TIMEOUT
    if isinstance(exc, aiohttp.ClientError | ConnectionError):
        return CONNECTION_ERROR
    if isinstance(exc, BadResponse):
        return BAD_RESPONSE
    if isinstance(exc, StaleView):
        return STALE_VIEW
    return None


def changefeed_owner(obj: JSON | None) -> JSON | None:
    """The ownerReference naming a Changefeed object (None without one, or without its uid)."""
    meta = (obj or {}).get("metadata") or {}
    if not meta.get("uid"):
        return None
    return {
        "apiVersion": API_VERSION,
        "kind": "Changefeed",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }


@dataclass
class Outcome:
    chains: int = 0
    failed: int = 0
    writes: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    #: Creates that landed (AlreadyExists included) and creates the API refused (for ``maintainer.observed``).
    created: int = 0
    refusals: list[Refusal] = field(default_factory=list)


class Executor:
    def __init__(
        self,
        client: Client,
        informer: Cache,
        namespace: str,
        concurrency: int = 16,
        list_page: int = LIST_PAGE,
        pacer: Pacer | None = None,
    ) -> None:
        self.client = client
        self.list_page = list_page
        self.informer = informer
        self.namespace = namespace
        self.concurrency = concurrency
        self.sem = asyncio.Semaphore(concurrency)
        #: Shared with the informer (the runner passes its pacer): one turn's slice for all paced work.
        self.pacer = pacer or Pacer()
        self.errors: Counter[str] = Counter()

    def owner_reference(self, changefeed: str) -> JSON | None:
        """An ownerReference to ``changefeed`` as cached (None if not known): the objects the maintainer
        creates for a changefeed are garbage-collected with it if its teardown finalizer is taken off by
        hand. No ``blockOwnerDeletion``: it would need the ``changefeeds/finalizers`` permission where the
        OwnerReferencesPermissionEnforcement admission plugin is on, and the teardown orders deletions."""
        return self.informer.store.owner_reference(changefeed)

    def _failed(self, reason: str) -> None:
        self.errors[reason] += 1

    async def apply(self, decision: Decision) -> Outcome:
        out = Outcome(chains=len(decision.chains))
        fences: dict[tuple[str, str], asyncio.Future[None]] = {}
        todo = iter(decision.chains)

        async def worker() -> None:
            for chain in todo:  # shared: each worker takes the next chain not started, in order
                if not await self._chain(chain, out, fences):
                    out.failed += 1

        await asyncio.gather(*(worker() for _ in range(min(self.concurrency, len(decision.chains)))))
        return out

    async def _chain(self, chain: I.Chain, out: Outcome, fences: dict[tuple[str, str], asyncio.Future[None]]) -> bool:
        local: dict[tuple[str, str], str] = {}
        async with self.sem:
            for w in chain.writes:
                await self.pacer.pace()
                try:
                    if isinstance(w, I.FenceCapture):
                        await self._fence_once(w, fences)
                    else:
                        await self._one(w, local, chain.wake)
                except WRITE_ERRORS as exc:
                    reason = failure_reason(exc) or type(exc).__name__
                    out.errors[reason] += 1
                    if isinstance(w, I.Create) and isinstance(exc, ApiError) and exc.status in REFUSAL_CODES:
                        out.refusals.append(Refusal(w.describe(), exc.reason, exc.message))
                        log.warning("the API refused %s: %s %s: %s", w.describe(), exc.status, exc.reason, exc.message)
                    self._failed(reason)
                    log.debug("chain %r stopped at %s: %s", chain.why, w.describe(), exc)
                    return False
                if not isinstance(w, I.READS):
                    out.writes += 1
                if isinstance(w, I.Create):
                    out.created += 1
        return True

    async def _one(self, w: I.Write, local: dict[tuple[str, str], str], wake: bool = True) -> None:
        ns = self.namespace
        if isinstance(w, I.Create):
            res = RESOURCES[w.obj.kind]
            body = conv.to_resource(w.obj)
            body.pop("status", None)
            meta = body["metadata"]
            for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "deletionTimestamp"):
                meta.pop(key, None)
            meta["namespace"] = ns
            owner = self.owner_reference(getattr(w.obj, "changefeed", ""))
            if owner is not None:
                meta["ownerReferences"] = [owner]
            try:
                created = await self.client.create(res, ns, body)
            except ApiError as exc:
                if exc.already_exists and not w.exclusive:
                    local[(w.obj.kind.value, w.obj.name)] = ALREADY_EXISTS
                    return
                raise
            local[(w.obj.kind.value, w.obj.name)] = created["metadata"]["resourceVersion"]
            await self._write_through(w.obj.kind.value, created, wake)
        elif isinstance(w, I.WriteStatus):
            ref = (w.obj.kind.value, w.obj.name)
            rv = local.get(ref, w.obj.resource_version)
            if rv == ALREADY_EXISTS:
                raise ApiError(409, "Conflict", f"{w.obj.kind} {w.obj.name} existed before this chain created it")
            patch = conv.status_merge_patch(w.obj)
            if rv:
                patch["metadata"] = {"resourceVersion": rv}
            updated = await self.client.patch(RESOURCES[w.obj.kind], ns, w.obj.name, patch, sub="status")
            local[ref] = updated["metadata"]["resourceVersion"]
            await self._write_through(w.obj.kind.value, updated, wake)
        elif isinstance(w, I.Delete):
            try:
                resp = await self.client.delete(RESOURCES[w.kind], ns, w.name, w.uid)
            except ApiError as exc:
                if exc.not_found:
                    self.informer.gone(w.kind.value, w.name, w.uid)
                    return
                # 409: another incarnation has the name (uid precondition). The chain stops, as the simulator's
                # executor stops it: its next writes (a finalizer's release) name that object too.
                raise
            if resp.get("kind") == RESOURCES[w.kind].kind and resp.get("metadata", {}).get("deletionTimestamp"):
                self.informer.offer(w.kind.value, resp)
            else:  # a Status: gone (its answer carries no resourceVersion)
                self.informer.gone(w.kind.value, w.name, w.uid or str(resp.get("details", {}).get("uid") or ""))
        elif isinstance(w, I.AddFinalizer | I.RemoveFinalizer):
            await self._finalizer(w, local)
        elif isinstance(w, I.Event):
            await self._event(w)
        elif isinstance(w, I.ConfirmNoneLeft):
            await self._confirm_none_left(w)
        elif isinstance(w, I.ConfirmPresent):
            await self._confirm_present(w)
        elif isinstance(w, I.ConfirmGone):
            await self._confirm_gone(w)

    async def _write_through(self, kind: str, obj: JSON, wake: bool = True) -> None:
        """Offer a write's response to the informer in its turn (the pacer's): responses that arrive together
        are written through a slice at a time. Offered even if the chain is cancelled meanwhile (the write
        landed). ``wake`` False (``Chain.wake``): the cache takes it without telling anyone, so no decision
        runs for it (its watch event then brings nothing newer)."""
        try:
            await self.pacer.pace()
        finally:
            self.informer.offer(kind, obj, notify=wake)

    async def _confirm_present(self, w: I.ConfirmPresent) -> None:
        """GET (no resourceVersion: a consistent read) ``w.name``: gone, or another incarnation, fails the chain and
        takes the one the view held out of it at once (``Informer.gone``); there, it is offered (as fresh as any).
        With ``w.resource_version``: changed since fails the chain too, the newer one offered."""
        try:
            obj = await self.client.get(RESOURCES[w.kind], self.namespace, w.name)
        except ApiError as exc:
            if not exc.not_found:
                raise
            self.informer.gone(w.kind.value, w.name, w.uid)
            raise StaleView(f"{w.kind} {w.name} is gone") from None
        if w.uid and (obj.get("metadata") or {}).get("uid") != w.uid:
            self.informer.gone(w.kind.value, w.name, w.uid)
            self.informer.offer(w.kind.value, obj)
            raise StaleView(f"{w.kind} {w.name} is another incarnation")
        self.informer.offer(w.kind.value, obj)
        if w.resource_version and (obj.get("metadata") or {}).get("resourceVersion") != w.resource_version:
            raise StaleView(f"{w.kind} {w.name} changed since this view")  # the newer one is in the view now

    async def _confirm_gone(self, w: I.ConfirmGone) -> None:
        """GET (no resourceVersion: a consistent read) ``w.name``: found (any incarnation, or ``w.uid``'s), it fails the
        chain; found at all, it is offered to the informer, so the next decision sees what this one's view had not."""
        try:
            obj = await self.client.get(RESOURCES[w.kind], self.namespace, w.name)
        except ApiError as exc:
            if exc.not_found:
                return
            raise
        self.informer.offer(w.kind.value, obj)
        if not w.uid or (obj.get("metadata") or {}).get("uid") == w.uid:
            raise StaleView(f"{w.kind} {w.name} is still there")

    async def _confirm_none_left(self, w: I.ConfirmNoneLeft) -> None:
        """LIST each kind the teardown removes (no resourceVersion: a consistent read, in pages) until
        something of the changefeed turns up; what does is offered to the informer and fails the chain.
        Every Span, Dispatcher, SpanOperator and Table of the namespace is read (a person's objects need
        not carry the changefeed's label), once per release attempt: a teardown's last step."""
        for kind in teardown.LEFT_BEHIND_KINDS:
            async for page, _rv in self.client.list_pages(RESOURCES[kind], self.namespace, limit=self.list_page):
                found: list[tuple[JSON, str]] = []
                for obj in page:
                    try:
                        rec = conv.from_resource(obj)
                    except conv.InvalidResource:
                        continue  # not in any decision's view either (the informer reports it)
                    for left in teardown.left_behind([rec], w.changefeed):
                        found.append((obj, f"{left.kind} {left.name}"))
                if found:
                    for obj, _ in found:
                        self.informer.offer(kind.value, obj)
                    names = ", ".join(n for _, n in found[:4])
                    raise StaleView(f"changefeed {w.changefeed}: {len(found)} object(s) left, e.g. {names}")

    async def _fence_once(self, w: I.FenceCapture, fences: dict[tuple[str, str], asyncio.Future[None]]) -> None:
        """One Lease write per decision however many of its chains carry the same fence (every chain that
        releases a dispatcher of that capture does): the first runs it, the others wait for its outcome,
        success or failure. One write suffices: it landed after the decision's view was read."""
        key = (w.capture, w.lease_version)
        task = fences.get(key)
        if task is None:
            task = fences[key] = asyncio.ensure_future(self._fence(w))
        await asyncio.shield(task)

    async def _fence(self, w: I.FenceCapture) -> None:
        """Take a capture's Lease by a write that lands after the decision's view: holder cleared (already
        cleared: written again), with the version the decision judged as precondition.

        From then on the capture's renewals (compare-and-swaps on its own last version) fail, so whatever
        it paused can never resume, and a process of the capture that acquires the Lease later runs only
        dispatchers created after it did. Success when the Lease is gone; a conflict (the capture renewed,
        or a restarted process of it acquired the Lease, since the version the decision judged) fails the
        chain and the next decision judges again from the newer Lease."""
        name = conv.lease_name(w.capture)
        current = self.informer.store.leases.objects.get(name)
        if current is None:
            return
        if current.get("metadata", {}).get("resourceVersion") != w.lease_version:
            raise ApiError(409, "Conflict", f"Lease {name} changed since the decision")
        meta = current.get("metadata") or {}
        annotations = {**(meta.get("annotations") or {}), conv.FENCED_ANNOTATION: conv.format_time(time.time())}
        body = {
            **current,
            "metadata": {**meta, "annotations": annotations},
            "spec": {**current["spec"], "holderIdentity": ""},
        }
        try:
            # The body is the Lease as cached, uid included: a Lease deleted meanwhile is refused (409), not created
            # again (a Lease PUT to a missing name creates it).
            taken = await self.client.replace(LEASES, self.namespace, name, body)
        except ApiError as exc:
            if exc.not_found:
                return
            if exc.conflict:
                # A renewal or an acquisition landed first: the next decision judges from the newer Lease.
                try:
                    self.informer.offer(LEASE, await self.client.get(LEASES, self.namespace, name))
                except ApiError as again:
                    if not again.not_found:
                        raise
                    return  # deleted since the decision (the uid precondition failed): gone, as a 404
            raise
        log.info("took the Lease %s of a lost capture", name)
        self.informer.offer(LEASE, taken)

    async def _finalizer(self, w: I.AddFinalizer | I.RemoveFinalizer, local: dict[tuple[str, str], str]) -> None:
        current = self.informer.store.record(w.kind, w.name)
        if current is None:
            if isinstance(w, I.RemoveFinalizer):
                return
            raise ApiError(404, "NotFound", f"{w.kind} {w.name} not in cache")
        have = list(current.finalizers)
        if isinstance(w, I.AddFinalizer):
            if w.finalizer in have:
                return
            want = [*have, w.finalizer]
        else:
            if w.finalizer not in have:
                return
            want = [f for f in have if f != w.finalizer]
        rv = local.get((w.kind.value, w.name), current.resource_version)
        patch = {"metadata": {"finalizers": want, "resourceVersion": rv}}
        try:
            updated = await self.client.patch(RESOURCES[w.kind], self.namespace, w.name, patch)
        except ApiError as exc:
            if exc.not_found and isinstance(w, I.RemoveFinalizer):
                self.informer.gone(w.kind.value, w.name, current.uid)
                return
            raise
        if updated.get("metadata", {}).get("deletionTimestamp") and not want:
            self.informer.gone(w.kind.value, w.name, str(updated["metadata"].get("uid") or ""))
        else:
            local[(w.kind.value, w.name)] = updated["metadata"]["resourceVersion"]
            self.informer.offer(w.kind.value, updated)

    async def _event(self, w: I.Event) -> None:
        now = conv.format_time(time.time())
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{w.name[:200]}.", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": w.kind.value,
                "name": w.name,
                "namespace": self.namespace,
            },
            "reason": w.reason,
            "message": w.message[:1024],
            "type": "Warning" if w.warning else "Normal",
            "source": {"component": "changefeed-maintainer"},
            "reportingComponent": "changefeed-maintainer",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.client.create(EVENTS, self.namespace, body)
        except WRITE_ERRORS as exc:  # Events are best effort
            self._failed(failure_reason(exc) or type(exc).__name__)
            log.debug("event %s not posted: %s", w.reason, exc)
