"""Capture fencing: a lost capture's dispatchers are released only after its Lease no longer names it.

A capture that cannot renew its Lease pauses its dispatchers and resumes them in place if it gets through
again while its Lease is still its own. So "its Lease lapsed" is not enough for the maintainer to release
the finalizers of its dispatchers (which lets their spans be placed elsewhere): it must first take the Lease
(``FenceCapture``, a compare-and-swap on the version it judged lapsed), in the chain of the release. A view
that shows the Lease taken already is not enough either: it may be older than the dispatcher (seed 11660), so
the release's chain writes the Lease again, with the version of that view as precondition. And the lapse
itself is counted only on time during which the maintainer's view of the Leases was current
(``engine.liveness``).
"""

from __future__ import annotations

from dataclasses import replace

from controller.engine import intents as I
from controller.engine.liveness import Silence, ViewClock
from controller.engine.maintainer import Decision, decide
from controller.engine.world import DIRECT_MUTANTS, Options
from controller.model.records import Capture, Dispatcher
from controller.model.states import DISPATCHER_FINALIZER
from tests.engine.fixtures import (
    NOW,
    Kind,
    SpanState,
    Store,
    capture,
    changefeed,
    dispatcher,
    flat,
    last_status,
    memory,
    pieces,
    span,
    table,
    world,
    writes,
)

P = pieces(1, 2)
A = span("a", key_range=P[0], capture="c0", dispatcher="da", checkpoint_ts=150)
B = span("b", key_range=P[1], capture="c1", dispatcher="db", checkpoint_ts=150)
DA = dispatcher("da", A, "c0", checkpoint_ts=150)
DB = dispatcher("db", B, "c1", checkpoint_ts=150)


def chains_with_fences(dec: Decision) -> list[tuple[I.Write, ...]]:
    return [c.writes for c in dec.chains if any(isinstance(w, I.FenceCapture) for w in c.writes)]


def test_a_lapsed_lease_is_taken_in_the_chain_that_releases_the_finalizer() -> None:
    lapsed = capture("c0", alive=False, taken=False)
    dec = decide(world(table(1), lapsed, capture("c1"), A, B, DA, DB), memory())
    assert last_status(dec, Kind.SPAN, "a").state is SpanState.ABSENT  # its span is placed again
    [chain] = chains_with_fences(dec)
    fence = I.FenceCapture("c0", lapsed.lease_version)
    release = I.RemoveFinalizer(Kind.DISPATCHER, "da", DISPATCHER_FINALIZER)
    assert chain[-3:] == (I.Delete(Kind.DISPATCHER, "da", DA.uid), fence, release)  # the take comes first


def test_every_release_carries_the_fence() -> None:
    """One fence per chain that releases (the executor writes the Lease once per decision: see
    tests/kube/test_executor_equivalence.py)."""
    d2 = replace(DB, name="db2", capture="c0", span="nope", table_id=9)
    dec = decide(world(table(1), capture("c0", alive=False, taken=False), capture("c1"), A, B, DA, DB, d2), memory())
    chains = chains_with_fences(dec)
    assert len(chains) == 2
    for chain in chains:
        i = next(i for i, w in enumerate(chain) if isinstance(w, I.FenceCapture))
        assert chain[i] == I.FenceCapture("c0", "lease-c0-1")
        assert isinstance(chain[i + 1], I.RemoveFinalizer)


def test_a_lease_already_taken_is_taken_again_before_the_release() -> None:
    """A view showing the Lease taken may be older than the dispatcher: the release still needs a fence."""
    gone = replace(DA, deleting=True)
    taken = capture("c0", alive=False, taken=True)
    dec = decide(world(table(1), taken, capture("c1"), A, B, gone, DB), memory())
    assert chains_with_fences(dec) == [
        (I.FenceCapture("c0", taken.lease_version), I.RemoveFinalizer(Kind.DISPATCHER, "da", DISPATCHER_FINALIZER))
    ]


def test_a_release_from_a_view_older_than_the_dispatcher_does_not_land() -> None:
    """Simulator seed 11660: the view shows c0's Lease taken (its process crashed, a maintainer took it), but a
    restarted process of c0 has acquired it since and runs a dispatcher created after that. The maintainer's
    Lease watch lags its Dispatcher watch; releasing the finalizer from that view would let the span be placed
    elsewhere while c0 still runs it. The fence in the release's chain fails on the newer Lease: nothing is
    released, and c0 closes the dispatcher itself."""
    assert _released_from_an_old_take(Options()) is False


def test_the_old_rule_releases_from_a_view_older_than_the_dispatcher() -> None:
    """The mutant ``release-under-an-old-take`` (the old rule: release from a view showing the Lease taken, with no
    fence of its own) releases the finalizer the test above keeps: that test is what kills it, the sweep no
    longer reaches the race (``engine.world.DIRECT_MUTANTS``)."""
    assert "release-under-an-old-take" in DIRECT_MUTANTS
    assert _released_from_an_old_take(Options(mutants=frozenset({"release-under-an-old-take"}))) is True


def _released_from_an_old_take(options: Options) -> bool:
    st = Store(strict=True)
    st.add(table(1, finalizers=()), capture("c0", alive=False, taken=True), capture("c1"), A, B, DA, DB)
    st.add(changefeed())
    st.put(replace(DA, deleting=True))
    view = st.world()  # the stale view: c0's Lease taken
    back = st.get(Kind.CAPTURE, "c0")
    assert isinstance(back, Capture)
    st.put(replace(back, lease_taken=False, renew_time=st.now, lease_version="lease-c0-acquired-again"))
    for chain in decide(view, memory(), options).chains:
        st.apply_chain(chain)
    d = st.get(Kind.DISPATCHER, "da")
    if d is None:
        return True  # its finalizer released, the dispatcher being deleted is gone while c0 runs it
    assert isinstance(d, Dispatcher)
    assert DISPATCHER_FINALIZER in d.finalizers
    assert st.aborted >= 1  # the fence failed on the newer Lease and stopped the chain
    return False


def test_a_capture_not_alive_with_a_current_lease_closes_its_own_dispatchers() -> None:
    """Its Capture object is being deleted but the process still renews: delete, never release."""
    leaving = replace(capture("c0"), deleting=True)
    dec = decide(world(table(1), leaving, capture("c1"), A, B, DA, DB), memory())
    got = flat(dec)
    assert ("delete", "Dispatcher", "da") in got
    assert ("unfinalize", "Dispatcher", "da") not in got
    assert not [w for w in writes(dec) if isinstance(w, I.FenceCapture)]


def test_the_next_decision_is_due_when_a_capture_being_deleted_runs_out() -> None:
    """A capture being deleted (or whose Lease was deleted by hand: the informer's stand-in) has its dispatchers
    released once its Lease has run out; nothing else may wake the maintainer then, so the decision says when."""
    leaving = replace(capture("c0"), deleting=True, renew_time=NOW - 10.0)  # runs out at NOW + 5
    dec = decide(world(table(1), leaving, capture("c1"), A, B, DA, DB), memory())
    assert dec.next_due == NOW + 5.0
    later = decide(world(table(1), leaving, capture("c1"), A, B, DA, DB, now=NOW + 5.0), memory())
    assert ("unfinalize", "Dispatcher", "da") in flat(later)  # what that decision does
    gone = replace(leaving, lease_taken=True)  # a Lease that names nobody has run out for good
    assert decide(world(table(1), gone, capture("c1"), A, B, DB), memory()).next_due == NOW + 15.0


def test_a_capture_that_renews_before_the_fence_lands_keeps_its_dispatchers() -> None:
    """The fence is a compare-and-swap on the version judged lapsed: a renewal in between wins."""
    st = Store(strict=True)
    st.add(table(1, finalizers=()), capture("c0"), capture("c1"), A, B, DA, DB)
    st.add(changefeed())
    st.lost.add("c0")
    st.now += 30  # c0's Lease lapses (it paused its dispatchers)
    dec = decide(st.world(), memory())
    fence = next(c for c in dec.chains if any(isinstance(w, I.FenceCapture) for w in c.writes))
    assert isinstance(fence.writes[-1], I.RemoveFinalizer)
    st.lost.discard("c0")
    st.captures_step()  # c0 gets through again first: its renewal changes the Lease version
    st.apply_chain(fence)
    c0 = st.get(Kind.CAPTURE, "c0")
    assert isinstance(c0, Capture)
    assert not c0.lease_taken
    assert st.aborted == 1
    assert isinstance(st.get(Kind.DISPATCHER, "da"), Dispatcher)


# -- the view clock ---------------------------------------------------------------------------------------


def test_view_clock_counts_only_current_time() -> None:
    c = ViewClock(fresh=5.0)
    assert c.reading(100.0) == 0.0  # nothing heard yet
    c.heard(100.0)
    assert c.reading(103.0) == 3.0
    c.heard(104.0)
    assert c.reading(120.0) == 9.0  # current until 104 + 5, then stale
    c.broken(120.0)
    c.heard(150.0)  # 30 s broken (an outage): not counted
    assert c.reading(152.0) == 11.0
    c.broken(153.0)  # the stream broke before its freshness ran out
    assert c.reading(160.0) == 12.0
    assert not c.current(160.0)


def test_view_clock_count_all_is_the_mutant() -> None:
    c = ViewClock(fresh=5.0, count_all=True)
    c.heard(100.0)
    c.broken(101.0)
    assert c.reading(131.0) == 31.0


def test_silence_resets_on_a_changed_renew_time_and_skips_outages() -> None:
    clock = ViewClock(fresh=5.0)
    s = Silence(clock)
    clock.heard(100.0)
    s.observe("capture-c0", "r1", 100.0)
    for t in range(102, 110, 2):  # the view stays current: bookmarks every 2 s
        clock.heard(float(t))
    assert s.of("capture-c0", 108.0) == 8.0
    s.observe("capture-c0", "r1", 108.0)  # the same renewTime: no renewal
    assert s.of("capture-c0", 108.0) == 8.0
    clock.broken(108.0)  # outage from 108 to 160: silence stays 8
    assert s.of("capture-c0", 160.0) == 8.0
    clock.heard(160.0)
    s.observe("capture-c0", "r2", 160.5)  # a renewal after the outage
    assert s.of("capture-c0", 161.0) == 0.5
    assert s.of("capture-c9", 161.0) is None
