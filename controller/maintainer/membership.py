"""Membership and balance: this replica's member Lease, and how many changefeeds it bids for or hands over.

Each replica announces itself with a member Lease ``cfmm-<identity>`` (created at start, renewed like the others,
deleted as it stops; a member Lease silent for ``MEMBER_GC`` lease durations on our clock is another replica gone
for good, and is deleted). The balance itself is a pure policy (``engine/balance_policy.step``), run here on a
``View`` built from the informer's typed Leases and this replica's terms, and run as is by the balance simulator
(``controller.sim.balance``): no rule of the balance lives in this file. What it decides is applied here: the bids
it lets through hold their place until answered, the handoffs go to the terms (``Terms.hand_over``), and its
memory is kept for the next step.
"""

from __future__ import annotations

import asyncio
import logging
import time

from controller.engine import balance_policy, shards
from controller.kube.client import LEASES, ApiError, Client
from controller.kube.lease import LeaderElector
from controller.kube.store import Store
from controller.maintainer.terms import Terms
from controller.model.records import Changefeed
from controller.model.states import Kind

log = logging.getLogger("controller.maintainer")
#: A member Lease silent for this many lease durations is deleted (its replica is gone for good).
MEMBER_GC = 10


class Membership:
    def __init__(
        self,
        client: Client,
        namespace: str,
        store: Store,
        terms: Terms,
        config: balance_policy.Config,
        *,
        renew_deadline: float,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.store = store
        self.terms = terms
        self.config = config
        #: This replica's member Lease, renewed while the process runs.
        self.member = LeaderElector(
            client,
            namespace,
            shards.member_lease(config.identity),
            config.identity,
            duration=config.lease_duration,
            renew_deadline=renew_deadline,
            retry=config.retry,
        )
        #: The policy's memory between steps (what was handed over and is held back, the last round, the next look).
        self.memory = balance_policy.Memory()
        #: Changefeeds whose Lease this replica is bidding for right now (``may_bid``).
        self._bids: set[str] = set()

    async def run(self) -> None:
        """Keep this replica's member Lease: acquire, renew; acquire again if it was lost."""
        while True:
            await self.member.acquire()
            lost = asyncio.Event()
            await self.member.hold(lost)

    async def leave(self) -> None:
        """Delete this replica's member Lease (best effort, bounded: the others' janitors delete it once it lapsed)."""
        async with asyncio.timeout(5.0):
            await self.client.delete(LEASES, self.namespace, self.member.name)

    # -- the policy -------------------------------------------------------------------------------------

    def view(self, now: float, asking: frozenset[str] = frozenset()) -> balance_policy.View:
        """This replica's ``balance_policy.View``: its member and changefeed Leases as its watch shows them, what it
        leads, bids for and hands over, and the policy's memory."""
        store = self.store
        members = {n: seen for n in store.leases.names(shards.MEMBER_PREFIX) if (seen := store.leases.seen(n, now))}
        cfs = store.all(Kind.CHANGEFEED)
        return balance_policy.View(
            config=self.config,
            members=members,
            changefeeds={cf: store.leases.seen(shards.changefeed_lease(cf), now) for cf in cfs},
            leading=frozenset(self.terms.leading),
            bids=frozenset(self._bids),
            asking=asking,
            handing=self.terms.handing(),
            deleting=frozenset(n for n, cf in cfs.items() if isinstance(cf, Changefeed) and cf.deleting),
            memory=self.memory,
        )

    def counts(self) -> dict[str, int]:
        """Live member -> how many changefeeds it leads, as the Leases show (this replica: its own truth)."""
        return balance_policy.counts(self.view(time.monotonic()))

    def step(self, asking: frozenset[str] = frozenset()) -> balance_policy.Decision:
        """One step of the policy, applied: the bids it lets through hold their place in the count of what this
        replica leads until answered (``answered``), the changefeeds it hands over end their terms at the next
        decision boundary (``Terms.hand_over``), and its memory is kept for the next."""
        now = time.monotonic()
        decision = balance_policy.step(self.view(now, asking), now)
        self.memory = decision.memory
        self._bids.update(decision.bids)
        for name in decision.hand_over:
            self.terms.hand_over(name)
        return decision

    def balance(self) -> None:
        """A look at the balance, from the supervisor's turn, when the policy says one is due (``next_look``: once
        per retry period; the supervisor turns up to 20 times a second)."""
        if time.monotonic() >= self.memory.next_look:
            self.step()

    # -- what a changefeed's loop asks ----------------------------------------------------------------

    def may_bid(self, name: str) -> bool:
        """Whether this replica bids for ``name``'s Lease now. A bid let through holds its place in the count of what
        this replica leads until it is answered (``answered``): the loops of many changefeeds ask at once, and
        without that all of them would bid before any had won, past the share and past ``maxLeases``."""
        return name in self.step(frozenset({name})).bids

    def answered(self, name: str) -> None:
        self._bids.discard(name)

    def handed(self, name: str, epoch: int) -> None:
        """``name``'s term (``epoch``) was handed over: held back from bidding for it for a while."""
        self.memory = balance_policy.handed(self.memory, name, epoch, time.monotonic(), self.config)

    def silent(self, lease: str, holder: str, renew: str) -> float:
        """How long our watch has seen ``lease`` unchanged with ``holder`` and ``renew`` (``Store.unchanged_for``):
        what a bid's elector counts a lapse from."""
        return self.store.leases.unchanged_for(lease, holder, renew, time.monotonic())

    # -- upkeep -----------------------------------------------------------------------------------------

    async def forget_members(self, default_duration: float) -> None:
        """Delete the member Leases of replicas gone for good (SIGKILLed: a graceful stop deletes its own): silent on
        our clock for ``MEMBER_GC`` lease durations. The uid precondition spares a Lease created anew."""
        store = self.store
        now = time.monotonic()
        for name in store.leases.names(shards.MEMBER_PREFIX):
            if name == self.member.name:
                continue
            seen = store.leases.seen(name, now)
            silent = seen.silent if seen is not None else None
            duration = (seen.duration if seen is not None else 0.0) or default_duration
            if silent is None or silent < MEMBER_GC * duration:
                continue
            try:
                await self.client.delete(LEASES, self.namespace, name, store.leases.uid(name))
                log.info("deleted the member Lease %s of a replica gone for %.0fs", name, silent)
            except ApiError as exc:
                if not (exc.not_found or exc.status == 409):
                    raise
