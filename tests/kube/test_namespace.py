"""A namespace being deleted (controller/kube/namespace.py): how the maintainer tells, and what it releases."""

from __future__ import annotations

import asyncio

import pytest

from controller.apiserver import ApiServerHandle
from controller.kube import namespace as nsmod
from controller.kube.client import RESOURCES, ApiError, Client, Config
from controller.model.states import API_VERSION, CHANGEFEED_FINALIZER, DISPATCHER_FINALIZER, TABLE_FINALIZER, Kind
from tests.kube.test_informer_relist import namespace

HOLD = "cfm.test/hold"  # someone else's finalizer: never ours to release


def obj(kind: str, name: str, spec: dict[str, object], finalizers: list[str]) -> dict[str, object]:
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": name, "finalizers": finalizers}, "spec": spec}


async def fill(client: Client, ns: str) -> None:
    res = RESOURCES
    await client.create(res[Kind.CHANGEFEED], ns, obj("Changefeed", "cf", {}, [CHANGEFEED_FINALIZER]))
    await client.create(res[Kind.TABLE], ns, obj("Table", "t1", {"changefeed": "cf", "tableID": 1}, [TABLE_FINALIZER]))
    spec = {
        "changefeed": "cf",
        "span": "s1",
        "capture": "c0",
        "tableID": 1,
        "startKey": "00",
        "endKey": "ff",
        "epoch": 1,
        "startTs": 1,
    }
    await client.create(res[Kind.DISPATCHER], ns, obj("Dispatcher", "d1", spec, [DISPATCHER_FINALIZER, HOLD]))


async def marked(client: Client, ns: str, objects: tuple[tuple[Kind, str], ...], within: float = 30.0) -> None:
    """Poll until every one of ``objects`` has its deletionTimestamp."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        found = [await client.get(RESOURCES[kind], ns, name) for kind, name in objects]
        if all(o["metadata"].get("deletionTimestamp") for o in found):
            return
        assert asyncio.get_running_loop().time() < deadline, f"not marked for deletion within {within:g}s"
        await asyncio.sleep(0.1)


def test_a_live_namespace_is_not_terminating_and_nothing_is_stored(api_server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            assert not await nsmod.terminating(client, ns)
            leases, _ = await client.list(nsmod.LEASES, ns)
            assert leases == [], "the probe is a dry run"

    asyncio.run(scenario())


def test_in_a_terminating_namespace_our_finalizers_go_and_no_one_elses(api_server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            await fill(client, ns)
            await client.request("delete", "DELETE", f"/api/v1/namespaces/{ns}")
            assert await nsmod.terminating(client, ns)

            # The namespace controller marks them deleting a moment later (about 5 s, as a real cluster's).
            await marked(client, ns, ((Kind.CHANGEFEED, "cf"), (Kind.TABLE, "t1"), (Kind.DISPATCHER, "d1")))
            assert await nsmod.release_finalizers(client, ns, deleting_only=True) == 3
            for kind, name in ((Kind.CHANGEFEED, "cf"), (Kind.TABLE, "t1")):
                with pytest.raises(ApiError, match="404 NotFound"):
                    await client.get(RESOURCES[kind], ns, name)
            d1 = await client.get(RESOURCES[Kind.DISPATCHER], ns, "d1")
            assert d1["metadata"]["finalizers"] == [HOLD]

    asyncio.run(scenario())


def test_on_stop_even_what_is_not_yet_deleting_is_released(api_server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            await fill(client, ns)
            assert await nsmod.release_finalizers(client, ns, deleting_only=True) == 0
            assert await nsmod.release_finalizers(client, ns, deleting_only=False) == 3
            d1 = await client.get(RESOURCES[Kind.DISPATCHER], ns, "d1")
            assert d1["metadata"]["finalizers"] == [HOLD]

    asyncio.run(scenario())
