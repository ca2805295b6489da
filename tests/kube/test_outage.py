"""The maintainer's side of an API outage: leadership and capture liveness across a time it was cut off.

Against the embedded API server, in-process, with a client that can be cut off (every request and watch
fails with a connection error, as when the API server is unreachable):

- leadership: the elector stops leading at its renew deadline (even when a renewal hangs), and on the API's
  return takes its term back with the same epoch if nobody else took the Lease meanwhile; if someone did, a
  new epoch;
- capture liveness: time during which the maintainer could not see the Leases is not the captures' silence,
  so a capture that renews again right after the outage keeps its Lease (and its spans).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from controller.apiserver import ApiServerHandle
from controller.kube.client import JSON, LEASES, RESOURCES, Client, Config, Resource
from controller.kube.lease import LeaderElector
from controller.maintainer.runner import Maintainer, Settings
from controller.model.resources import format_time, lease_name
from controller.model.states import API_VERSION, Kind
from tests.kube.conftest import until

CRDS = Path(__file__).resolve().parents[2] / "crds"
CF = "cf"


class CutOff(Client):
    """A client that can be cut off from the API: every request and watch then fails to connect; ``hang``
    makes requests hang instead (an API that went silent)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.down = False
        self.hang = False

    async def _gate(self) -> None:
        if self.hang:
            await asyncio.sleep(3600)
        if self.down:
            raise aiohttp.ClientConnectionError("cut off from the API server")

    async def request(self, *args: Any, **kwargs: Any) -> JSON:
        await self._gate()
        return await super().request(*args, **kwargs)

    async def watch(self, res: Resource, namespace: str, resource_version: str, **kw: Any) -> AsyncIterator[JSON]:
        await self._gate()
        async for event in super().watch(res, namespace, resource_version, **kw):
            await self._gate()
            yield event


async def namespace(client: Client) -> str:
    ns = f"outage-{uuid.uuid4().hex[:6]}"
    await client.request("create", "POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
    return ns


def config(server: ApiServerHandle) -> Config:
    return Config.load(str(server.kubeconfig_path))


def elector(client: Client, ns: str, identity: str) -> LeaderElector:
    return LeaderElector(client, ns, "cfm-cf", identity, duration=2.0, renew_deadline=1.5, retry=0.1)


def test_leadership_lapses_in_an_outage_and_comes_back_with_the_same_epoch(server: ApiServerHandle) -> None:
    async def main() -> None:
        async with CutOff(config(server)) as client:
            ns = await namespace(client)
            a = elector(client, ns, "a")
            assert await a.acquire() == 1
            lost = asyncio.Event()
            holder = asyncio.create_task(a.hold(lost))
            client.down = True
            cut = time.monotonic()
            await asyncio.wait_for(lost.wait(), 5.0)
            assert time.monotonic() - cut < 1.5 + 0.5  # stopped leading at its renew deadline
            await holder
            await asyncio.sleep(2.5)  # the API is out longer than the lease: nobody could take it
            client.down = False
            assert await asyncio.wait_for(a.acquire(), 5.0) == 1  # the same term, the same epoch
            lease = await client.get(LEASES, ns, "cfm-cf")
            assert lease["spec"]["holderIdentity"] == "a"
            assert lease["spec"]["leaseTransitions"] == 1

    asyncio.run(main())


def test_leadership_taken_during_the_outage_means_a_new_epoch(server: ApiServerHandle) -> None:
    async def main() -> None:
        async with CutOff(config(server)) as cut_off, Client(config(server)) as other:
            ns = await namespace(other)
            a = elector(cut_off, ns, "a")
            assert await a.acquire() == 1
            lost = asyncio.Event()
            holder = asyncio.create_task(a.hold(lost))
            cut_off.down = True  # a alone is cut off: b, which can reach the API, takes over once it lapses
            b = elector(other, ns, "b")
            assert await asyncio.wait_for(b.acquire(), 10.0) == 2
            await asyncio.wait_for(lost.wait(), 5.0)
            await holder
            cut_off.down = False
            assert not await a.try_acquire()  # b holds it

    asyncio.run(main())


def test_a_hung_renewal_does_not_stretch_the_term(server: ApiServerHandle) -> None:
    async def main() -> None:
        async with CutOff(config(server)) as client:
            ns = await namespace(client)
            a = elector(client, ns, "a")
            await a.acquire()
            lost = asyncio.Event()
            holder = asyncio.create_task(a.hold(lost))
            client.hang = True  # requests hang (they would time out after 30 s)
            hung = time.monotonic()
            await asyncio.wait_for(lost.wait(), 5.0)
            assert time.monotonic() - hung < 1.5 + 0.5
            await holder

    asyncio.run(main())


async def renew_capture(client: Client, ns: str, name: str, duration: int) -> None:
    """What a capture agent's renewal writes (a compare-and-swap on the Lease's resourceVersion)."""
    lease = await client.get(LEASES, ns, lease_name(name))
    lease["spec"]["renewTime"] = format_time(time.time(), micro=True)
    lease["spec"]["leaseDurationSeconds"] = duration
    await client.replace(LEASES, ns, lease_name(name), lease)


def test_an_outage_is_not_the_captures_silence(server: ApiServerHandle) -> None:
    """The maintainer is cut off longer than a capture's Lease; when the API returns the capture renews
    within a second. Before, the maintainer counted the outage as the capture's silence and took its Lease
    (then re-placed its spans) as soon as it got through; now it must not."""

    async def main() -> None:
        async with CutOff(config(server)) as client, Client(config(server)) as capture:
            ns = await namespace(capture)
            await capture.create(
                RESOURCES[Kind.CHANGEFEED],
                ns,
                {"apiVersion": API_VERSION, "kind": "Changefeed", "metadata": {"name": CF}, "spec": {}},
            )
            await capture.create(
                RESOURCES[Kind.CAPTURE],
                ns,
                {"apiVersion": API_VERSION, "kind": "Capture", "metadata": {"name": "c1"}, "spec": {}},
            )
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": lease_name("c1")},
                "spec": {"holderIdentity": "c1", "leaseDurationSeconds": 3},
            }
            await capture.create(LEASES, ns, lease)
            await renew_capture(capture, ns, "c1", 3)
            table = {
                "apiVersion": API_VERSION,
                "kind": "Table",
                "metadata": {"name": "t1"},
                "spec": {"changefeed": CF, "tableID": 1},
            }
            await capture.create(RESOURCES[Kind.TABLE], ns, table)
            fast = Settings(namespace=ns, identity="m1", tick=0.1, lease_duration=2.0, renew_deadline=1.5, retry=0.1)
            m = Maintainer(client, fast)
            await m.start()
            renewing = True

            async def capture_renews() -> None:
                while True:
                    if renewing:
                        await renew_capture(capture, ns, "c1", 3)
                    await asyncio.sleep(0.5)

            renewer = asyncio.create_task(capture_renews())
            try:
                # Spans are placed on c1 (their dispatchers stay Pending: no agent runs here).
                dispatchers = RESOURCES[Kind.DISPATCHER]
                await until(lambda: m.informer.store.records.get("Dispatcher"), "a dispatcher on c1")
                epoch = m.stats.epochs[CF]
                client.down = True  # an outage of the API: nobody gets through (the capture neither)
                renewing = False
                await asyncio.sleep(4.5)  # longer than the capture's 3 s Lease and the maintainer's deadline
                client.down = False
                await asyncio.sleep(0.5)
                renewing = True  # the capture gets through half a second after the maintainer
                await until(lambda: CF in m.leading and m.memories[CF].bootstrapped, "leading again")
                deadline = time.monotonic() + 3.0
                while time.monotonic() < deadline:
                    held = await capture.get(LEASES, ns, lease_name("c1"))
                    assert held["spec"]["holderIdentity"] == "c1", "the maintainer took a live capture's Lease"
                    await asyncio.sleep(0.1)
                assert m.stats.epochs[CF] == epoch  # and it kept its epoch
                items, _ = await capture.list(dispatchers, ns)
                assert items
                assert all(not d["metadata"].get("deletionTimestamp") for d in items)
            finally:
                renewer.cancel()
                await m.stop()

    asyncio.run(main())
