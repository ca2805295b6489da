"""The informer's cache: ordering by resourceVersion, tombstones, and capture liveness on our own clock."""

from __future__ import annotations

import time
from typing import Any

from controller.kube.informer import LEASE, Store
from controller.model.records import Capture
from controller.model.states import Kind

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
    renew, _ = s.silence.seen[lease_name]
    s.silence.seen[lease_name] = (renew, s.lease_view.reading(time.monotonic()) - seconds)


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
    s.lease_view.heard(time.monotonic())
    age(s, "capture-c0", 8.0)
    s.lease_view.broken(time.monotonic())  # the Lease stream broke: the API is unreachable
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
