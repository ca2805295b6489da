"""The forced teardown's plan (controller/cli/teardown.py): it proves nothing runs before it releases anything."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from controller.cli import commands
from controller.cli import teardown as forced
from controller.cli.errors import Failed
from controller.kube.client import ApiError, without_finalizer
from controller.model.resources import format_time
from controller.model.states import CHANGEFEED_FINALIZER, DISPATCHER_FINALIZER, TABLE_FINALIZER

NOW = 1_800_000_000.0
JSON = dict[str, Any]


def changefeed(deleting: bool = True) -> JSON:
    meta: JSON = {"name": "demo", "finalizers": [CHANGEFEED_FINALIZER], "resourceVersion": "5"}
    if deleting:
        meta["deletionTimestamp"] = format_time(NOW - 30)
    return {"metadata": meta, "spec": {}}


def lease(name: str, holder: str, renewed_ago: float, duration: int = 15) -> JSON:
    return {
        "metadata": {"name": name, "resourceVersion": "7"},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": duration,
            "renewTime": format_time(NOW - renewed_ago, micro=True),
        },
    }


def dispatcher(name: str, capture: str, changefeed: str = "demo", deleting: bool = False) -> JSON:
    meta: JSON = {"name": name, "uid": f"u-{name}", "finalizers": [DISPATCHER_FINALIZER], "resourceVersion": "3"}
    if deleting:
        meta["deletionTimestamp"] = format_time(NOW - 5)
    return {"metadata": meta, "spec": {"changefeed": changefeed, "capture": capture}}


def table(name: str, changefeed: str = "demo", finalizer: bool = True) -> JSON:
    meta: JSON = {"name": name, "finalizers": [TABLE_FINALIZER] if finalizer else [], "resourceVersion": "2"}
    return {
        "apiVersion": "cdc.maintainer.dev/v1alpha1",
        "kind": "Table",
        "metadata": meta,
        "spec": {"changefeed": changefeed, "tableID": 1},
    }


def test_a_changefeed_not_being_deleted_is_refused() -> None:
    p = forced.plan(changefeed(deleting=False), [], [], [], NOW)
    assert p.blockers
    assert "not being deleted" in p.blockers[0]
    assert (p.fences, p.dispatchers, p.tables, p.release_changefeed) == ((), (), (), False)


def test_a_live_maintainer_or_capture_blocks_it() -> None:
    ds = [dispatcher("d1", "c0"), dispatcher("d2", "c1")]
    live_maintainer = [lease("cfm-demo", "m-1", 3), lease("capture-c0", "c0", 100), lease("capture-c1", "c1", 100)]
    p = forced.plan(changefeed(), ds, [], live_maintainer, NOW)
    assert [b.split(" is alive")[0] for b in p.blockers] == ["the maintainer of changefeed demo"]
    live_capture = [lease("cfm-demo", "m-1", 100), lease("capture-c0", "c0", 2), lease("capture-c1", "", 2)]
    p = forced.plan(changefeed(), ds, [], live_capture, NOW)
    assert len(p.blockers) == 1
    assert p.blockers[0].startswith("capture c0, which holds 1 dispatcher(s) of it,")
    assert (p.fences, p.dispatchers) == ((), ()), "nothing is planned while anything runs"


def test_with_everything_lapsed_it_fences_then_releases() -> None:
    ds = [dispatcher("d1", "c0"), dispatcher("d2", "c1", deleting=True), dispatcher("x", "c2", changefeed="other")]
    leases = [
        lease("cfm-demo", "m-1", 16),
        lease("capture-c0", "c0", 40),
        lease("capture-c1", "", 1),  # released on a graceful stop: nothing to take
        lease("capture-c2", "c2", 1),  # alive, but holds nothing of demo
    ]
    tables = [table("t1"), table("t2", finalizer=False), table("t3", changefeed="other")]
    p = forced.plan(changefeed(), ds, tables, leases, NOW)
    assert p.blockers == ()
    assert [f.name for f in p.fences] == ["capture-c0", "cfm-demo"]
    assert p.dispatchers == (("d1", "u-d1", False), ("d2", "u-d2", True))
    assert p.tables == (("t1", False),)
    assert p.release_changefeed


def test_the_fence_and_the_release_carry_their_preconditions() -> None:
    body = forced.fenced_lease(lease("capture-c0", "c0", 40))
    assert body["spec"]["holderIdentity"] == ""
    assert body["metadata"]["resourceVersion"] == "7"
    patch = without_finalizer(dispatcher("d1", "c0"), DISPATCHER_FINALIZER)
    assert patch == {"metadata": {"finalizers": [], "resourceVersion": "3"}}
    assert without_finalizer(table("t", finalizer=False), TABLE_FINALIZER) is None


def test_a_detached_table_counts_no_span() -> None:
    status = forced.detached_status(table("t1"))["status"]
    assert status["state"] == "Detached"
    assert status["spans"] == {"absent": 0, "scheduling": 0, "replicating": 0, "removing": 0, "invalid": 0}


def test_a_table_that_does_not_convert_is_still_detached() -> None:
    broken = table("t1")
    broken["spec"]["tableID"] = "not a number"
    status = forced.detached_status(broken)["status"]
    assert status["state"] == "Detached"
    assert status["spans"]["replicating"] == 0


def namespace(terminating: bool) -> JSON:
    meta: JSON = {"name": "team"}
    if terminating:
        meta["deletionTimestamp"] = format_time(NOW - 1)
    return {"metadata": meta, "status": {"phase": "Terminating" if terminating else "Active"}}


def named(name: str, deleting: bool) -> JSON:
    cf = changefeed(deleting)
    cf["metadata"]["name"] = name
    return cf


def test_in_a_terminating_namespace_unmarked_changefeeds_are_waited_for() -> None:
    """Issue 36: the namespace controller marks the Changefeeds a few seconds after the namespace's DELETE."""
    cfs = [named("b", deleting=False), named("a", deleting=False)]
    waiting = forced.awaiting_marks(cfs, None, namespace(terminating=True))
    assert waiting == (
        "namespace team is being deleted; its namespace controller has not yet marked changefeeds a, b for deletion"
    )
    assert forced.awaiting_marks(cfs, "b", namespace(terminating=True)).endswith("marked changefeed b for deletion")
    # One marked, one not: the namespace goes only once both are released, so the other is waited for too.
    cfs = [named("a", deleting=True), named("b", deleting=False)]
    assert forced.awaiting_marks(cfs, None, namespace(terminating=True)).endswith("changefeed b for deletion")
    assert forced.awaiting_marks(cfs, "a", namespace(terminating=True)) == ""


def test_nothing_is_waited_for_outside_a_terminating_namespace_or_once_all_are_marked() -> None:
    unmarked = [named("a", deleting=False)]
    assert forced.awaiting_marks(unmarked, None, namespace(terminating=False)) == ""
    assert forced.awaiting_marks(unmarked, None, None) == ""  # the Namespace could not be read
    assert forced.awaiting_marks([named("a", deleting=True)], None, namespace(terminating=True)) == ""
    assert forced.awaiting_marks([], None, namespace(terminating=True)) == ""  # nothing will ever be marked
    assert forced.awaiting_marks(unmarked, "other", namespace(terminating=True)) == ""


def test_taking_a_lease_deleted_since_it_was_read_is_not_a_failure() -> None:
    """The take carries the Lease as read (uid included), so one deleted since is refused with 409 (a Lease PUT to
    a missing name would create it): the command reads it again, finds it gone and goes on, as after a 404; a
    409 whose Lease is still there (renewed) fails the command."""

    class Client:
        def __init__(self, exists: bool) -> None:
            self.exists = exists
            self.puts: list[JSON] = []

        async def replace(self, res: Any, ns: str, name: str, body: JSON) -> JSON:
            self.puts.append(body)
            raise ApiError(409, "Conflict", "Precondition failed: UID in precondition: u1, UID in object meta: ")

        async def get(self, res: Any, ns: str, name: str) -> JSON:
            if not self.exists:
                raise ApiError(404, "NotFound", "not found")
            return lease(name, "c0", 1.0)

    class Session:
        namespace = "ns"

        def __init__(self, client: Client) -> None:
            self.client = client

        def errors(self, what: str) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    raw = lease("capture-c0", "c0", 60.0)
    raw["metadata"]["uid"] = "u1"
    state = forced.LeaseState("capture-c0", "c0", 60.0, 15.0, "7")
    plan = forced.Plan("demo", fences=(state,))
    gone = Client(exists=False)
    asyncio.run(commands._force(Session(gone), plan, {"leases/capture-c0": raw}))  # type: ignore[arg-type]
    assert gone.puts[0]["metadata"]["uid"] == "u1"
    with pytest.raises(Failed, match="changed since it was read"):
        asyncio.run(commands._force(Session(Client(exists=True)), plan, {"leases/capture-c0": raw}))  # type: ignore[arg-type]
