"""Issue 37: an event the informer fails to apply is never skipped in silence.

The watch's resourceVersion used to move past an event before the event was applied, and an exception while
applying it (from the store, the index, ``on_change``) was taken for a connection reset: the stream resumed *after*
the event, which was lost until something else changed its object, and nothing said so (for Captures and Leases,
which resume rather than relist, for good). Now the resourceVersion moves only once the event is applied; a failure
to apply is logged with its traceback, counted (``apply_failures``, the maintainer's
``informer_apply_failures_total``), and the stream relists (``relists``): the record arrives with the LIST.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest

from controller.apiserver import ApiServerHandle
from controller.kube.client import RESOURCES, Client, Config
from controller.kube.informer import Change, Informer
from controller.kube.objects import ObjectInformer
from controller.model.states import API_VERSION, Kind
from tests.kube.conftest import namespace, until

JSON = dict[str, Any]


def capture(name: str) -> JSON:
    return {"apiVersion": API_VERSION, "kind": "Capture", "metadata": {"name": name}, "spec": {}}


def span(name: str) -> JSON:
    spec = {"changefeed": "cf", "tableID": 1, "startKey": "00", "endKey": "ff"}
    return {"apiVersion": API_VERSION, "kind": "Span", "metadata": {"name": name}, "spec": spec}


def fail_once(informer: Informer, kind: str, name: str, error: Exception) -> list[str]:
    """The store's ``put`` of ``name`` (of ``kind``) raises ``error`` the first time; the names it failed for."""
    failed: list[str] = []
    put = informer.store.put

    def flaky_put(k: str, obj: JSON, *args: Any, **kw: Any) -> bool:
        if k == kind and obj["metadata"]["name"] == name and not failed:
            failed.append(name)
            raise error
        return put(k, obj, *args, **kw)

    informer.store.put = flaky_put  # type: ignore[method-assign]
    return failed


@pytest.mark.parametrize("error", [RuntimeError("a bug"), OSError("not the network"), ValueError("a bad value")])
def test_a_capture_event_that_fails_to_apply_arrives_with_a_relist(
    api_server: ApiServerHandle, error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    """Captures resume after a broken watch (they are not record kinds): before, the event was lost for good. An
    ``OSError`` or a ``ValueError`` raised by the store is no transport error either."""

    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client, "apply")
            informer = Informer(client, ns)
            await informer.start()
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                assert informer.relists[Kind.CAPTURE.value] == 0
                failed = fail_once(informer, Kind.CAPTURE.value, "c1", error)
                await client.create(RESOURCES[Kind.CAPTURE], ns, capture("c1"))
                await until(lambda: failed, "the event to fail")
                await until(lambda: "c1" in informer.store.objects.get("Capture", {}), "the Capture to arrive")
                assert informer.store.record(Kind.CAPTURE, "c1") is not None
                assert informer.apply_failures[Kind.CAPTURE.value] == 1
                assert informer.relists[Kind.CAPTURE.value] == 1
                assert sum(informer.apply_failures.values()) == 1
                healthy, why = informer.healthy()
                assert healthy, why
                # The watch runs on after the relist.
                await client.create(RESOURCES[Kind.CAPTURE], ns, capture("c2"))
                await until(lambda: "c2" in informer.store.objects.get("Capture", {}), "the watch to run again")
            finally:
                await informer.stop()

    with caplog.at_level(logging.ERROR, logger="controller.kube.informer"):
        asyncio.run(scenario())
    loud = [r for r in caplog.records if "could not apply ADDED Capture 'c1'" in r.getMessage()]
    assert len(loud) == 1, [r.getMessage() for r in caplog.records]
    assert loud[0].exc_info is not None  # with the traceback


def test_an_on_change_that_raises_relists_and_notifies_again(api_server: ApiServerHandle) -> None:
    """The record entered the store but its notification failed: the stream relists (a record kind: in doubt until
    then), and the LIST's notification (``on_change(kind, "")``) tells the maintainer to look again."""
    seen: list[tuple[str, str]] = []
    raised: list[str] = []

    def on_change(change: Change) -> None:
        if change.kind == Kind.SPAN.value and change.name == "s1" and not raised:
            raised.append(change.name)
            raise RuntimeError("a bug in on_change")
        seen.append((change.kind, change.name))

    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client, "apply")
            informer = Informer(client, ns, on_change)
            await informer.start()
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                del seen[:]
                await client.create(RESOURCES[Kind.SPAN], ns, span("s1"))
                await until(lambda: (Kind.SPAN.value, "") in seen, "the Span stream to relist and notify")
                assert raised == ["s1"]
                assert "s1" in informer.store.records[Kind.SPAN.value]
                assert informer.apply_failures == {Kind.SPAN.value: 1}
                assert informer.relists[Kind.SPAN.value] == 1
                assert informer.in_doubt("cf") == frozenset()
            finally:
                await informer.stop()

    asyncio.run(scenario())


def test_a_list_page_that_fails_to_apply_is_counted_and_listed_again(api_server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client, "apply")
            await client.create(RESOURCES[Kind.SPAN], ns, span("s1"))
            informer = Informer(client, ns)
            failed: list[int] = []
            list_page = informer.store.list_page

            def flaky(kind: str, chunk: list[JSON], listing: Any) -> None:
                if kind == Kind.SPAN.value and chunk and not failed:
                    failed.append(len(chunk))
                    raise KeyError("a bug in list_page")
                list_page(kind, chunk, listing)

            informer.store.list_page = flaky  # type: ignore[method-assign]
            await informer.start()
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                assert failed == [1]
                assert "s1" in informer.store.records[Kind.SPAN.value]
                assert informer.apply_failures == {Kind.SPAN.value: 1}
                assert informer.relists == {}  # the first LIST never ended: the next one is no relist
            finally:
                await informer.stop()

    asyncio.run(scenario())


def test_the_capture_informer_relists_an_event_it_failed_to_apply(
    api_server: ApiServerHandle, caplog: pytest.LogCaptureFixture
) -> None:
    """The capture's informer (now the shared reflector into an ``ObjectInformer``) once moved its resourceVersion past
    an event before applying it, and took a ``ValueError`` (here from ``keep``) for a network error: the watch resumed
    after the event, which was lost."""
    raised: list[str] = []

    def keep(obj: JSON) -> bool:
        if obj["metadata"]["name"] == "s1" and not raised:
            raised.append("s1")
            raise ValueError("a bug in keep")
        return True

    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client, "apply")
            informer = ObjectInformer(client, RESOURCES[Kind.SPAN], ns, keep=keep)
            task = asyncio.create_task(informer.run())
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                await client.create(RESOURCES[Kind.SPAN], ns, span("s1"))
                await until(lambda: "s1" in informer.objects, "the Span to arrive")
                assert raised == ["s1"]
                assert informer.apply_failures == 1
                assert informer.relists == 2
                await client.create(RESOURCES[Kind.SPAN], ns, span("s2"))
                await until(lambda: "s2" in informer.objects, "the watch to run again")
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    with caplog.at_level(logging.ERROR, logger="controller.kube.objects"):
        asyncio.run(scenario())
    loud = [r for r in caplog.records if r.name == "controller.kube.objects" and r.levelno == logging.ERROR]
    assert len(loud) == 1
    assert loud[0].exc_info is not None
