"""The informer's cache: ordering by resourceVersion, tombstones, and capture liveness on our own clock."""

from __future__ import annotations

import time
from typing import Any

from controller.kube.informer import LEASE, Store
from controller.model.records import Capture
from controller.model.states import Kind, SpanState

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
    s.lease_seen["capture-c0"] = (s.lease_seen["capture-c0"][0], time.time() - 30)
    s.put(LEASE, lease(7, "2020-01-01T00:00:00.000000Z"))  # another write, same renewTime
    stale = s.record(Kind.CAPTURE, "c0")
    assert isinstance(stale, Capture)
    assert not stale.alive(time.time())
    s.put(LEASE, lease(8, "2020-01-01T00:00:02.000000Z"))
    fresh = s.record(Kind.CAPTURE, "c0")
    assert isinstance(fresh, Capture)
    assert fresh.alive(time.time())


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
    assert s.indexes["other"].verify() == []


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
    s.lease_seen["capture-c0"] = (s.lease_seen["capture-c0"][0], time.time() - 30)
    s.put(LEASE, lease(8, "2020-01-01T00:00:04.000000Z"))
    assert s.last_change is None  # it had run out on our clock: alive again
    maintainer = lease(9, "2020-01-01T00:00:00.000000Z")
    maintainer["metadata"]["name"] = "cfm-cf"
    s.put(LEASE, maintainer)
    assert s.last_change == set()  # a maintainer's own Lease
