"""The production executor and the simulator's interpret intents the same way (issue 24).

The crash-safety argument rests on the simulator running the production decision code *and* its write
semantics. ``controller.kube.executor`` (against the embedded API) and ``controller.sim.executor`` (against
the simulator's API) are two interpreters of ``controller.engine.intents``; this test runs the same chains
through both, from the same state and the same stale view, and fails on any difference in which chains fail
and in what the API holds afterwards. The cases are the ones where they could differ: AlreadyExists (plain
and exclusive creates), NotFound, a Delete refused for another uid, finalizer edits from a view older than
the object, a status write from a stale view, and a finalizer added to an object being deleted.

Each case builds its state with intents (through the executor under test, so its view is current), then
changes the object behind the executor's back (``behind``), as another writer would, then applies the
chain under test.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from controller.apiserver import ApiServerHandle
from controller.engine import intents as I
from controller.engine.maintainer import Decision, Memory
from controller.kube.client import LEASES, RESOURCES, ApiError, Client, Config
from controller.kube.executor import Executor
from controller.kube.informer import Informer
from controller.kube.liveness import LEASE
from controller.model import resources as conv
from controller.model.records import Capture, Record, Table
from controller.model.states import TABLE_FINALIZER, Kind
from controller.sim import executor as sim_executor
from controller.sim.api import Api
from tests.kube.test_informer_relist import namespace

OTHER = "example.com/other"  # someone else's finalizer
TABLE = Table(name="t1", changefeed="cf", table_id=1)
KIND = Kind.TABLE

#: What a case does behind the executor's back before the chain under test: nothing, add someone else's
#: finalizer (the object changes: a newer resourceVersion), delete the object, or delete and re-create it
#: (another incarnation: another uid).
BEHIND = ("nothing", "touch", "delete", "recreate")


@dataclass(frozen=True)
class Case:
    name: str
    setup: tuple[I.Write, ...]
    behind: str
    #: The chain under test, built from the record as the executor's view holds it (None: not in the view).
    chain: Callable[[Record | None], tuple[I.Write, ...]]


def status(view: Record | None) -> tuple[I.Write, ...]:
    assert isinstance(view, Table)
    return (I.WriteStatus(view.evolve(state="Active", message="from a view")),)


def delete(view: Record | None) -> tuple[I.Write, ...]:
    assert view is not None
    return (I.Delete(KIND, view.name, view.uid),)


CASES = [
    Case("create-again", (I.Create(TABLE),), "nothing", lambda v: (I.Create(TABLE),)),
    Case("create-exclusive-again", (I.Create(TABLE),), "nothing", lambda v: (I.Create(TABLE, exclusive=True),)),
    Case("delete-absent", (), "nothing", lambda v: (I.Delete(KIND, "t1", "no-such-uid"),)),
    Case("delete-gone", (I.Create(TABLE),), "delete", delete),
    Case("delete-other-incarnation", (I.Create(TABLE),), "recreate", delete),
    Case(
        "delete-other-incarnation-then-release",
        (I.Create(replace(TABLE, finalizers=(TABLE_FINALIZER,))),),
        "recreate",
        lambda v: (*delete(v), I.RemoveFinalizer(KIND, "t1", TABLE_FINALIZER)),
    ),
    Case(
        "delete-then-release",
        (I.Create(TABLE), I.AddFinalizer(KIND, "t1", TABLE_FINALIZER)),
        "nothing",
        lambda v: (*delete(v), I.RemoveFinalizer(KIND, "t1", TABLE_FINALIZER)),
    ),
    Case(
        "release-from-a-stale-view",
        (I.Create(TABLE), I.AddFinalizer(KIND, "t1", TABLE_FINALIZER)),
        "touch",
        lambda v: (I.RemoveFinalizer(KIND, "t1", TABLE_FINALIZER),),
    ),
    Case(
        "add-from-a-stale-view",
        (I.Create(TABLE),),
        "touch",
        lambda v: (I.AddFinalizer(KIND, "t1", TABLE_FINALIZER),),
    ),
    Case(
        "add-already-there",
        (I.Create(TABLE), I.AddFinalizer(KIND, "t1", TABLE_FINALIZER)),
        "nothing",
        lambda v: (I.AddFinalizer(KIND, "t1", TABLE_FINALIZER),),
    ),
    Case(
        "release-not-there",
        (I.Create(TABLE),),
        "nothing",
        lambda v: (I.RemoveFinalizer(KIND, "t1", TABLE_FINALIZER),),
    ),
    Case(
        "release-gone",
        (I.Create(TABLE), I.AddFinalizer(KIND, "t1", TABLE_FINALIZER)),
        "delete",
        lambda v: (I.RemoveFinalizer(KIND, "t1", TABLE_FINALIZER),),
    ),
    Case(
        "add-while-deleting",
        (I.Create(TABLE), I.AddFinalizer(KIND, "t1", TABLE_FINALIZER)),
        "nothing",
        lambda v: (*delete(v), I.AddFinalizer(KIND, "t1", "example.com/late")),
    ),
    Case("status-from-the-view", (I.Create(TABLE),), "nothing", status),
    Case("status-from-a-stale-view", (I.Create(TABLE),), "touch", status),
    Case(
        "create-then-status-of-another-incarnation",
        (I.Create(TABLE),),
        "recreate",
        lambda v: (I.Create(TABLE), *status(v)),
    ),
]


#: (chains that failed, what the API holds: None, or (being deleted, finalizers))
Result = tuple[int, tuple[bool, tuple[str, ...]] | None]


def one(writes: tuple[I.Write, ...]) -> Decision:
    return Decision(chains=(I.Chain(writes, "test"),), memory=Memory(epoch=1, identity="m"))


def run_kube(url: str, case: Case) -> Result:
    async def scenario() -> Result:
        async with Client(Config(url=url)) as client:
            ns = await namespace(client)
            informer = Informer(client, ns)
            executor = Executor(client, informer, ns)
            res = RESOURCES[KIND]
            if case.setup:
                assert (await executor.apply(one(case.setup))).failed == 0
            view = informer.store.record(KIND, "t1")
            if case.behind == "touch":
                obj = await client.get(res, ns, "t1")
                finalizers = [*(obj["metadata"].get("finalizers") or []), OTHER]
                await client.patch(res, ns, "t1", {"metadata": {"finalizers": finalizers}})
            elif case.behind in ("delete", "recreate"):
                await client.patch(res, ns, "t1", {"metadata": {"finalizers": None}})
                await client.delete(res, ns, "t1")
                if case.behind == "recreate":
                    body = conv.to_resource(replace(TABLE, finalizers=(TABLE_FINALIZER,)))
                    body["metadata"]["namespace"] = ns
                    await client.create(res, ns, body)
            out = await executor.apply(one(case.chain(view)))
            try:
                obj = await client.get(res, ns, "t1")
            except ApiError as exc:
                if not exc.not_found:
                    raise
                return out.failed, None
            meta = obj["metadata"]
            return out.failed, (bool(meta.get("deletionTimestamp")), tuple(meta.get("finalizers") or ()))

    return asyncio.run(scenario())


def run_sim(case: Case) -> Result:
    api = Api(random.Random(0), lambda: 0.0)
    cache = sim_executor.Cache()
    if case.setup:
        assert sim_executor.apply(api, cache, one(case.setup), kill=lambda: False).failed_chains == 0
    view = cache.objects[KIND].get("t1")
    if case.behind == "touch":
        api.add_finalizer(KIND, "t1", OTHER, faulty=False)
    elif case.behind in ("delete", "recreate"):
        cur = api.get(KIND, "t1")
        assert cur is not None
        api.patch_finalizers(KIND, "t1", (), cur.resource_version, faulty=False)
        api.delete(KIND, "t1", faulty=False)
        if case.behind == "recreate":
            api.create(replace(TABLE, finalizers=(TABLE_FINALIZER,)), faulty=False)
    out = sim_executor.apply(api, cache, one(case.chain(view)), kill=lambda: False)
    held = api.get(KIND, "t1")
    return out.failed_chains, None if held is None else (held.deleting, tuple(held.finalizers))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_both_executors_interpret_the_intents_alike(api_server: ApiServerHandle, case: Case) -> None:
    production, simulated = run_kube(api_server.url, case), run_sim(case)
    assert production == simulated, f"production {production} != simulator {simulated}"


def test_the_cases_see_both_outcomes() -> None:
    """The cases are not all alike: some chains fail, some succeed (else the comparison proves little)."""
    failed = {c.name for c in CASES if run_sim(c)[0]}
    assert failed >= {
        "create-exclusive-again",
        "delete-other-incarnation",
        "delete-other-incarnation-then-release",
        "release-from-a-stale-view",
        "add-from-a-stale-view",
        "add-while-deleting",
        "status-from-a-stale-view",
        "create-then-status-of-another-incarnation",
    }
    assert {"create-again", "delete-absent", "delete-gone", "release-gone", "status-from-the-view"}.isdisjoint(failed)


# -- fences: the Lease of a lost capture, taken in the chain that releases one of its dispatchers ------------
#
# The table stands for the dispatcher whose finalizer the chain releases. The Lease is in the view as
# ``held`` (it names the capture: lapsed) or taken (holder cleared); behind the executor's back, the capture
# renews it or a restarted process of it acquires it again (the view is then older than the Lease: seed 11660).


@dataclass(frozen=True)
class FenceCase:
    name: str
    held: bool  # the Lease names the capture in the view
    behind: bool  # the capture writes its Lease (holder: itself) after the view was read
    chains: int = 1  # chains carrying the same fence and release, in one decision


FENCE_CASES = [
    FenceCase("take-a-lapsed-lease", held=True, behind=False),
    FenceCase("take-a-taken-lease-again", held=False, behind=False),
    FenceCase("lapsed-lease-renewed-since", held=True, behind=True),
    FenceCase("taken-lease-acquired-again-since", held=False, behind=True),
    FenceCase("two-chains-one-fence", held=False, behind=False, chains=2),
]

#: (chains that failed, the Lease names the capture, the table's finalizers (None: gone), Lease writes)
FenceResult = tuple[int, bool, tuple[str, ...] | None, int]


def fence_decision(version: str, chains: int) -> Decision:
    """``chains`` chains, each releasing one table (t1, t2...) after the same fence."""
    return Decision(
        chains=tuple(
            I.Chain((I.FenceCapture("c0", version), I.RemoveFinalizer(KIND, f"t{i + 1}", TABLE_FINALIZER)), "release")
            for i in range(chains)
        ),
        memory=Memory(1, "m"),
    )


def fence_setup(chains: int) -> tuple[I.Write, ...]:
    tables = [replace(TABLE, name=f"t{i + 1}", table_id=i + 1) for i in range(chains)]
    return tuple(w for t in tables for w in (I.Create(t), I.AddFinalizer(KIND, t.name, TABLE_FINALIZER)))


def run_kube_fence(url: str, case: FenceCase) -> FenceResult:
    async def scenario() -> FenceResult:
        async with Client(Config(url=url)) as client:
            ns = await namespace(client)
            informer = Informer(client, ns)
            executor = Executor(client, informer, ns)
            assert (await executor.apply(one(fence_setup(case.chains)))).failed == 0
            lease = {
                "metadata": {"name": conv.lease_name("c0"), "namespace": ns},
                "spec": {"holderIdentity": "c0" if case.held else "", "leaseDurationSeconds": 15},
            }
            view = await client.create(LEASES, ns, lease)
            informer.offer(LEASE, view)
            if case.behind:
                renewed = {**view["spec"], "holderIdentity": "c0", "renewTime": conv.format_time(1.0, micro=True)}
                await client.replace(LEASES, ns, conv.lease_name("c0"), {**view, "spec": renewed})
            before = (await client.get(LEASES, ns, conv.lease_name("c0")))["metadata"]["resourceVersion"]
            out = await executor.apply(fence_decision(view["metadata"]["resourceVersion"], case.chains))
            after = await client.get(LEASES, ns, conv.lease_name("c0"))
            writes = 0 if after["metadata"]["resourceVersion"] == before else 1
            try:
                table = await client.get(RESOURCES[KIND], ns, "t1")
                finalizers: tuple[str, ...] | None = tuple(table["metadata"].get("finalizers") or ())
            except ApiError as exc:
                if not exc.not_found:
                    raise
                finalizers = None
            holder = after["spec"].get("holderIdentity") == "c0"
            return out.failed, holder, finalizers, writes

    return asyncio.run(scenario())


def run_sim_fence(case: FenceCase) -> FenceResult:
    api = Api(random.Random(0), lambda: 0.0)
    cache = sim_executor.Cache()
    assert sim_executor.apply(api, cache, one(fence_setup(case.chains)), kill=lambda: False).failed_chains == 0
    view = api.create_with_status(Capture(name="c0", renew_time=0.0, lease_taken=not case.held))
    cache.offer(view)
    if case.behind:
        api.write_status(view.evolve(lease_taken=False, renew_time=1.0), view.resource_version, faulty=False)
    before = api.get(Kind.CAPTURE, "c0")
    out = sim_executor.apply(api, cache, fence_decision(view.resource_version, case.chains), kill=lambda: False)
    after = api.get(Kind.CAPTURE, "c0")
    assert isinstance(before, Capture)
    assert isinstance(after, Capture)
    writes = 0 if after.resource_version == before.resource_version else 1
    table = api.get(KIND, "t1")
    return out.failed_chains, not after.lease_taken, None if table is None else tuple(table.finalizers), writes


@pytest.mark.parametrize("case", FENCE_CASES, ids=[c.name for c in FENCE_CASES])
def test_both_executors_fence_alike(api_server: ApiServerHandle, case: FenceCase) -> None:
    production, simulated = run_kube_fence(api_server.url, case), run_sim_fence(case)
    assert production == simulated, f"production {production} != simulator {simulated}"


def test_the_fence_cases_see_both_outcomes() -> None:
    got = {c.name: run_sim_fence(c) for c in FENCE_CASES}
    released = (0, False, (), 1)  # the Lease taken by one write, the finalizer released
    kept = (1, True, (TABLE_FINALIZER,), 0)  # the fence failed on the newer Lease: nothing released
    assert got["take-a-lapsed-lease"] == released
    assert got["take-a-taken-lease-again"] == released
    assert got["two-chains-one-fence"] == released  # one Lease write for both chains
    assert got["lapsed-lease-renewed-since"] == kept
    assert got["taken-lease-acquired-again-since"] == kept
