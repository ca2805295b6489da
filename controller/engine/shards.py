"""Scale-out: how many changefeeds each maintainer replica leads. Pure; the runner acts on it.

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
  for the same shortfall. The caller rate-limits rounds and waits for the membership to settle after a start.
  Hysteresis: every count within [floor, ceil] is balanced, and nothing moves then.

Handing over is the graceful end of a term (the runner finishes the decision in hand, stops writing, releases
the Lease); the taker bootstraps at a new epoch as after any failover, restoring every in-flight operator.
Members that stopped renewing leave the live set, and the counts of their Leases with them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

__all__ = ["MEMBER_PREFIX", "changefeed_lease", "hand_over", "may_bid", "member_lease", "share"]

#: Prefix of a replica's member Lease. No changefeed's Lease (``cfm-<name>``) can have this name.
MEMBER_PREFIX = "cfmm-"


def member_lease(identity: str) -> str:
    return f"{MEMBER_PREFIX}{identity}"[:253]


def changefeed_lease(changefeed: str) -> str:
    """The Lease whose holder leads ``changefeed``."""
    return f"cfm-{changefeed}"[:253]


def share(changefeeds: int, members: int) -> tuple[int, int]:
    """(floor, ceil) of the changefeeds per member."""
    n = max(1, members)
    return changefeeds // n, -(-changefeeds // n)


def may_bid(leading: int, changefeeds: int, members: int, max_leases: int = 0) -> bool:
    """Whether a replica leading ``leading`` changefeeds may bid for one more."""
    if max_leases and leading >= max_leases:
        return False
    return leading < share(changefeeds, members)[1]


def hand_over(me: str, counts: Mapping[str, int], changefeeds: int, mine: Collection[str]) -> list[str]:
    """The changefeeds ``me`` should hand over now (none: balanced, or not its turn).

    ``counts``: live member -> how many changefeeds it leads (``me`` included); ``mine``: the changefeeds ``me``
    leads that may be handed over (not being deleted: a teardown is finished where it started)."""
    if me not in counts or not mine:
        return []
    low, high = share(changefeeds, len(counts))
    leading = counts[me]
    ordered = sorted(mine, reverse=True)
    if leading > high:
        return ordered[: leading - high]  # every member above the ceiling gives its excess, at once
    short = any(c < low for m, c in counts.items() if m != me)
    if not (leading == high and high > low and short):
        return []
    # Only the most loaded member gives one up (ties by identity): one handoff per shortfall.
    first = min(counts, key=lambda m: (-counts[m], m))
    return ordered[:1] if first == me else []
