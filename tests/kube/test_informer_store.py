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
