"""engine/balance_policy.py: one replica's balance step (bids, handoffs, and the rate limits around them), as the
runner and the balance simulator both run it."""

from __future__ import annotations

from controller.engine import balance_policy as bp
from controller.engine.shards import Seen, member_lease

DURATION, RETRY = 15.0, 2.0


def config(identity: str = "a", **kw: object) -> bp.Config:
    return bp.Config(identity=identity, started=0.0, lease_duration=DURATION, retry=RETRY, **kw)  # type: ignore[arg-type]


def member(identity: str, silent: float = 0.5) -> tuple[str, Seen]:
    return member_lease(identity), Seen(identity, DURATION, silent)


def view(
    leads: dict[str, str],
    changefeeds: int,
    members: dict[str, float] | None = None,
    me: str = "a",
    cfg: bp.Config | None = None,
    **kw: object,
) -> bp.View:
    """``leads``: changefeed -> holder (renewing); every other of the ``changefeeds`` is free (no Lease yet);
    ``members``: identity -> how long its member Lease has been silent."""
    members = {me: 0.5} if members is None else members
    cfs: dict[str, Seen | None] = {f"cf{i}": None for i in range(changefeeds)}
    cfs.update({cf: Seen(holder, DURATION, 0.5) for cf, holder in leads.items()})
    return bp.View(
        config=cfg or config(me),
        members=dict(member(m, s) for m, s in members.items()),
        changefeeds=cfs,
        leading=frozenset(cf for cf, h in leads.items() if h == me),
        **kw,  # type: ignore[arg-type]
    )


def free(n: int) -> frozenset[str]:
    return frozenset(f"cf{i}" for i in range(n))


def test_settle_no_bid_in_the_first_retry_period() -> None:
    v = view({}, 4, asking=free(4))
    assert bp.step(v, now=RETRY - 0.1).bids == ()
    assert bp.step(v, now=RETRY).bids == ("cf0", "cf1", "cf2", "cf3")  # alone, expected 1: everything
    off = view({}, 4, cfg=config(balance=False), asking=free(4))
    assert bp.step(off, now=0.0).bids == ("cf0", "cf1", "cf2", "cf3")  # not balancing: no settle


def test_warm_up_takes_the_share_of_the_replicas_expected_for_a_lease_duration() -> None:
    v = view({}, 6, cfg=config(expected_replicas=3), asking=free(6))
    assert bp.step(v, now=3.0).bids == ("cf0", "cf1")  # as if three were up
    assert len(bp.step(v, now=3.0, mutants={"warm-up-ignores-expected"}).bids) == 6
    assert len(bp.step(v, now=DURATION).bids) == 6  # warmed up, and alone
    two = view({}, 6, {"a": 0.5, "b": 0.5}, cfg=config(expected_replicas=3), asking=free(6))
    assert len(bp.step(two, now=DURATION).bids) == 3  # the two seen


def test_bids_in_flight_and_this_steps_count_against_the_share_and_max_leases() -> None:
    v = view({}, 6, {"a": 0.5, "b": 0.5}, asking=free(6))
    assert bp.step(v, now=20.0).bids == ("cf0", "cf1", "cf2")
    in_flight = view({}, 6, {"a": 0.5, "b": 0.5}, bids=frozenset({"cf5"}), asking=free(5))
    assert bp.step(in_flight, now=20.0).bids == ("cf0", "cf1")
    assert len(bp.step(in_flight, now=20.0, mutants={"bids-race-past-share"}).bids) == 5
    capped = view({}, 6, cfg=config(max_leases=1, balance=False), asking=free(6))
    assert bp.step(capped, now=0.0).bids == ("cf0",)


def test_replicas_with_room_for_one_each_bid_for_different_free_changefeeds() -> None:
    """Three changefeeds freed at once (a SIGKILLed replica's) and three replicas with room for one each: each bids
    for a different one. In one order all bid for cf0, one wins, and the last is taken three retry periods later
    (balance simulator seed 6026569, past lease duration + 5 s)."""
    holders = ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    leads = {f"cf{i}": holder for i, holder in enumerate(holders, start=3)}  # cf3..cf11; cf0..cf2 free
    members = {"a": 0.5, "b": 0.5, "c": 0.5}

    def bids(mutants: frozenset[str] = frozenset()) -> dict[str, tuple[str, ...]]:
        return {me: bp.step(view(leads, 12, members, me=me, asking=free(3)), 20.0, mutants).bids for me in "abc"}

    assert sorted(b for got in bids().values() for b in got) == ["cf0", "cf1", "cf2"]
    assert set(bids(frozenset({"bids-herd"})).values()) == {("cf0",)}


def test_no_bid_for_a_lease_renewed_by_another_nor_for_one_just_handed_over() -> None:
    v = view({"cf0": "b"}, 2, {"a": 0.5, "b": 0.5}, asking=free(2))
    assert bp.step(v, now=20.0).bids == ("cf1",)
    memory = bp.handed(bp.Memory(), "cf1", epoch=3, now=20.0, config=config())
    assert memory.handed_until["cf1"] == (20.0 + 3 * RETRY, 3)
    released = {"cf1": Seen("", 1.0, 0.5, transitions=3)}
    held = bp.View(config(), dict([member("a")]), {"cf1": released["cf1"]}, memory=memory, asking={"cf1"})
    assert bp.step(held, now=21.0).bids == ()
    assert bp.step(held, now=20.0 + 3 * RETRY).bids == ("cf1",)


def test_handoffs_wait_for_settle_and_a_lease_duration_then_look_once_per_retry() -> None:
    # a leads 4 of 4, b is up and leads nothing: a's excess (2) goes in one round.
    leads = {f"cf{i}": "a" for i in range(4)}
    v = view(leads, 4, {"a": 0.5, "b": 0.5})
    assert bp.step(v, now=RETRY + DURATION - 0.1).hand_over == ()
    d = bp.step(v, now=RETRY + DURATION)
    assert d.hand_over == ("cf3", "cf2")
    assert d.memory.handed_at == RETRY + DURATION
    assert d.next_due == RETRY + DURATION + RETRY
    # Not looked at again before next_due, whatever the counts.
    again = bp.View(**{**v.__dict__, "memory": bp.Memory(next_look=d.next_due)})
    assert bp.step(again, now=d.next_due - 0.1).hand_over == ()


def test_one_round_of_handoffs_per_two_lease_durations_and_none_while_one_is_under_way() -> None:
    leads = {f"cf{i}": "a" for i in range(4)}
    v = view(leads, 4, {"a": 0.5, "b": 0.5})
    after = bp.View(**{**v.__dict__, "memory": bp.Memory(handed_at=20.0)})
    assert bp.step(after, now=20.0 + 2 * DURATION - 0.1).hand_over == ()
    assert bp.step(after, now=20.0 + 2 * DURATION - 0.1, mutants={"rounds-unspaced"}).hand_over == ("cf3", "cf2")
    assert bp.step(after, now=20.0 + 2 * DURATION).hand_over == ("cf3", "cf2")
    handing = bp.View(**{**v.__dict__, "handing": frozenset({"cf3"})})
    assert bp.step(handing, now=40.0).hand_over == ()
    deleting = bp.View(**{**v.__dict__, "deleting": frozenset({"cf3", "cf2", "cf1"})})
    assert bp.step(deleting, now=40.0).hand_over == ("cf0",)  # a teardown is finished where it started
    off = bp.View(**{**v.__dict__, "config": config(balance=False)})
    assert bp.step(off, now=40.0).hand_over == ()


def test_a_late_member_has_no_shortfall_to_hand_over_for() -> None:
    """9 over a, b, c, d: share (2, 3); a, b and c lead 3 each, d none. d short by 2: a (the first of the most
    loaded) gives one, unless d's renewals are three retry periods overdue (SIGKILLed, its Lease not lapsed yet)."""
    leads = {f"cf{i}": "abc"[i // 3] for i in range(9)}
    members = {"a": 0.5, "b": 0.5, "c": 0.5, "d": 0.5}
    v = view(leads, 9, members)
    assert bp.counts(v) == {"a": 3, "b": 3, "c": 3, "d": 0}
    assert bp.step(v, now=40.0).hand_over == ("cf2",)
    late = view(leads, 9, {**members, "d": 3 * RETRY})
    assert bp.late(late) == {"d"}
    assert bp.step(late, now=40.0).hand_over == ()


def test_handed_over_changefeeds_held_back_are_forgotten_once_their_time_is_up() -> None:
    memory = bp.handed(bp.Memory(), "cf0", 1, now=20.0, config=config())
    v = bp.View(config(), dict([member("a")]), {"cf0": None}, memory=memory)
    assert bp.step(v, now=25.0).memory.handed_until == {"cf0": (26.0, 1)}
    assert bp.step(v, now=26.0).memory.handed_until == {}
