"""engine/shards.py: the share of changefeeds each maintainer replica leads, and who hands one over."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controller.engine import shards


def test_share_and_bidding() -> None:
    assert shards.share(30, 3) == (10, 10)
    assert shards.share(10, 3) == (3, 4)
    assert shards.share(5, 0) == (5, 5)  # no member seen yet: itself
    assert shards.may_bid(3, 10, 3)
    assert not shards.may_bid(4, 10, 3)
    assert shards.may_bid(29, 30, 1)  # one replica leads everything, as before
    assert not shards.may_bid(2, 30, 1, max_leases=2)  # maxLeases stays a hard cap


def test_hand_over_only_above_the_share_and_only_the_most_loaded() -> None:
    assert shards.hand_over("a", {"a": 10, "b": 10, "c": 10}, 30, ["x"]) == []  # balanced: nothing moves
    assert shards.hand_over("a", {"a": 11, "b": 10, "c": 9}, 30, ["x", "y"]) == ["y"]
    # Above the ceiling: the whole excess at once, by every member above it (a replica joins 15, 15, 0).
    mine = [f"cf{i:02d}" for i in range(15)]
    assert shards.hand_over("a", {"a": 15, "b": 15, "c": 0}, 30, mine) == mine[-5:][::-1]
    assert len(shards.hand_over("b", {"a": 15, "b": 15, "c": 0}, 30, mine)) == 5
    # 4, 4, 2 with 10 over 3: one at the ceiling gives one to the member below the floor; only the first by name.
    counts = {"a": 4, "b": 4, "c": 2}
    assert shards.hand_over("a", counts, 10, ["x"]) == ["x"]
    assert shards.hand_over("b", counts, 10, ["x"]) == []
    assert shards.hand_over("a", {"a": 4, "b": 3, "c": 3}, 10, ["x"]) == []  # within [3, 4]: hysteresis
    assert shards.hand_over("a", {"a": 12, "b": 0}, 12, []) == []  # nothing it may give (being deleted)
    assert shards.hand_over("z", {"a": 12}, 12, ["x"]) == []  # not a member


@given(st.integers(min_value=0, max_value=60), st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=6))
def test_repeated_handovers_converge_to_the_share(total: int, raw: list[int]) -> None:
    """Whatever the starting counts (within ``total``), rounds in which every member hands over what ``hand_over``
    names, each changefeed to the least loaded member below the ceiling (only those bid), end balanced: within
    as many handoffs as changefeeds are above the share, and never a member pushed above the ceiling."""
    counts = {f"m{i}": 0 for i in range(len(raw))}
    left = total
    for i, n in enumerate(raw):
        counts[f"m{i}"] = min(n, left)
        left -= counts[f"m{i}"]
    counts["m0"] += left  # every changefeed led by someone
    low, high = shards.share(total, len(counts))
    bound = sum(max(0, c - low) for c in counts.values())
    handed = 0
    for _ in range(bound + 1):
        given = {m: len(shards.hand_over(m, counts, total, [f"cf{j}" for j in range(counts[m])])) for m in counts}
        if not any(given.values()):
            break
        if not any(counts[m] > high for m in given if given[m]):
            assert sum(given.values()) == 1  # at the ceiling: never two at once for one shortfall
        for m, n in given.items():
            counts[m] -= n
        for _ in range(sum(given.values())):
            taker = min(counts, key=lambda m: (counts[m], m))
            assert counts[taker] < high  # only a member below the ceiling bids: nothing overshoots
            counts[taker] += 1
            handed += 1
    assert all(low <= c <= high for c in counts.values()), counts
    assert handed <= bound


def test_a_changefeed_handed_over_is_held_back_only_until_another_replica_takes_it() -> None:
    """Found by the balance simulator (seeds 219, 333): a replica handed a changefeed to a new replica, which was then
    SIGKILLed (or handed it on); the others were at their share, and the one with room held its bids back for two
    lease durations."""
    free = shards.Seen("", 1.0, 0.5, transitions=3)  # released at epoch 3 by us, not taken since
    taken = shards.Seen("m4", 15.0, 20.0, transitions=4)  # taken by m4, which has since gone silent
    passed_on = shards.Seen("", 1.0, 0.5, transitions=5)  # taken since, and released again by its taker
    assert shards.held_back("m3", until=30.0, released=3, now=10.0, seen=free)
    assert not shards.held_back("m3", until=30.0, released=3, now=10.0, seen=taken)
    assert not shards.held_back("m3", until=30.0, released=3, now=10.0, seen=passed_on)
    assert not shards.held_back("m3", until=30.0, released=3, now=31.0, seen=free)
    assert shards.held_back("m3", 30.0, 3, 10.0, taken, mutants={"handed-over-held-back-long"})
    assert shards.hold_back(retry=2.0, duration=15.0) == 6.0  # a short replica bids within one retry period
    assert shards.hold_back(2.0, 15.0, {"handed-over-held-back-long"}) == 30.0


def test_counts_leave_out_lapsed_members_and_their_changefeeds() -> None:
    members = {"cfmm-a": shards.Seen("a", 15.0, 1.0), "cfmm-b": shards.Seen("b", 15.0, 16.0)}
    cfs = {"x": shards.Seen("a", 15.0, 1.0), "y": shards.Seen("b", 15.0, 16.0), "z": None}
    assert shards.counts("me", 2, members, cfs) == {"me": 2, "a": 1}
    assert shards.counts("me", 2, members, cfs, {"balancer-ignores-lapse"}) == {"me": 2, "a": 1, "b": 1}


def test_a_lapse_counts_from_what_the_watch_saw() -> None:
    seen = shards.Seen("gone", 15.0, 16.0)
    assert shards.lapsed(seen, first_look=0.0)
    assert not shards.lapsed(seen, 0.0, {"lapse-counted-from-first-bid"})
    assert not shards.lapsed(shards.Seen("gone", 15.0, 3.0), first_look=2.0)
    assert shards.lapsed(shards.Seen("", 15.0, 0.0), first_look=0.0)  # released


def test_a_replica_at_floor_leaves_a_freed_lease_to_one_below_it_for_a_while() -> None:
    """Found by the balance simulator (seed 11368): 8 changefeeds over 7 replicas; the one handed over for the replica
    at 0 was taken by one at 1 (then at the ceiling, with the short one still short: it handed it over again), and
    the two took turns for ever."""
    assert shards.may_bid(0, 8, 7, others_short=True, free_for=0.5, grace=4.0)  # itself short: at once
    assert not shards.may_bid(1, 8, 7, others_short=True, free_for=0.5, grace=4.0)  # at floor: leave it
    assert shards.may_bid(1, 8, 7, others_short=True, free_for=5.0, grace=4.0)  # nobody short took it: take it
    assert shards.may_bid(1, 8, 7, others_short=False, free_for=0.5, grace=4.0)
    assert shards.may_bid(1, 8, 7, others_short=True, free_for=0.5, grace=4.0, mutants={"bid-past-a-shortfall"})


def test_no_handoff_for_the_shortfall_of_a_member_whose_renewals_stopped() -> None:
    """Found by the balance simulator (seed 838): a survivor took a SIGKILLed replica's lapsed Lease and, the dead
    replica's member Lease not lapsed yet, handed it straight back for that replica's shortfall."""
    counts = {"m1": 3, "m3": 3, "m4": 0}  # share of 9 over 3: (3, 3)... m4 is dead
    counts4 = {"m1": 3, "m2": 2, "m3": 3, "m4": 0}  # 9 over 4: (2, 3), m4 short
    assert shards.hand_over("m1", counts4, 9, ["cf8"]) == ["cf8"]
    assert shards.hand_over("m1", counts4, 9, ["cf8"], late={"m4"}) == []
    assert shards.hand_over("m1", counts4, 9, ["cf8"], free=2) == []  # two free Leases will fill it
    assert shards.hand_over("m1", counts, 9, ["cf8"]) == []
