"""Scale-out: the balance policy of one maintainer replica, as a pure step. The runner and the balance simulator run it.

``controller.engine.shards`` has the rules of the share (``counts``, ``may_bid``, ``hand_over``, ``held_back``...);
this module composes them with the rate limits around them, in one place, so that no rule of the balance is held
twice (a copy of the rate limits in the balance simulator would let a regression of the runner's pass it). The
runner (``controller.maintainer.runner``) builds a ``View`` from its informer's Leases and applies what ``step``
decides, and the simulator (``controller.sim.balance``) builds the same ``View`` from its simulated world and calls
the same ``step``. The rules:

- *Settle*: no bid and no handoff in the replica's first ``retry`` (balancing only): replicas started together see
  each other's member Leases within a renewal or two, and bidding before that let the first take everything.
- *Warm-up*: for its first lease duration a replica counts at least ``expected_replicas`` members (the others of
  the Deployment may not have announced themselves yet: their processes start seconds apart).
- *Bids*: a changefeed's loop asks (``View.asking``); it may bid unless it handed the changefeed over lately and
  nobody took it since (``shards.held_back``), a live holder other than itself renews it, or its share is full
  (``shards.may_bid``), counting its bids in flight (``View.bids``) and those this step lets through. It bids for
  the free changefeeds in an order rotated by its place among the members (``_bid_order``), so that replicas with
  room for one each bid for different ones, not all for the first.
- *Rounds*: the balance is looked at once per ``retry``, none before settle + one lease duration, one round of
  handoffs (``shards.hand_over``) per two lease durations and none while one is under way (``View.handing``).
- *Lateness*: members whose renewals are three retry periods overdue (a SIGKILLed replica, until its Lease lapses)
  have no shortfall to hand over for.

Time is passed in (``now``: the replica's monotonic clock, the clock ``Seen.silent`` is counted on); nothing here
reads a clock or does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from controller.engine import shards
from controller.engine.shards import Seen

__all__ = ["MUTANTS", "Config", "Decision", "Memory", "View", "counts", "handed", "late", "settle", "step"]

#: Deliberate bugs of the policy that the balance simulator (``controller.sim.balance``) must catch (with
#: ``shards.MUTANTS``, the bugs of the share's rules).
MUTANTS = frozenset(
    {
        "bids-race-past-share",  # bids in flight do not count: a replica's loops all bid at once
        "warm-up-ignores-expected",  # a replica's first lease duration counts only the members it sees
        "rounds-unspaced",  # a round of handoffs at every look (once per retry), not one per two lease durations
        "bids-herd",  # every replica bids for the free changefeeds in one order: all for the same one, one wins
    }
)

#: Retry periods after which a member's renewals count as overdue (``late``): it renews once every one.
LATE_RETRIES = 3
#: Lease durations between two rounds of handoffs: the takers bootstrap and the counts settle first.
ROUND_DURATIONS = 2
#: Retry periods for which a replica at floor or above leaves a freed Lease to a member below floor.
GRACE_RETRIES = 2


@dataclass(frozen=True)
class Config:
    """What a replica is told (``Settings`` for the runner; the simulator's constants)."""

    identity: str
    #: When the replica started, on the clock ``now`` is read from.
    started: float
    lease_duration: float
    retry: float
    #: Off: every replica bids for every changefeed (the first to bid leads; ``max_leases`` caps it), no handoffs.
    balance: bool = True
    max_leases: int = 0  # 0: no cap
    expected_replicas: int = 1


@dataclass(frozen=True)
class Memory:
    """What the policy remembers from one step to the next (the caller keeps it and hands it back in the ``View``)."""

    #: Changefeed handed over -> (until when its bids are held back, the epoch it was released at) (``handed``).
    handed_until: Mapping[str, tuple[float, int]] = field(default_factory=lambda: MappingProxyType({}))
    #: When the last round of handoffs was decided.
    handed_at: float = -math.inf
    #: When the balance is next looked at (at most once per ``retry``).
    next_look: float = -math.inf


@dataclass(frozen=True)
class View:
    """One replica's view at a step: its Leases as its watch shows them, and what it is doing."""

    config: Config
    #: Every member Lease seen (its name -> ``Seen``), its own included once written.
    members: Mapping[str, Seen]
    #: Every changefeed -> its Lease as seen (None: none yet).
    changefeeds: Mapping[str, Seen | None]
    #: The changefeeds it leads.
    leading: Collection[str] = frozenset()
    #: The changefeeds whose bids it let through and that have no answer yet (they count against its share).
    bids: Collection[str] = frozenset()
    #: The changefeeds whose loops ask, now, whether to bid.
    asking: Collection[str] = frozenset()
    #: Handoffs decided whose terms have not ended yet.
    handing: Collection[str] = frozenset()
    #: Changefeeds being deleted (never handed over: a teardown is finished where it started).
    deleting: Collection[str] = frozenset()
    memory: Memory = field(default_factory=Memory)


@dataclass(frozen=True)
class Decision:
    #: Of ``View.asking``: the changefeeds to bid for now (they count as ``View.bids`` until answered).
    bids: tuple[str, ...]
    #: The changefeeds to hand over (end the term at the next decision boundary, then release the Lease).
    hand_over: tuple[str, ...]
    #: The memory the next step is given.
    memory: Memory

    @property
    def next_due(self) -> float:
        """When the next look at the balance is due (a step sooner decides no handoff)."""
        return self.memory.next_look


def settle(config: Config) -> float:
    """Seconds after start before a replica bids or hands over: its member Lease and the others' seen."""
    return config.retry if config.balance else 0.0


def late(view: View, mutants: Collection[str] = ()) -> set[str]:
    """Members whose renewals are overdue (silent for ``LATE_RETRIES`` retry periods; they renew every one)."""
    limit = LATE_RETRIES * view.config.retry
    return {s.holder for s in view.members.values() if s.holder and (s.silent or 0.0) >= limit}


def counts(view: View, mutants: Collection[str] = ()) -> dict[str, int]:
    """Live member -> how many changefeeds it leads, as this replica's Leases show (itself: its own truth)."""
    return shards.counts(view.config.identity, len(view.leading), view.members, view.changefeeds, mutants)


def handed(
    memory: Memory, changefeed: str, epoch: int, now: float, config: Config, mutants: Collection[str] = ()
) -> Memory:
    """The memory after the replica released ``changefeed``'s Lease (at ``epoch``) to hand it over: its bids for it
    are held back for ``shards.hold_back`` (so the Lease goes to another replica rather than straight back)."""
    until = now + shards.hold_back(config.retry, config.lease_duration, mutants)
    return replace(memory, handed_until=MappingProxyType({**memory.handed_until, changefeed: (until, epoch)}))


def step(view: View, now: float, mutants: Collection[str] = ()) -> Decision:
    """Which of the asking changefeeds to bid for now, which changefeeds to hand over, and the memory after."""
    c = view.config
    tally = counts(view, mutants) if c.balance else {}
    bids = tuple(_bids(view, now, tally, mutants))
    give, memory = _balance(view, now, tally, mutants)
    return Decision(bids, give, memory)


def _bids(view: View, now: float, tally: Mapping[str, int], mutants: Collection[str]) -> list[str]:
    c = view.config
    out: list[str] = []
    if c.balance and now - c.started < settle(c):
        return out  # replicas started together see each other within a renewal or two
    total = len(view.changefeeds)
    members = len(tally)
    if c.balance and now - c.started < c.lease_duration and "warm-up-ignores-expected" not in mutants:
        members = max(members, c.expected_replicas)  # the Deployment's others may not have announced themselves
    low = shards.share(total, members)[0]
    others_short = any(n < low for m, n in tally.items() if m != c.identity)
    in_flight = set(view.bids)
    for name in _bid_order(view, tally, mutants):
        seen = view.changefeeds.get(name)
        until, released = view.memory.handed_until.get(name, (-math.inf, 0))
        if shards.held_back(c.identity, until, released, now, seen, mutants):
            continue
        holder = shards.live_holder(seen, mutants)
        if holder and holder != c.identity:
            continue  # held by a replica whose renewals we see: a bid would only be refused
        leading = len(view.leading) + (0 if "bids-race-past-share" in mutants else len(in_flight - {name}))
        if not c.balance:
            ok = not c.max_leases or leading < c.max_leases
        else:
            ok = shards.may_bid(
                leading,
                total,
                members,
                c.max_leases,
                others_short=others_short,
                free_for=seen.silent if seen is not None and seen.silent is not None else math.inf,
                grace=GRACE_RETRIES * c.retry,
                mutants=mutants,
            )
        if ok:
            out.append(name)
            in_flight.add(name)
    return out


def _free(view: View, mutants: Collection[str]) -> list[str]:
    """The changefeeds no live replica holds, in name order (what the bids share out, and what a hand-over counts)."""
    return sorted(n for n, seen in view.changefeeds.items() if not shards.live_holder(seen, mutants))


def _bid_order(view: View, tally: Mapping[str, int], mutants: Collection[str]) -> list[str]:
    """The asking changefeeds in the order this replica bids for them. Replicas with room share the free changefeeds
    out instead of herding: the free ones (no live holder) in name order, rotated by this replica's place among the
    live members, so that with k changefeeds freed at once (a SIGKILLed replica's) and k replicas with room for one
    each, each bids for a different one first. In one order they all bid for the same one, one wins, and the last
    is taken k retry periods after the lapse (past lease duration + 5 s). Views that
    differ a little only make a collision possible again, never a bid impossible."""
    asking = sorted(view.asking)
    free = _free(view, mutants)
    ids = sorted(tally)
    if "bids-herd" in mutants or not free or view.config.identity not in ids:
        return asking
    turn = ids.index(view.config.identity) % len(free)
    rank = {n: (i - turn) % len(free) for i, n in enumerate(free)}
    return sorted(asking, key=lambda n: (rank.get(n, len(free)), n))


def _balance(
    view: View, now: float, tally: Mapping[str, int], mutants: Collection[str]
) -> tuple[tuple[str, ...], Memory]:
    c, memory = view.config, view.memory
    if not c.balance or now - c.started < settle(c) + c.lease_duration or now < memory.next_look:
        return (), memory
    kept = {n: v for n, v in memory.handed_until.items() if v[0] > now}
    memory = replace(memory, next_look=now + c.retry, handed_until=MappingProxyType(kept))
    spacing = 0.0 if "rounds-unspaced" in mutants else ROUND_DURATIONS * c.lease_duration
    if now - memory.handed_at < spacing or view.handing:
        return (), memory
    mine = [n for n in view.leading if n in view.changefeeds and n not in view.deleting]
    free = len(_free(view, mutants))
    give = shards.hand_over(c.identity, tally, len(view.changefeeds), mine, free, late(view, mutants), mutants)
    if not give:
        return (), memory
    return tuple(give), replace(memory, handed_at=now)
