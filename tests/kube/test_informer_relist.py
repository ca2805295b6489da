"""The informers relist when a resumed watch answers 200 with a single ERROR 410 Expired event.

That is how a real API server answers a watch from a compacted resourceVersion (the recorded transcript,
probes watch-too-old-rv*): no HTTP error, a stream whose first event is the ERROR, then the end of the stream.
The embedded API behaves the same since it compacts for real; its history window is made small here so that a
few writes push an informer's resourceVersion out of it while its watches are down.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.apiserver import ApiServerHandle, start_server
from controller.kube.client import EVENTS, RESOURCES, ApiError, Client, Config
from controller.kube.informer import Informer
from controller.kube.objects import ObjectInformer
from controller.model.states import API_VERSION, Kind
from tests.kube.conftest import until

CRDS = Path(__file__).resolve().parents[2] / "crds"
HISTORY = 20


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServerHandle]:
    handle = start_server(CRDS, bookmark_interval=3600, history_size=HISTORY)
    try:
        yield handle
    finally:
        handle.stop()


async def namespace(client: Client) -> str:
    ns = f"relist-{uuid.uuid4().hex[:6]}"
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    await client.request("create", "POST", "/api/v1/namespaces", body=body)
    return ns


async def compact(client: Client, ns: str) -> None:
    """Enough writes of a kind the informers do not watch to push their resourceVersions out of the window."""
    for i in range(HISTORY * 2):
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"filler-{i}"},
            "involvedObject": {"kind": "Changefeed", "name": "cf", "namespace": ns},
            "reason": "Filler",
        }
        await client.create(EVENTS, ns, event)


def span(name: str) -> dict[str, object]:
    spec = {"changefeed": "cf", "tableID": 1, "startKey": "00", "endKey": "ff"}
    return {"apiVersion": API_VERSION, "kind": "Span", "metadata": {"name": name}, "spec": spec}


def test_maintainer_informer_relists_on_an_expired_watch(server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=server.url)) as client:
            ns = await namespace(client)
            await client.create(RESOURCES[Kind.SPAN], ns, span("before"))
            informer = Informer(client, ns)
            await informer.start()
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                listed = client.requests["list"]
                await compact(client, ns)
                assert server.close_watches() >= len(informer.kinds)
                # Every watch resumes from a compacted resourceVersion, gets the ERROR 410 event, and relists.
                await until(lambda: client.requests["list"] >= listed + len(informer.kinds), "a relist of every kind")
                await client.create(RESOURCES[Kind.SPAN], ns, span("after"))
                await until(lambda: "after" in informer.store.records.get("Span", {}), "the watch to run again")
                assert "before" in informer.store.records["Span"]
                healthy, why = informer.healthy()
                assert healthy, why
            finally:
                await informer.stop()

    asyncio.run(scenario())


def test_capture_informer_relists_on_an_expired_watch(server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=server.url)) as client:
            ns = await namespace(client)
            await client.create(RESOURCES[Kind.SPAN], ns, span("before"))
            informer = ObjectInformer(client, RESOURCES[Kind.SPAN], ns)
            task = asyncio.create_task(informer.run())
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                assert informer.relists == 1
                await compact(client, ns)
                assert server.close_watches() >= 1
                await until(lambda: informer.relists == 2, "a relist after the ERROR 410 event")
                await client.create(RESOURCES[Kind.SPAN], ns, span("after"))
                await until(lambda: "after" in informer.objects, "the watch to run again")
                assert set(informer.objects) == {"before", "after"}
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    asyncio.run(scenario())


def test_plugin_operator_watch_resumes_from_a_fresh_read_on_an_expired_watch(server: ApiServerHandle) -> None:
    """``kubectl changefeed ... --wait`` follows a SpanOperator from the resourceVersion of its create; when that
    is compacted the watch answers ERROR 410 and the plugin reads the operator afresh and watches on."""
    from controller.cli.kube import Session

    async def scenario() -> None:
        async with Client(Config(url=server.url)) as client:
            ns = await namespace(client)
            spec = {"changefeed": "cf", "type": "Add", "spans": ["s1"], "target": "c1"}
            body = {"apiVersion": API_VERSION, "kind": "SpanOperator", "metadata": {"name": "op"}, "spec": spec}
            created = await client.create(RESOURCES[Kind.OPERATOR], ns, body)
            await compact(client, ns)
            updates = Session(client, ns).operator_updates("op", created, "")
            fresh = await asyncio.wait_for(anext(updates), 10)
            assert fresh["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
            status = {"status": {"phase": "Running"}}
            await client.patch(RESOURCES[Kind.OPERATOR], ns, "op", status, sub="status")
            update = await asyncio.wait_for(anext(updates), 10)
            assert update["status"]["phase"] == "Running"
            await updates.aclose()

    asyncio.run(scenario())


class FailingPages(Client):
    """The first continuation page of a Span LIST fails (a server restart mid-LIST)."""

    failed = False

    async def request(self, verb: str, method: str, path: str, **kw: object) -> dict[str, object]:  # type: ignore[override]
        if verb == "list/continue" and "/spans" in path and not self.failed:
            self.failed = True
            raise ApiError(500, "InternalError", "injected: the server restarted mid-LIST")
        return await super().request(verb, method, path, **kw)  # type: ignore[arg-type]


def test_maintainer_informer_lists_in_pages_and_watches_only_after_a_whole_list(server: ApiServerHandle) -> None:
    """The LIST comes in pages (``limit``/``continue``), each converted as it arrives; one that fails half
    way is listed again from the start, never watched from the resourceVersion of the pages it read (which
    would lose the objects of the pages it did not)."""

    async def scenario() -> None:
        async with FailingPages(Config(url=server.url)) as client:
            ns = await namespace(client)
            names = [f"s{i:02d}" for i in range(10)]
            for name in names:
                await client.create(RESOURCES[Kind.SPAN], ns, span(name))
            informer = Informer(client, ns, page_size=3)
            await informer.start()
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                assert client.failed
                assert sorted(informer.store.records.get("Span", {})) == names
                # Spans: a first LIST whose second page failed (refused before it was counted), then a whole
                # LIST again: 3 continuations after its first page; the other kinds: one page each.
                assert client.requests["list/continue"] == 3
                assert client.requests["list"] == len(informer.kinds) + 1
            finally:
                await informer.stop()

    asyncio.run(scenario())


def test_the_next_page_is_asked_for_while_the_caller_works_on_this_one(server: ApiServerHandle) -> None:
    """Found at 50,000 spans: a successor maintainer read 100,000 objects in 200 pages one after the other, the
    API server idle while the maintainer converted a page and the maintainer idle while the server encoded the
    next (about 24 s before it could bid for the Lease). The pager now asks for the next page as soon as a page
    arrives, one page ahead at most; a caller that stops early leaves no request behind."""

    async def scenario() -> None:
        async with Client(Config(url=server.url)) as client:
            ns = await namespace(client)
            for i in range(5):
                await client.create(RESOURCES[Kind.SPAN], ns, span(f"s{i}"))
            asked: list[str] = []
            original = client.request

            async def counting(verb: str, *args: object, **kw: object) -> object:
                asked.append(verb)
                return await original(verb, *args, **kw)  # type: ignore[arg-type]

            client.request = counting  # type: ignore[method-assign,assignment]
            got: list[list[str]] = []
            async for items, _rv in client.list_pages(RESOURCES[Kind.SPAN], ns, limit=2):
                got.append([o["metadata"]["name"] for o in items])
                if len(got) == 1:  # the caller is still on the first page: the second is asked for already
                    await until(lambda: asked.count("list/continue") == 1, "the second page asked for", 5.0)
                    assert asked == ["list", "list/continue"]
            assert got == [["s0", "s1"], ["s2", "s3"], ["s4"]]
            assert asked == ["list", "list/continue", "list/continue"]

            asked.clear()
            pages = client.list_pages(RESOURCES[Kind.SPAN], ns, limit=2)
            async for _items, _rv in pages:
                break
            await pages.aclose()
            for _ in range(3):
                await asyncio.sleep(0)
            left = [t for t in asyncio.all_tasks() if "list_pages" in repr(t.get_coro())]
            assert left == []  # the page asked for ahead was cancelled
            assert asked[0] == "list"

    asyncio.run(scenario())
