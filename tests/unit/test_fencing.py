"""Capture fencing: a lost capture's dispatchers are released only after its Lease no longer names it.

A capture that cannot renew its Lease pauses its dispatchers and resumes them in place if it gets through
again while its Lease is still its own. So "its Lease lapsed" is not enough for the maintainer to release
the finalizers of its dispatchers (which lets their spans be placed elsewhere): it must first take the Lease
(``FenceCapture``, a compare-and-swap on the version it judged lapsed), and releases only from a snapshot
showing the Lease taken. And the lapse itself is counted only on time during which the maintainer's view of
the Leases was current (``engine.liveness``).
"""

from __future__ import annotations

from dataclasses import replace

from controller.engine import intents as I
from controller.engine.liveness import Silence, ViewClock
from controller.engine.maintainer import decide
from controller.model.records import Capture, Dispatcher
from tests.unit.fixtures import (
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


def test_a_lapsed_lease_is_taken_before_any_finalizer_is_released() -> None:
    lapsed = capture("c0", alive=False, taken=False)
    dec = decide(world(table(1), lapsed, capture("c1"), A, B, DA, DB), memory())
    got = flat(dec)
    assert last_status(dec, Kind.SPAN, "a").state is SpanState.ABSENT  # its span is placed again...
    assert ("delete", "Dispatcher", "da") in got
    assert ("unfinalize", "Dispatcher", "da") not in got  # ...but its dispatcher is not released yet
    fences = [w for w in writes(dec) if isinstance(w, I.FenceCapture)]
    assert fences == [I.FenceCapture("c0", lapsed.lease_version)]
    assert [c.writes for c in dec.chains if any(isinstance(w, I.FenceCapture) for w in c.writes)] == [(fences[0],)]


def test_the_lease_is_taken_once_per_decision_however_many_dispatchers() -> None:
    d2 = replace(DB, name="db2", capture="c0", span="nope", table_id=9)
    dec = decide(world(table(1), capture("c0", alive=False, taken=False), capture("c1"), A, B, DA, DB, d2), memory())
    assert [w for w in writes(dec) if isinstance(w, I.FenceCapture)] == [I.FenceCapture("c0", "lease-c0-1")]


def test_once_the_lease_is_taken_the_finalizer_is_released() -> None:
    gone = replace(DA, deleting=True)
    dec = decide(world(table(1), capture("c0", alive=False, taken=True), capture("c1"), A, B, gone, DB), memory())
    assert ("unfinalize", "Dispatcher", "da") in flat(dec)
    assert not [w for w in writes(dec) if isinstance(w, I.FenceCapture)]


def test_a_capture_not_alive_with_a_current_lease_closes_its_own_dispatchers() -> None:
    """Its Capture object is being deleted but the process still renews: delete, never release."""
    leaving = replace(capture("c0"), deleting=True)
    dec = decide(world(table(1), leaving, capture("c1"), A, B, DA, DB), memory())
    got = flat(dec)
    assert ("delete", "Dispatcher", "da") in got
    assert ("unfinalize", "Dispatcher", "da") not in got
    assert not [w for w in writes(dec) if isinstance(w, I.FenceCapture)]


def test_a_capture_that_renews_before_the_fence_lands_keeps_its_dispatchers() -> None:
    """The fence is a compare-and-swap on the version judged lapsed: a renewal in between wins."""
    st = Store(strict=True)
    st.add(table(1, finalizers=()), capture("c0"), capture("c1"), A, B, DA, DB)
    st.add(changefeed())
    st.lost.add("c0")
    st.now += 30  # c0's Lease lapses (it paused its dispatchers)
    dec = decide(st.world(), memory())
    fence = next(c for c in dec.chains if any(isinstance(w, I.FenceCapture) for w in c.writes))
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
