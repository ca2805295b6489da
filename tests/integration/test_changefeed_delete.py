"""Deleting a Changefeed with real processes: replication stops, its objects go, its Tables stay detached.

The teardown (engine/teardown.py) holds the Changefeed by its finalizer until every dispatcher is closed
by its capture and every span and operator is deleted; a maintainer SIGKILLed half-way is followed by
one that finishes it. Runs against the embedded API, or a real cluster with ``CFM_TEST_KUBECONFIG``.
"""

from __future__ import annotations

import signal

from controller.model.states import CHANGEFEED_FINALIZER, GROUP, TABLE_FINALIZER, OpPhase, OpType
from tests.integration.harness import CHANGEFEED, Api, Snap, System, set_hooks
from tests.integration.test_failover import CAPTURES, INITIAL_TABLES, boot


def owned_by(obj: dict[str, object], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []  # type: ignore[attr-defined]
    return [(r["kind"], r["name"], r["uid"], r.get("controller")) for r in refs] == [
        ("Changefeed", CHANGEFEED, uid, True)
    ]


def test_deleting_a_changefeed_stops_replication_and_removes_its_objects(api: Api, system: System) -> None:
    watch, snap = boot(api, system, "m1")
    cf = api.get("changefeeds", CHANGEFEED)
    assert cf is not None
    assert CHANGEFEED_FINALIZER in cf["metadata"]["finalizers"]
    uid = cf["metadata"]["uid"]
    # What the maintainer made for the changefeed is owned by it (the garbage collector's backstop).
    for plural in ("spans", "dispatchers", "spanoperators"):
        for obj in api.list(plural):
            assert owned_by(obj, uid), (plural, obj["metadata"])
    assert owned_by(api.ok("GET", api.path("leases", f"cfm-{CHANGEFEED}")), uid)

    # A Move held in flight (its origin's capture does not close), then the delete.
    span = snap.spans_of(1)[0]
    target = next(c for c in CAPTURES if c != span.capture)
    set_hooks(api, system, [span.capture], hold_close="*")
    api.operator("mv", "Move", [span.name], target=target)
    watch.until(lambda s: s.operators.get("mv") is not None and s.operators["mv"].phase is OpPhase.RUNNING, "Move")
    api.delete("changefeeds", CHANGEFEED)

    def canceled(s: Snap) -> object:
        mv = s.operators.get("mv")
        if mv is None or (mv.phase, mv.status_reason) != (OpPhase.CANCELED, "ChangefeedDeleted"):
            return f"mv: {mv and (mv.phase, mv.status_reason)}"
        removes = [o for o in s.operators.values() if o.type is OpType.REMOVE and o.delete_spans]
        return bool(removes) or "no Remove yet"

    during = watch.until(canceled, "the Move canceled and the spans given to Removes", 30)
    assert during.changefeed is not None
    deleting = during.changefeed.condition("Deleting")
    assert deleting is not None
    assert deleting.status == "True", deleting
    assert deleting.message.startswith("removing "), deleting
    # Kill the maintainer half-way; its successor finishes the teardown.
    system.signal("m1", signal.SIGKILL)
    system.maintainer("m2")
    set_hooks(api, system, [span.capture], hold_close=None)

    def gone(s: Snap) -> object:
        if s.changefeed is not None:
            deleting = s.changefeed.condition("Deleting")
            return f"changefeed still there: {deleting and deleting.message}"
        left = {k: len(v) for k, v in (("spans", s.spans), ("dispatchers", s.dispatchers), ("ops", s.operators)) if v}
        return f"left: {left}" if left else True

    watch.until(gone, "the changefeed and everything it had gone", 60)
    tables = api.list("tables")
    assert sorted(t["metadata"]["name"] for t in tables) == sorted(f"t{tid}" for tid, _ in INITIAL_TABLES)
    for t in tables:
        assert TABLE_FINALIZER not in (t["metadata"].get("finalizers") or []), t["metadata"]
        assert t["status"]["state"] == "Detached", t["status"]
        assert (
            t["status"]["message"] == f"changefeed {CHANGEFEED} was deleted; this table is replicated by no changefeed"
        )
    # No capture runs anything any more, and every one of them is still up.
    for c in CAPTURES:
        assert system.procs[c].alive()

    def idle(s: Snap) -> object:
        busy = {c: (api.get("captures", c) or {}).get("status", {}).get("dispatchers") for c in CAPTURES}
        return all(n == 0 for n in busy.values()) or f"captures report dispatchers: {busy}"

    watch.until(idle, "every capture reports no dispatcher", 30)
    # A Table can now be deleted at once (no maintainer holds it), and the label the user set stays.
    api.delete("tables", "t1")
    assert api.get("tables", "t1") is None
    assert tables[0]["metadata"]["labels"] == {f"{GROUP}/changefeed": CHANGEFEED}
