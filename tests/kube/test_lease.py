"""Lease writes carry the uid (issue 36): a Lease PUT to a missing name creates it (the Lease strategy allows
create on update), so a renewal, release or take without the uid would bring back a Lease deleted by hand, under
its old holder and ``leaseTransitions``. With the uid the real server (and the embedded one) refuses it with 409.

The leader elector (controller/kube/lease.py): a term whose Lease was deleted is lost at once and never resumed
under its old epoch; a bid after it creates a fresh Lease above the published epoch. The executor's take of a
lost capture's Lease (controller/kube/executor.py): a Lease deleted since the decision is gone, as a 404."""

from __future__ import annotations

import asyncio
from typing import Any

from controller.apiserver import ApiServerHandle
from controller.engine import intents as I
from controller.engine.maintainer import Decision, Memory
from controller.kube.client import JSON, LEASES, RESOURCES, ApiError, Client, Config
from controller.kube.executor import Executor
from controller.kube.informer import Informer
from controller.kube.lease import LeaderElector
from controller.kube.liveness import LEASE
from controller.model import resources as conv
from controller.model.records import Table
from controller.model.states import TABLE_FINALIZER, Kind
from tests.kube.conftest import namespace


class Recording(Client):
    """A client that keeps every Lease body it PUTs."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.puts: list[JSON] = []

    async def replace(self, res: Any, namespace: str, name: str, body: JSON) -> JSON:
        if res is LEASES:
            self.puts.append(body)
        return await super().replace(res, namespace, name, body)


def elector(client: Client, ns: str, identity: str = "a") -> LeaderElector:
    return LeaderElector(client, ns, "cfm-cf", identity, duration=2.0, renew_deadline=1.5, retry=0.1)


async def missing(client: Client, ns: str, name: str = "cfm-cf") -> bool:
    try:
        await client.get(LEASES, ns, name)
    except ApiError as exc:
        if exc.not_found:
            return True
        raise
    return False


def test_renewals_and_the_release_carry_the_uid(api_server: ApiServerHandle) -> None:
    async def main() -> None:
        async with Recording(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            a = elector(client, ns)
            assert await a.acquire() == 1
            uid = (await client.get(LEASES, ns, "cfm-cf"))["metadata"]["uid"]
            lost = asyncio.Event()
            holder = asyncio.create_task(a.hold(lost))
            await asyncio.sleep(0.35)
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
            await a.release()
            assert len(client.puts) >= 3
            assert {b["metadata"].get("uid") for b in client.puts} == {uid}
            assert all(b["metadata"].get("resourceVersion") for b in client.puts)

    asyncio.run(main())


def test_a_deleted_lease_is_leadership_lost_at_once_and_not_created_again(api_server: ApiServerHandle) -> None:
    async def main() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            a = elector(client, ns)
            assert await a.acquire(floor=4) == 5
            first = await client.get(LEASES, ns, "cfm-cf")
            lost = asyncio.Event()
            holder = asyncio.create_task(a.hold(lost))
            await asyncio.sleep(0.25)
            await client.delete(LEASES, ns, "cfm-cf")
            # Lost at the next renewal (every 0.1 s), well before the 1.5 s renew deadline.
            await asyncio.wait_for(lost.wait(), 0.8)
            await holder
            assert await missing(client, ns), "a renewal created the deleted Lease again"
            await a.release()  # (a release of the lost term must not create it either)
            assert await missing(client, ns), "the release created the deleted Lease again"
            # It may bid again: a fresh Lease, with an epoch above the published one, never the old term resumed.
            assert await a.acquire(floor=5) == 6
            fresh = await client.get(LEASES, ns, "cfm-cf")
            assert fresh["metadata"]["uid"] != first["metadata"]["uid"]
            assert fresh["spec"]["leaseTransitions"] == 6

    asyncio.run(main())


def test_a_lease_created_again_in_our_name_is_not_our_term(api_server: ApiServerHandle) -> None:
    """Deleted and created again (another uid) naming this candidate with its term's transitions: not its
    term. The holder loses it; a bid does not resume it under the old epoch but raises it."""

    async def main() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            a = elector(client, ns)
            assert await a.acquire() == 1
            old = await client.get(LEASES, ns, "cfm-cf")
            lost = asyncio.Event()
            holder = asyncio.create_task(a.hold(lost))
            await asyncio.sleep(0.25)
            await client.delete(LEASES, ns, "cfm-cf")
            copy = {"metadata": {"name": "cfm-cf", "namespace": ns}, "spec": dict(old["spec"])}
            await client.create(LEASES, ns, copy)
            await asyncio.wait_for(lost.wait(), 0.8)
            await holder
            assert await a.acquire() == 2
            lease = await client.get(LEASES, ns, "cfm-cf")
            assert lease["spec"]["leaseTransitions"] == 2

    asyncio.run(main())


def test_the_take_of_a_lease_deleted_since_the_decision_does_not_create_it(api_server: ApiServerHandle) -> None:
    """The executor takes a lost capture's Lease with the body it cached (uid included): deleted since the
    decision, the take is refused (409), the Lease is gone (404) and the chain goes on, as on a 404."""

    async def main() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            informer = Informer(client, ns)
            executor = Executor(client, informer, ns)
            table = Table(name="t1", changefeed="cf", table_id=1)
            setup = (I.Create(table), I.AddFinalizer(Kind.TABLE, "t1", TABLE_FINALIZER))
            memory = Memory(epoch=1, identity="m")
            assert (await executor.apply(Decision(chains=(I.Chain(setup, "setup"),), memory=memory))).failed == 0
            body = {
                "metadata": {"name": conv.lease_name("c0"), "namespace": ns},
                "spec": {"holderIdentity": "c0", "leaseDurationSeconds": 15},
            }
            view = await client.create(LEASES, ns, body)
            informer.offer(LEASE, view)
            await client.delete(LEASES, ns, conv.lease_name("c0"))
            fence = I.FenceCapture("c0", view["metadata"]["resourceVersion"])
            release = I.RemoveFinalizer(Kind.TABLE, "t1", TABLE_FINALIZER)
            out = await executor.apply(Decision(chains=(I.Chain((fence, release), "release"),), memory=memory))
            assert out.failed == 0
            assert await missing(client, ns, conv.lease_name("c0")), "the take created the deleted Lease again"
            t1 = await client.get(RESOURCES[Kind.TABLE], ns, "t1")
            assert TABLE_FINALIZER not in (t1["metadata"].get("finalizers") or [])

    asyncio.run(main())
