"""Scale-out: how many changefeeds each maintainer replica leads. Pure; ``balance_policy.step`` composes these rules
with the rate limits, and the runner and the balance simulator both run that step.

A changefeed is led by whichever replica holds its Lease ``cfm-<changefeed>``; the replicas cooperate only
through Leases. Each replica announces itself with a member Lease (``cfmm-<identity>``, renewed like the
others), so every replica sees the same live set, and the holders of the changefeed Leases say who leads what.
With N live members and C changefeeds each replica should lead floor(C/N) or ceil(C/N):

- **Bid** for a changefeed nobody leads only while leading fewer than ceil(C/N) (and fewer than
  ``maxLeases``, the hard cap). With one replica that is every changefeed, as before.
- **Hand over** what is above ceil(C/N), all at once: every replica above it does (a replica that joins three
  leading 15, 15 and 0 of 30 gets 5 from each in one round, not one per cool-down). That never overshoots:
  N x ceil(C/N) >= C, so what is above ceil fits below it, and only replicas below ceil bid. Or, leading exactly
  ceil(C/N) while some live member leads fewer than floor(C/N) (C/N not whole: 4, 4, 2 must become 4, 3, 3), one
  changefeed: only the most loaded replica gives it (ties by identity), so two replicas do not both give one up
  for the same shortfall. ``balance_policy`` rate-limits rounds and waits for the membership to settle after a start.
  Hysteresis: every count within [floor, ceil] is balanced, and nothing moves then.

Handing over is the graceful end of a term (the runner finishes the decision in hand, stops writing, releases
the Lease); the taker bootstraps at a new epoch as after any failover, restoring every in-flight operator.
Members that stopped renewing leave the live set, and the counts of their Leases with them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = [
    "MEMBER_PREFIX",
    "MUTANTS",
    "Seen",
    "changefeed_lease",
    "counts",
    "hand_over",
    "held_back",
    "hold_back",
    "lapsed",
    "live_holder",
    "may_bid",
    "member_lease",
    "share",
]

#: Deliberate bugs of the share's rules that the balance simulator (``controller.sim.balance``) must catch (with
#: ``balance_policy.MUTANTS``, the bugs of the policy that composes them with the rate limits).
MUTANTS = frozenset(
    {
        "balancer-ignores-lapse",  # a member whose Lease lapsed (a SIGKILLed replica) still counts, and its Leases
        "lapse-counted-from-first-bid",  # a held-back bid starts the lapse clock afresh (the elector's old rule)
        "handoff-releases-before-writes-stop",  # the Lease goes while the decision in hand still writes
        "handed-over-held-back-long",  # no bid for a changefeed handed over for two lease durations, taken or not
        "bid-past-a-shortfall",  # a replica at floor takes the Lease handed over for one below it (they flap)
    }
)

#: Retry periods for which a replica holds back its bids for a changefeed it handed over (``held_back``): a replica
#: short of its share bids within one; longer, and a handoff to a replica that died meanwhile leaves the changefeed
#: unled (found by the balance simulator: held back for two lease durations, 30 s, the changefeed waited as long).
HOLD_BACK_RETRIES = 3

#: Prefix of a replica's member Lease. No changefeed's Lease (``cfm-<name>``) can have this name.
MEMBER_PREFIX = "cfmm-"


def member_lease(identity: str) -> str:
    return f"{MEMBER_PREFIX}{identity}"[:253]


def changefeed_lease(changefeed: str) -> str:
    """The Lease whose holder leads ``changefeed``."""
    return f"cfm-{changefeed}"[:253]


@dataclass(frozen=True)
class Seen:
    """A Lease as one replica's watch shows it: its holder and duration, and for how long (seconds, on that
    replica's clock, counted only while its view of Leases was current) it has been seen unchanged."""

    holder: str
    duration: float
    silent: float | None = None  # None: no renewal seen yet to count from
    #: Its ``leaseTransitions``: raised by every acquisition (the epoch of the term it started).
    transitions: int = 0


def live_holder(seen: Seen | None, mutants: Collection[str] = ()) -> str:
    """Who holds the Lease, unless it has run out on our clock ("")."""
    if seen is None or not seen.holder:
        return ""
    if "balancer-ignores-lapse" in mutants:
        return seen.holder
    return seen.holder if seen.silent is None or seen.silent < seen.duration else ""


def counts(
    me: str,
    leading: int,
    members: Mapping[str, Seen],
    changefeeds: Mapping[str, Seen | None],
    mutants: Collection[str] = (),
) -> dict[str, int]:
    """Live member -> how many changefeeds it leads, as ``me`` sees the Leases (``leading``: its own truth). A member
    whose Lease ran out is not counted, nor are the changefeed Leases it held."""
    out = {me: 0}
    for member in members.values():
        holder = live_holder(member, mutants)
        if holder:
            out.setdefault(holder, 0)
    for lease in changefeeds.values():
        holder = live_holder(lease, mutants)
        if holder in out and holder != me:
            out[holder] += 1
    out[me] = leading
    return out


def lapsed(seen: Seen, first_look: float, mutants: Collection[str] = ()) -> bool:
    """Whether a candidate may take the Lease over (client-go's rule: unchanged for its duration on our clock).
    ``first_look``: seconds since the candidate's own first bid saw it as it is; the watch may have seen it
    unchanged for longer (``seen.silent``), and that counts: a replica that held its bids back (its share was
    full until the holder's replica lapsed) takes over when the Lease has run out, not a duration later."""
    if not seen.holder:
        return True
    unchanged = first_look
    if "lapse-counted-from-first-bid" not in mutants:
        unchanged = max(unchanged, seen.silent or 0.0)
    return unchanged >= seen.duration


def hold_back(retry: float, duration: float, mutants: Collection[str] = ()) -> float:
    """Seconds for which a replica holds back its bids for a changefeed it handed over (``held_back``)."""
    return 2 * duration if "handed-over-held-back-long" in mutants else HOLD_BACK_RETRIES * retry


def held_back(
    me: str, until: float, released: int, now: float, seen: Seen | None, mutants: Collection[str] = ()
) -> bool:
    """Whether ``me`` still holds back its bids for a changefeed it handed over (at epoch ``released``) until
    ``until`` (``hold_back`` after the handoff), so that the released Lease goes to another replica rather than
    straight back. Not once another replica has taken it since (its holder, or its transitions past
    ``released``): then it is a changefeed like any other (found by the balance simulator: the taker was
    SIGKILLed, or handed it on, the others were full, and the one replica with room would not bid)."""
    if now >= until:
        return False
    taken = seen is not None and (seen.holder not in ("", me) or seen.transitions > released)
    return not taken or "handed-over-held-back-long" in mutants


def share(changefeeds: int, members: int) -> tuple[int, int]:
    """(floor, ceil) of the changefeeds per member."""
    n = max(1, members)
    return changefeeds // n, -(-changefeeds // n)


def may_bid(
    leading: int,
    changefeeds: int,
    members: int,
    max_leases: int = 0,
    *,
    others_short: bool = False,
    free_for: float = math.inf,
    grace: float = 0.0,
    mutants: Collection[str] = (),
) -> bool:
    """Whether a replica leading ``leading`` changefeeds may bid for one more, free for ``free_for`` seconds (released
    or lapsed, on our clock). While another live member leads fewer than floor(C/N) (``others_short``), a replica at
    floor or above leaves a free Lease to it for ``grace`` seconds (about two bid periods): found by the balance
    simulator, a replica at floor took the Lease handed over for the short one, was then at the ceiling with the
    short one still short, handed it over again, and the two took turns for ever."""
    if max_leases and leading >= max_leases:
        return False
    low, high = share(changefeeds, members)
    if leading >= high:
        return False
    leave = others_short and leading >= low and free_for < grace
    return not leave or "bid-past-a-shortfall" in mutants


def hand_over(
    me: str,
    counts: Mapping[str, int],
    changefeeds: int,
    mine: Collection[str],
    free: int = 0,
    late: Collection[str] = (),
    mutants: Collection[str] = (),
) -> list[str]:
    """The changefeeds ``me`` should hand over now (none: balanced, or not its turn).

    ``counts``: live member -> how many changefeeds it leads (``me`` included); ``mine``: the changefeeds ``me``
    leads that may be handed over (not being deleted: a teardown is finished where it started); ``free``: how many
    changefeeds nobody live holds (released, or lapsed): a shortfall they will fill needs no handoff (found by
    the balance simulator: while a released Lease waited for its taker, the next most loaded replica gave one
    up for the same shortfall, and the next, 6 handoffs where 3 were enough). ``late``: members whose renewals are
    overdue (a SIGKILLed replica, until its Lease runs out): their shortfall is not one to hand over for (found
    by the balance simulator: a survivor took a dead replica's lapsed Lease and handed it straight back to it,
    and the changefeed waited two lease durations)."""
    if me not in counts or not mine:
        return []
    low, high = share(changefeeds, len(counts))
    leading = counts[me]
    ordered = sorted(mine, reverse=True)
    if leading > high:
        return ordered[: leading - high]  # every member above the ceiling gives its excess, at once
    short = sum(low - c for m, c in counts.items() if m != me and c < low and m not in late)
    if not (leading == high and high > low and short > free):
        return []
    # Only the most loaded member gives one up (ties by identity): one handoff per shortfall.
    first = min(counts, key=lambda m: (-counts[m], m))
    return ordered[:1] if first == me else []
