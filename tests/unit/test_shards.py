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
    assert shards.hand_over("a", {"a": 10, "b": 10, "c": 10}, 30, ["x"]) is None  # balanced: nothing moves
    assert shards.hand_over("a", {"a": 11, "b": 10, "c": 9}, 30, ["x", "y"]) == "y"
    # 4, 4, 2 with 10 over 3: one at the ceiling gives one to the member below the floor; only the first by name.
    counts = {"a": 4, "b": 4, "c": 2}
    assert shards.hand_over("a", counts, 10, ["x"]) == "x"
    assert shards.hand_over("b", counts, 10, ["x"]) is None
    assert shards.hand_over("a", {"a": 4, "b": 3, "c": 3}, 10, ["x"]) is None  # within [3, 4]: hysteresis
    assert shards.hand_over("a", {"a": 12, "b": 0}, 12, []) is None  # nothing it may give (being deleted)
    assert shards.hand_over("z", {"a": 12}, 12, ["x"]) is None  # not a member


@given(st.integers(min_value=0, max_value=60), st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=6))
def test_repeated_handovers_converge_to_the_share(total: int, raw: list[int]) -> None:
    """Whatever the starting counts (within ``total``), handing over one at a time from whoever ``hand_over``
    names, to the least loaded member, ends balanced within as many handoffs as changefeeds are above the share."""
    counts = {f"m{i}": 0 for i in range(len(raw))}
    left = total
    for i, n in enumerate(raw):
        counts[f"m{i}"] = min(n, left)
        left -= counts[f"m{i}"]
    counts["m0"] += left  # every changefeed led by someone
    low, high = shards.share(total, len(counts))
    bound = sum(max(0, c - low) for c in counts.values())
    for _ in range(bound + 1):
        givers = [m for m in counts if shards.hand_over(m, counts, total, [f"cf{j}" for j in range(counts[m])])]
        if not givers:
            break
        assert len(givers) == 1  # never two at once for one shortfall
        taker = min(counts, key=lambda m: (counts[m], m))
        counts[givers[0]] -= 1
        counts[taker] += 1
    assert all(low <= c <= high for c in counts.values()), counts
