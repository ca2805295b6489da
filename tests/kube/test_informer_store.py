"""The informer's cache: ordering by resourceVersion, tombstones, and capture liveness on our own clock."""

from __future__ import annotations

import time
from typing import Any

from controller.kube.liveness import LEASE
from controller.kube.store import Store
from controller.model.records import Capture
from controller.model.states import Kind, SpanState
from controller.sim.index_check import verify

CAPTURE = {
    "apiVersion": "cdc.maintainer.dev/v1alpha1",
    "kind": "Capture",
    "metadata": {"name": "c0", "namespace": "default", "uid": "u", "resourceVersion": "5"},
    "spec": {},
}


def lease(rv: int, renew: str, duration: int = 10) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "capture-c0", "namespace": "default", "resourceVersion": str(rv)},
        "spec": {"holderIdentity": "c0", "leaseDurationSeconds": duration, "renewTime": renew},
    }


def age(s: Store, lease_name: str, seconds: float) -> None:
    """Make ``lease_name``'s renewTime look unchanged for ``seconds`` of a current view."""
    renew, _ = s.leases.silence.seen[lease_name]
    s.leases.silence.seen[lease_name] = (renew, s.leases.view.reading(time.monotonic()) - seconds)


def test_older_event_never_overwrites_and_tombstone_blocks_resurrection() -> None:
    s = Store()
    assert s.put("Capture", CAPTURE)
    older = {**CAPTURE, "metadata": {**CAPTURE["metadata"], "resourceVersion": "4"}}
    assert not s.put("Capture", older)
    s.remove("Capture", "c0", 6)
    assert not s.put("Capture", CAPTURE)  # rv 5 <= tombstone 6
    assert s.all(Kind.CAPTURE) == {}


def test_capture_liveness_uses_our_clock_not_the_holders() -> None:
    s = Store()
    s.put("Capture", CAPTURE)
    # The capture's clock is an hour behind: its renewTime looks stale, but we just saw it change.
    s.put(LEASE, lease(6, "2020-01-01T00:00:00.000000Z"))
    rec = s.record(Kind.CAPTURE, "c0")
    assert isinstance(rec, Capture)
    assert rec.alive(time.time())
    assert not rec.alive(time.time() + 11)  # unless it changes again within the lease duration
    # A renewal (renewTime changed) moves our observation forward; the same renewTime does not.
    age(s, "capture-c0", 30.0)
    s.put(LEASE, lease(7, "2020-01-01T00:00:00.000000Z"))  # another write, same renewTime
    stale = s.record(Kind.CAPTURE, "c0")
    assert isinstance(stale, Capture)
    assert not stale.alive(time.time())
    s.put(LEASE, lease(8, "2020-01-01T00:00:02.000000Z"))
    fresh = s.record(Kind.CAPTURE, "c0")
    assert isinstance(fresh, Capture)
    assert fresh.alive(time.time())


def test_silence_counts_only_while_the_lease_view_is_current() -> None:
    s = Store()
    s.put("Capture", CAPTURE)
    s.put(LEASE, lease(6, "2020-01-01T00:00:00.000000Z"))
    s.leases.view.heard(time.monotonic())
    age(s, "capture-c0", 8.0)
    s.leases.view.broken(time.monotonic())  # the Lease stream broke: the API is unreachable
    before = s.record(Kind.CAPTURE, "c0")
    time.sleep(0.05)
    after = s.record(Kind.CAPTURE, "c0")
    assert isinstance(before, Capture)
    assert isinstance(after, Capture)
    assert after.renew_time is not None
    assert before.renew_time is not None
    assert after.renew_time >= before.renew_time + 0.04  # silence frozen: renew_time follows our clock
    assert after.alive(time.time())


def test_lease_holder_and_version_and_leases_without_a_capture() -> None:
    s = Store()
    s.put("Capture", CAPTURE)
    held = lease(6, "2020-01-01T00:00:00.000000Z")
    s.put(LEASE, held)
    rec = s.captures()["c0"]
    assert (rec.lease_taken, rec.lease_version, rec.deleting) == (False, "6", False)
    taken = {**held, "metadata": {**held["metadata"], "resourceVersion": "9"}}
    taken["spec"] = {**held["spec"], "holderIdentity": ""}
    s.put(LEASE, taken)
    rec = s.captures()["c0"]
    assert (rec.lease_taken, rec.lease_version, rec.alive(time.time())) == (True, "9", False)
    # The Lease of a capture whose Capture object is gone: a record marked deleting, never scheduled on.
    orphan = {**held, "metadata": {**held["metadata"], "name": "capture-c9"}}
    orphan["spec"] = {**held["spec"], "holderIdentity": "c9"}
    s.put(LEASE, orphan)
    s.put(LEASE, {**held, "metadata": {**held["metadata"], "name": "cfm-feed"}})  # a maintainer's Lease
    got = s.captures()
    assert sorted(got) == ["c0", "c9"]
    assert (got["c9"].deleting, got["c9"].lease_taken, got["c9"].alive(time.time())) == (True, False, False)


def _span(name: str, rv: int, cf: str = "cf", state: str = "Replicating") -> dict[str, Any]:
    from controller.model import resources as conv
    from controller.model.keys import KeyRange
    from controller.model.records import Span
    from controller.model.states import SpanState

    span = Span(
        name=name,
        changefeed=cf,
        table_id=1,
        key_range=KeyRange.of_table(1),
        state=SpanState(state),
        capture="c0",
        resource_version=str(rv),
        uid=f"u-{name}",
    )
    return conv.to_resource(span)


def test_records_only_and_routed_to_their_changefeeds_index() -> None:
    """Spans are kept as records (no raw object beside them) and in the index of their changefeed."""
    s = Store()
    assert s.put("Span", _span("a", 3))
    assert s.last_change == {"cf"}
    assert "Span" not in s.objects  # the raw object is dropped once converted
    assert s.indexes["cf"].spans["a"].state == "Replicating"
    assert s.put("Span", _span("a", 4, state="Absent"))
    assert s.indexes["cf"].by_state[SpanState.ABSENT] == {"a"}
    s.remove("Span", "a", 5)
    assert s.last_change == {"cf"}
    assert "cf" not in s.indexes  # an index with nothing left goes
    s.replace_all("Span", [_span("b", 7, cf="other")])
    assert set(s.indexes) == {"other"}
    assert verify(s.indexes["other"]) == []


def test_a_live_captures_lease_renewal_wakes_no_changefeed() -> None:
    """Lease renewals of a live capture change nothing a decision acts on now (Decision.next_due follows
    when it would run out): they must not wake every changefeed's loop. A new Lease, a new holder, or the
    renewal of a Lease that ran out on our clock do."""
    s = Store()
    s.put("Capture", CAPTURE)
    assert s.last_change is None
    s.put(LEASE, lease(6, "2020-01-01T00:00:00.000000Z"))
    assert s.last_change is None  # new
    s.put(LEASE, lease(7, "2020-01-01T00:00:02.000000Z"))
    assert s.last_change == set()  # a renewal within the duration
    age(s, "capture-c0", 30.0)
    s.put(LEASE, lease(8, "2020-01-01T00:00:04.000000Z"))
    assert s.last_change is None  # it had run out on our clock: alive again
    maintainer = lease(9, "2020-01-01T00:00:00.000000Z")
    maintainer["metadata"]["name"] = "cfm-cf"
    s.put(LEASE, maintainer)
    assert s.last_change == set()  # a maintainer's own Lease


def _reported(rv: int, renew: str, checkpoint: int, at: float, changefeed: str = "cf") -> dict[str, Any]:
    from controller.model import resources as conv
    from controller.model.progress import PROGRESS_ANNOTATION, Progress, ProgressEntry
    from controller.model.states import Mode

    entry = ProgressEntry(changefeed=changefeed, mode=Mode.DEFAULT, checkpoint_ts=checkpoint, dispatchers=1, digest="d")
    report = Progress(incarnation="i1", at=at, entries=(entry,))
    obj = lease(rv, renew)
    obj["metadata"]["annotations"] = {PROGRESS_ANNOTATION: conv.progress_to_json(report)}
    return obj


def test_a_lease_renewal_with_a_new_progress_report_wakes_the_changefeeds_it_names() -> None:
    """A capture's progress report rides on its Lease renewals: a report whose entries changed may move the
    checkpoint of the changefeeds it names, so it wakes those (and only those); a report that only says it
    was made later wakes nobody; a Lease taken (holder cleared) wakes every changefeed."""
    s = Store()
    s.put("Capture", CAPTURE)
    s.put(LEASE, _reported(6, "2020-01-01T00:00:00.000000Z", checkpoint=100, at=1.0))
    assert s.last_change is None  # new
    s.put(LEASE, _reported(7, "2020-01-01T00:00:02.000000Z", checkpoint=100, at=3.0))
    assert s.last_change == set()  # same entries, made later
    s.put(LEASE, _reported(8, "2020-01-01T00:00:04.000000Z", checkpoint=150, at=5.0))
    assert s.last_change == {"cf"}
    s.put(LEASE, _reported(9, "2020-01-01T00:00:06.000000Z", checkpoint=150, at=7.0, changefeed="other"))
    assert s.last_change == {"cf", "other"}  # cf's entry went, other's came
    rec = s.captures()["c0"]
    assert rec.progress is not None
    assert [e.changefeed for e in rec.progress.entries] == ["other"]
    taken = _reported(10, "2020-01-01T00:00:06.000000Z", checkpoint=150, at=7.0, changefeed="other")
    taken["spec"]["holderIdentity"] = ""
    s.put(LEASE, taken)
    assert s.last_change is None
    assert s.captures()["c0"].lease_taken


def test_a_paged_list_never_puts_back_an_older_version_or_drops_a_newer_object() -> None:
    """Between the pages of a LIST (snapshot at rv 10), write-throughs of the maintainer's own writes land:
    a page must not put the older listed version back over them, and the end of the LIST must not drop an
    object created after the snapshot (the watch from rv 10 re-delivers both, but meanwhile the cache would
    be behind what the maintainer itself wrote)."""
    s = Store()
    listing = s.begin_listing("Span")
    s.list_page("Span", [_span("a", 8)], listing)
    assert s.put("Span", _span("b", 12, state="Absent"))  # our write, after the snapshot
    assert s.put("Span", _span("c", 13))  # created after the snapshot
    s.list_page("Span", [_span("b", 9)], listing)
    s.end_listing("Span", listing, 10)
    assert sorted(s.records["Span"]) == ["a", "b", "c"]
    assert s.records["Span"]["b"].resource_version == "12"
    s.replace_all("Span", [_span("a", 20)])  # one whole LIST at rv 20: b and c are gone
    assert sorted(s.records["Span"]) == ["a"]


def _bad_span(name: str, changefeed: str, rv: int) -> dict[str, Any]:
    """A Span that cannot be converted (its key range is not hex), labelled and specced with ``changefeed``."""
    return {
        "apiVersion": "cdc.maintainer.dev/v1alpha1",
        "kind": "Span",
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": f"u-{name}",
            "resourceVersion": str(rv),
            "labels": {"cdc.maintainer.dev/changefeed": changefeed},
        },
        "spec": {"changefeed": changefeed, "tableId": 1, "startKey": "zz", "endKey": "zz", "mode": "default"},
    }


def test_a_shards_invalid_objects_go_with_the_shard() -> None:
    """A sharded cache drops a changefeed's records when it gives the changefeed up; the objects of that
    changefeed that could not be converted went on being held (and their resourceVersions consulted) for good.
    They go with the shard now, and a shard's LIST forgets those of its changefeed it no longer names."""
    s = Store(shards={"a", "b"})
    assert s.put("Span", _bad_span("a-1", "a", 5))
    assert s.put("Span", _bad_span("a-2", "a", 6))
    assert s.put("Span", _bad_span("b-1", "b", 7))
    assert set(s.invalid["Span"]) == {"a-1", "a-2", "b-1"}
    s.untrack("a")
    assert set(s.invalid["Span"]) == {"b-1"}
    s.track("a")
    assert s.put("Span", _bad_span("a-1", "a", 8))
    listing = s.begin_listing("Span", "b")
    s.list_page("Span", [], listing)
    s.end_listing("Span", listing, 9)
    assert set(s.invalid["Span"]) == {"a-1"}  # b's LIST did not name b-1; a's are not its to judge


def _now_stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())


def test_a_capture_lease_deleted_by_hand_counts_as_held_until_it_would_have_run_out() -> None:
    """A person deletes a running capture's Lease. The capture delivers until its next renewal finds it gone
    (or its renew deadline); the maintainer took the missing Lease for one released and let the capture's
    dispatchers go at once, so their spans could be placed elsewhere while it still ran them. The last Lease
    seen now stands for it: the capture is not alive (never scheduled on) but not taken either, and it is
    expired (its dispatchers may be released after a fence) only once a lease duration passed unrenewed."""
    s = Store()
    s.put("Capture", CAPTURE)
    s.put(LEASE, lease(6, _now_stamp()))
    s.remove(LEASE, "capture-c0", 7)
    rec = s.record(Kind.CAPTURE, "c0")
    assert isinstance(rec, Capture)
    now = time.time()
    assert not rec.alive(now)
    assert rec.deleting
    assert not rec.lease_taken
    assert not rec.expired(now)
    s.remove(LEASE, "capture-c0", 8)  # a second removal (the watch's DELETED after a forget) changes nothing
    age(s, "capture-c0", 11.0)
    rec = s.record(Kind.CAPTURE, "c0")
    assert isinstance(rec, Capture)
    assert not rec.lease_taken
    assert rec.expired(time.time())
    # The capture's next process makes a new Lease: the stand-in goes.
    s.put(LEASE, lease(9, _now_stamp()))
    rec = s.record(Kind.CAPTURE, "c0")
    assert isinstance(rec, Capture)
    assert rec.alive(time.time())
    assert not rec.deleting


def test_a_capture_lease_released_then_deleted_is_taken_at_once() -> None:
    """A graceful stop empties the holder after stopping every dispatcher: nothing to wait for."""
    s = Store()
    s.put("Capture", CAPTURE)
    released = lease(6, _now_stamp())
    released["spec"]["holderIdentity"] = ""
    s.put(LEASE, released)
    s.remove(LEASE, "capture-c0", 7)
    rec = s.record(Kind.CAPTURE, "c0")
    assert isinstance(rec, Capture)
    assert rec.lease_taken
    assert not rec.alive(time.time())


def test_a_capture_lease_missing_from_a_relist_or_never_seen_is_waited_for() -> None:
    """The same when the Lease is missing from a relist (the DELETED event was missed), and for a maintainer
    that started after the deletion: the capture counts as renewed when it was first seen without a Lease,
    for the default duration."""
    s = Store()
    s.put("Capture", CAPTURE)
    s.put(LEASE, lease(6, _now_stamp()))
    s.replace_all(LEASE, [])
    rec = s.record(Kind.CAPTURE, "c0")
    assert isinstance(rec, Capture)
    assert not rec.lease_taken
    assert not rec.expired(time.time())

    fresh = Store()
    fresh.put("Capture", CAPTURE)
    rec = fresh.record(Kind.CAPTURE, "c0")
    assert isinstance(rec, Capture)
    assert rec.deleting
    assert not rec.lease_taken
    assert not rec.expired(time.time())
    age(fresh, "capture-c0", rec.lease_duration + 1)
    rec = fresh.record(Kind.CAPTURE, "c0")
    assert isinstance(rec, Capture)
    assert rec.expired(time.time())
    # The Capture goes: what stood for its Lease is forgotten once it has long run out.
    fresh.remove("Capture", "c0", 9)
    assert "c0" in fresh.captures()
    age(fresh, "capture-c0", 11 * rec.lease_duration + 1)
    assert "c0" not in fresh.captures()
    assert "capture-c0" not in fresh.leases.silence.seen


def test_a_capture_whose_object_and_lease_are_both_deleted_is_still_waited_for() -> None:
    """The Capture object deleted (its process still running and closing its dispatchers), then its Lease, or
    the other way round: the stand-in for the Lease still says when its dispatchers may go. Without it the
    capture vanished from the view, which counts as fenced, and its dispatchers went at once."""
    for order in (("Capture", LEASE), (LEASE, "Capture")):
        s = Store()
        s.put("Capture", CAPTURE)
        s.put(LEASE, lease(6, _now_stamp()))
        for kind in order:
            s.remove(kind, "capture-c0" if kind == LEASE else "c0", 7)
        rec = s.captures().get("c0")
        assert isinstance(rec, Capture), order
        assert rec.deleting
        assert not rec.lease_taken
        assert not rec.expired(time.time())
        age(s, "capture-c0", 11.0)
        rec = s.captures()["c0"]
        assert rec.expired(time.time())
        age(s, "capture-c0", 11 * 10.0 + 1)  # long run out: forgotten
        assert "c0" not in s.captures()
        assert "capture-c0" not in s.leases.silence.seen


def test_an_invalid_object_belongs_to_the_shard_its_label_names() -> None:
    """A shard's LIST and watch select by the changefeed label: an invalid object labelled a but naming b in its
    spec is a's, and goes with a's shard."""
    s = Store(shards={"a", "b"})
    bad = _bad_span("x", "a", 5)
    bad["spec"]["changefeed"] = "b"
    assert s.put("Span", bad)
    s.untrack("a")
    assert "x" not in s.invalid["Span"]


def test_our_delete_takes_the_object_out_of_the_view_at_once_and_nothing_older_brings_it_back() -> None:
    """Issue 36: a Delete of ours answered 200 (a Status, no resourceVersion) or 404 took nothing out of the view
    (``remove(rv=0)`` returned early over the cached version), so a deleted Split parent stayed in it until the
    watch said DELETED, and a repair acted on it. ``gone`` removes it now; its uid is buried, so neither a stale
    watch event (any resourceVersion) nor a page of a LIST begun before the delete puts it back."""
    s = Store()
    assert s.put("Span", _span("parent", 5))
    listing = s.begin_listing("Span")  # a relist under way, its snapshot from before the delete
    s.gone("Span", "parent", "u-parent")
    assert "parent" not in s.records["Span"]
    assert s.last_change == {"cf"}
    assert not s.put("Span", _span("parent", 7, state="Absent"))  # a write older than the delete, delivered late
    s.list_page("Span", [_span("parent", 6)], listing)
    s.end_listing("Span", listing, 6)
    assert "parent" not in s.records.get("Span", {})
    # The DELETED event of that uid ends the burial; a new incarnation of the name enters as usual.
    s.remove("Span", "parent", 9, "u-parent")
    assert s.dead["Span"] == {}
    new = _span("parent", 11)
    new["metadata"]["uid"] = "u-parent-2"
    assert s.put("Span", new)


def test_a_list_begun_after_our_delete_ends_its_burial() -> None:
    s = Store()
    assert s.put("Span", _span("a", 5))
    s.gone("Span", "a", "u-a")
    assert "a" in s.dead["Span"]
    s.replace_all("Span", [])  # a LIST begun after the delete cannot show it
    assert s.dead["Span"] == {}


def test_our_delete_of_an_old_incarnation_keeps_the_newer_one_cached() -> None:
    s = Store()
    newer = _span("a", 8)
    newer["metadata"]["uid"] = "u-a-2"
    assert s.put("Span", newer)
    s.gone("Span", "a", "u-a")  # a Delete preconditioned on the first incarnation, answered 404
    assert s.records["Span"]["a"].uid == "u-a-2"
    old = _span("a", 9)  # the first incarnation's late event (uid u-a): buried
    assert not s.put("Span", old)
    # A Delete with no uid that found the name gone: whatever is cached goes.
    s.gone("Span", "a")
    assert "a" not in s.records["Span"]
    assert not s.put("Span", {**newer, "metadata": {**newer["metadata"], "resourceVersion": "10"}})
