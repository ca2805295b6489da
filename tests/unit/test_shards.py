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
