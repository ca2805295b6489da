"""Leases: the one protocol both processes hold theirs with, and leader election on it (client-go's semantics).

**Holding a Lease** (``renew``, used by the maintainer's elector and by the capture's Lease keeper): every write is
a PUT of the Lease as last read or answered, so it carries its resourceVersion and its uid as preconditions. A PUT
to a missing name *creates* a Lease on kube-apiserver (the Lease strategy allows create on update), so without the
uid a renewal would bring back a Lease deleted by hand, under its old holder; with it the write is refused (409).
A refusal (409) reads the Lease: gone, or another object (another uid), or no longer ours (``mine`` says why): the
holder has lost it (``LeaseLost``); still ours, it was our own write whose answer was lost: adopted, and written
again from it. An error (the API down, a read that fails) is not a loss: the holder retries, and gives up when its
own deadline says so.

**Leader election** (``LeaderElector``):

- Acquire: create the Lease, or take it over once it has not been renewed for its duration as
  observed on *our* clock (we time how long its renewTime has stayed unchanged, as client-go does,
  so clock skew between nodes does not matter). Every write carries the Lease's resourceVersion, so
  two candidates cannot both win, and its uid (the Lease as last read or answered): a Lease PUT to a missing
  name *creates* it (the Lease strategy allows create on update), so without the uid a renewal or a release
  of a Lease deleted meanwhile would bring it back under the old holder and ``leaseTransitions``. With it
  the write is refused (409: the uid precondition fails against the missing object).
- The epoch of a term is the Lease's ``leaseTransitions`` after our acquisition; we set it to at least
  one more than the epoch the changefeed already published, so it grows even if the Lease was deleted.
- Renew every ``retry`` seconds; if no renewal succeeded for ``renew_deadline`` (< duration) the
  leadership is lost and the caller must stop writing at once. A renewal refused (409) keeps the term only if
  the Lease is still the same object (uid) naming us with our term's ``leaseTransitions`` (our own write whose
  answer was lost); a Lease deleted (404) or created again (another uid) means leadership lost at once. The
  elector may then bid again through ``acquire``: a fresh Lease, created with an epoch above the published
  one (``floor``), so the term lost is never resumed under its old epoch. Each renewal attempt is bounded by what
  is left of the deadline, so a request that hangs (an API that went silent) cannot stretch the term.
- Resume a lapsed term: a candidate that finds the Lease still naming itself with its own term's
  ``leaseTransitions`` (nobody acquired it since: every acquisition raises it), and still the Lease object
  of that term (its uid: not one deleted and created again), renews it and keeps its epoch. This is what
  an API outage longer than the renew deadline looks like from the leader's side: it stopped writing at
  the deadline, and on the API's return nothing happened under another epoch, so the captures keep the
  dispatchers they paused (a new epoch would make them start afresh).
- Release on graceful shutdown: holder cleared and duration 1 s, so a successor takes over quickly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from controller.engine.shards import Seen, lapsed
from controller.kube.client import LEASES, ApiError, Client
from controller.model.resources import format_time

log = logging.getLogger(__name__)
JSON = dict[str, Any]


class LeaseLost(Exception):
    """The Lease was deleted, created again or taken by another holder: its holder may already be counted gone."""


async def renew(
    client: Client,
    namespace: str,
    held: JSON,
    spec: JSON,
    mine: Callable[[JSON], str],
    *,
    annotations: JSON | None = None,
    attempts: int = 2,
) -> JSON:
    """Write ``spec`` (and ``annotations`` in place of the held ones, if given) over Lease ``held`` (as last read or
    answered: its resourceVersion and uid are the preconditions); returns the Lease as answered. ``mine(current)``
    says why a Lease read after a refusal is not this holder's ("" if it is: our own write whose answer was lost).
    Raises ``LeaseLost`` when the Lease is gone, another object, or not ours; ``ApiError`` (409) when it kept changing
    under us ``attempts`` times; any transport error or other status as it comes."""
    meta = held.get("metadata") or {}
    name = str(meta.get("name") or "")
    for _ in range(attempts):
        body = {**held, "spec": spec}
        if annotations is not None:
            body["metadata"] = {**(held.get("metadata") or {}), "annotations": annotations}
        try:
            return await client.replace(LEASES, namespace, name, body)
        except ApiError as exc:
            if exc.not_found:  # (a PUT that carries the uid meets a deleted Lease with 409, not 404)
                raise LeaseLost(f"Lease {name} was deleted") from None
            if not exc.conflict:
                raise
        try:
            current = await client.get(LEASES, namespace, name)
        except ApiError as exc:
            if exc.not_found:
                raise LeaseLost(f"Lease {name} was deleted") from None
            raise
        if _uid(current) != _uid(held):
            raise LeaseLost(f"Lease {name} was deleted (and created again, uid {_uid(current)})")
        why = mine(current)
        if why:
            raise LeaseLost(f"Lease {name} {why}")
        held = current  # our own write whose answer we missed (e.g. a timed-out request): adopt it and retry
    raise ApiError(409, "Conflict", f"Lease {name} kept changing")


class LeaderElector:
    def __init__(
        self,
        client: Client,
        namespace: str,
        name: str,
        identity: str,
        *,
        duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry: float = 2.0,
        owner: Callable[[], JSON | None] = lambda: None,
        silent: Callable[[str, str], float] = lambda holder, renew: 0.0,
        on_answer: Callable[[], None] = lambda: None,
    ) -> None:
        self.client = client
        #: For how long (seconds, on our clock) the Lease has been seen unchanged with this holder and renewTime
        #: before our first bid (the informer watches it all along: ``LeaseLiveness.silence``); 0 if not known.
        self.silent = silent
        #: The ownerReference a Lease this elector creates carries (e.g. its Changefeed's), or None.
        self.owner = owner
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.duration = duration
        self.renew_deadline = renew_deadline
        self.retry = retry
        self.lease: JSON | None = None
        self.epoch = 0
        #: When the last successful write of the Lease was sent (monotonic): the term lasts until
        #: ``renewed + renew_deadline`` unless renewed again.
        self.renewed = 0.0
        self._observed: tuple[str, str, float] | None = None  # (holder, renewTime, when we saw it change)
        #: Called after every bid the API answered (won, or lost to a holder): the maintainer's readiness.
        self.on_answer = on_answer

    def _body(self, transitions: int, acquire: str, holder: str | None = None, duration: float | None = None) -> JSON:
        now = format_time(time.time(), micro=True)
        return {
            "holderIdentity": self.identity if holder is None else holder,
            "leaseDurationSeconds": max(1, round(self.duration if duration is None else duration)),
            "acquireTime": acquire or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    async def try_acquire(self, floor: int = 0) -> bool:
        """One attempt; True if we hold the Lease now (``self.epoch`` is then the term's epoch)."""
        try:
            lease = await self.client.get(LEASES, self.namespace, self.name)
        except ApiError as exc:
            if not exc.not_found:
                raise
            meta: JSON = {"name": self.name, "namespace": self.namespace}
            owner = self.owner()
            if owner is not None:
                meta["ownerReferences"] = [owner]
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": meta,
                "spec": self._body(floor + 1, ""),
            }
            try:
                self.lease = await self.client.create(LEASES, self.namespace, body)
            except ApiError as exc2:
                if exc2.status == 409:
                    return False
                raise
            self.epoch = floor + 1
            self.renewed = time.monotonic()
            return True
        spec = lease.get("spec", {})
        holder = spec.get("holderIdentity") or ""
        renew = spec.get("renewTime") or ""
        now = time.monotonic()
        if self._observed is None or self._observed[:2] != (holder, renew):
            self._observed = (holder, renew, now)
        duration = float(spec.get("leaseDurationSeconds") or self.duration)
        # Counted from when it was first seen so, by our first look or by our watch (found by bench/scale_out.py:
        # a held-back bid started the clock afresh, and a SIGKILLed replica's changefeeds were led again 31 s
        # after the kill with a 15 s Lease).
        expired = lapsed(Seen(holder, duration, self.silent(holder, renew)), now - self._observed[2])
        if holder != self.identity and not expired:
            return False
        current = int(spec.get("leaseTransitions") or 0)
        if (
            holder == self.identity
            and self.epoch
            and current == self.epoch
            and self.epoch >= floor
            and _uid(lease) == _uid(self.lease)
        ):
            transitions, acquired = self.epoch, str(spec.get("acquireTime") or "")  # our term, resumed
        else:
            transitions, acquired = max(current, floor) + 1, ""
        lease["spec"] = self._body(transitions, acquired)  # its metadata as read: resourceVersion and uid
        sent = time.monotonic()
        try:
            self.lease = await self.client.replace(LEASES, self.namespace, self.name, lease)
        except ApiError as exc:
            if exc.status in (404, 409):  # taken meanwhile, or deleted (409 on a real server: the uid precondition)
                return False
            raise
        self.epoch = transitions
        self.renewed = sent
        return True

    async def acquire(
        self, floor: int = 0, may: Callable[[], bool] = lambda: True, answered: Callable[[], None] = lambda: None
    ) -> int:
        """Bid until won; returns the term's epoch. ``may()`` false: hold back this round (the caller's share
        of the changefeeds is full), which also counts as an answer (``on_answer``). ``answered()`` is called
        when a bid ``may()`` let through has its answer (won, lost or failed), before ``acquire`` returns: a
        caller that counts bids in flight against a cap lets go of this one there."""
        failures = 0
        while True:
            if not may():
                self.on_answer()
                await asyncio.sleep(self.retry)
                continue
            try:
                # Each attempt bounded (not the client's 30 s): an API that hung is retried soon after it returns.
                try:
                    async with asyncio.timeout(max(1.0, 2 * self.retry)):
                        won = await self.try_acquire(floor)
                finally:
                    answered()
                self.on_answer()
                failures = 0
                if won:
                    log.info("acquired lease %s as %s, epoch %d", self.name, self.identity, self.epoch)
                    return self.epoch
            except ApiError as exc:
                log.warning("lease %s: %s", self.name, exc)
            except Exception as exc:  # API unreachable: keep trying (and say so now and then, not every time)
                failures += 1
                if failures == 1 or failures % 20 == 0:
                    log.warning("lease %s unreachable (%d attempts): %r", self.name, failures, exc)
            await asyncio.sleep(self.retry)

    async def hold(self, lost: asyncio.Event) -> None:
        """Renew (``renew``) until a renewal fails for ``renew_deadline`` or the Lease is lost (deleted, created again,
        taken); then set ``lost``."""
        last_ok = self.renewed or time.monotonic()
        while True:
            await asyncio.sleep(max(0.0, min(self.retry, last_ok + self.renew_deadline - time.monotonic())))
            sent = time.monotonic()
            try:
                assert self.lease is not None
                spec = self._renewal(self.lease)["spec"]
                # Never past the deadline: a hung request must not keep us leading.
                async with asyncio.timeout(max(0.05, last_ok + self.renew_deadline - sent)):
                    self.lease = await renew(self.client, self.namespace, self.lease, spec, self._mine)
                last_ok = self.renewed = sent
                continue
            except LeaseLost as exc:
                log.warning("%s: leadership lost", exc)
                lost.set()
                return
            except Exception as exc:
                log.warning("lease %s renewal failed: %s", self.name, exc)
            if time.monotonic() - last_ok >= self.renew_deadline:
                log.warning("lease %s not renewed for %.0fs: leadership lost", self.name, self.renew_deadline)
                lost.set()
                return

    def _renewal(self, lease: JSON) -> JSON:
        """The renewal of ``lease`` (as last answered): its metadata kept, so the write carries its resourceVersion
        and uid (a Lease deleted meanwhile is refused, not re-created), the term's transitions and acquireTime."""
        spec = lease.get("spec") or {}
        body = self._body(int(spec.get("leaseTransitions") or self.epoch), str(spec.get("acquireTime") or ""))
        return {**lease, "spec": body}

    def _mine(self, current: JSON) -> str:
        """Why ``current`` (read after a refusal) is not this term's Lease ("" if it is: our own write whose answer
        was lost). The same object (uid) is checked by ``renew``; here: naming us, with the term's transitions."""
        spec = current.get("spec") or {}
        if spec.get("holderIdentity") != self.identity:
            return f"was taken by {spec.get('holderIdentity')!r}"
        if int(spec.get("leaseTransitions") or 0) != self.epoch:
            return "began another term"
        return ""

    async def release(self) -> None:
        if self.lease is None:
            return
        lease = dict(self.lease)  # its metadata kept: a release of a Lease deleted meanwhile must not re-create it
        spec = dict(lease.get("spec", {}))
        lease["spec"] = self._body(int(spec.get("leaseTransitions") or self.epoch), "", holder="", duration=1)
        try:
            # Bounded: a shutdown must not wait on an API that does not answer (the Lease then expires).
            async with asyncio.timeout(5.0):
                await self.client.replace(LEASES, self.namespace, self.name, lease)
        except Exception as exc:
            log.info("lease %s not released: %r", self.name, exc)


def _uid(lease: JSON | None) -> str:
    return str(((lease or {}).get("metadata") or {}).get("uid") or "")
