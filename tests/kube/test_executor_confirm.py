"""The teardown's release of a Changefeed follows a consistent read of the API (``ConfirmNoneLeft``).

The maintainer's view is one watch per kind; one kind's watch can lag behind another's, so the view that
shows nothing left of a deleted Changefeed may miss a Span a person created a moment before (simulator
seed 27541). The production executor reads the API itself (a LIST without resourceVersion, in pages),
fails the chain when something is left, and hands what it found to the informer for the next decision.
"""

from __future__ import annotations

import asyncio

from controller.apiserver import ApiServerHandle
from controller.engine import intents as I
from controller.engine.maintainer import Decision, Memory
from controller.kube.client import RESOURCES, Client, Config
from controller.kube.executor import STALE_VIEW, Executor
from controller.kube.informer import Informer
from controller.model.resources import dispatcher_from_resource, span_from_resource
from controller.model.states import API_VERSION, CHANGEFEED_FINALIZER, Kind
from tests.kube.test_informer_relist import namespace


def obj(kind: str, name: str, spec: dict[str, object], **meta: object) -> dict[str, object]:
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": name, **meta}, "spec": spec}


def release(cf: str) -> Decision:
    chain = I.Chain((I.ConfirmNoneLeft(cf), I.RemoveFinalizer(Kind.CHANGEFEED, cf, CHANGEFEED_FINALIZER)), "release")
    return Decision(chains=(chain,), memory=Memory(epoch=1, identity="m"))


def test_the_release_waits_until_a_consistent_read_finds_nothing_left(api_server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            res = RESOURCES
            await client.create(
                res[Kind.CHANGEFEED], ns, obj("Changefeed", "cf", {"startTs": 1}, finalizers=[CHANGEFEED_FINALIZER])
            )
            # Another changefeed's Spans, listed before the late one in pages of 2, are not the deleted one's.
            for i in range(3):
                spec = {"changefeed": "other", "tableID": 1, "startKey": f"0{i}", "endKey": f"0{i + 1}"}
                await client.create(res[Kind.SPAN], ns, obj("Span", f"a{i}", spec))
            deleting = await client.delete(res[Kind.CHANGEFEED], ns, "cf")
            assert deleting["metadata"]["deletionTimestamp"]
            # The informer's view: the deleting Changefeed and nothing else (its Span watch lags).
            informer = Informer(client, ns)
            informer.offer(Kind.CHANGEFEED.value, deleting)
            late = obj("Span", "late", {"changefeed": "cf", "tableID": 1, "startKey": "00", "endKey": "ff"})
            await client.create(res[Kind.SPAN], ns, late)
            executor = Executor(client, informer, ns, list_page=2)

            out = await executor.apply(release("cf"))
            assert (out.failed, out.writes, dict(out.errors)) == (1, 0, {STALE_VIEW: 1})
            assert informer.store.record(Kind.SPAN, "a0") is None  # the other changefeed's are not offered
            cf = await client.get(res[Kind.CHANGEFEED], ns, "cf")
            assert cf["metadata"]["finalizers"] == [CHANGEFEED_FINALIZER], "released with a Span left"
            found = informer.store.record(Kind.SPAN, "late")
            assert found is not None  # the next decision sees it
            assert getattr(found, "changefeed", None) == "cf"

            await client.delete(res[Kind.SPAN], ns, "late")
            out = await executor.apply(release("cf"))
            assert (out.failed, out.writes) == (0, 1)
            assert [o["metadata"]["name"] for o in (await client.list(res[Kind.CHANGEFEED], ns))[0]] == []

    asyncio.run(scenario())


def test_a_span_confirmed_gone_stops_the_chain_and_leaves_the_view(api_server: ApiServerHandle) -> None:
    """``ConfirmPresent`` (the overlap repair reads again the span it keeps, simulator seed 300908): a GET that finds
    it gone, or another incarnation, stops the chain before its writes and takes it out of the view at once; one
    still there lets the chain go on."""

    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            spec = {"changefeed": "cf", "tableID": 1, "startKey": "00", "endKey": "ff"}
            kept = await client.create(RESOURCES[Kind.SPAN], ns, obj("Span", "kept", spec))
            doomed = await client.create(RESOURCES[Kind.SPAN], ns, obj("Span", "doomed", spec))
            informer = Informer(client, ns)  # no watch: only what the executor does reaches it
            for o in (kept, doomed):
                informer.offer(Kind.SPAN.value, o)
            executor = Executor(client, informer, ns)
            kept_uid = kept["metadata"]["uid"]

            def chain() -> Decision:
                writes = (I.ConfirmPresent(Kind.SPAN, "kept", kept_uid), I.Delete(Kind.SPAN, "doomed"))
                return Decision(chains=(I.Chain(writes, "remove doomed"),), memory=Memory(epoch=1, identity="m"))

            out = await executor.apply(chain())  # still there: the chain goes on
            assert (out.failed, out.writes) == (0, 1)
            doomed = await client.create(RESOURCES[Kind.SPAN], ns, obj("Span", "doomed", spec))
            informer.offer(Kind.SPAN.value, doomed)
            await client.delete(RESOURCES[Kind.SPAN], ns, "kept")  # by a person; the view still has it
            out = await executor.apply(chain())
            assert (out.failed, out.writes, dict(out.errors)) == (1, 0, {STALE_VIEW: 1})
            assert informer.store.record(Kind.SPAN, "kept") is None
            assert await client.get(RESOURCES[Kind.SPAN], ns, "doomed")  # nothing removed on a false premise

    asyncio.run(scenario())


def test_a_create_resting_on_a_record_changed_since_the_view_does_not_land(api_server: ApiServerHandle) -> None:
    """``record_unchanged`` (simulator seed 738533): a dispatcher created from an operator's target as recorded
    before follows a GET confirming the operator unchanged. Rewritten since (a zombie maintainer's new target after
    the first was refused), the chain stops before the create and the newer record is in the view for the next
    decision; unchanged, the create lands."""

    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            spec = {"changefeed": "cf", "type": "Move", "spans": ["s1"], "target": "c1"}
            op = await client.create(RESOURCES[Kind.OPERATOR], ns, obj("SpanOperator", "mv", spec))
            informer = Informer(client, ns)  # no watch: only what the executor does reaches it
            informer.offer(Kind.OPERATOR.value, op)
            executor = Executor(client, informer, ns)
            seen = informer.store.record(Kind.OPERATOR, "mv")
            assert seen is not None
            d = obj("Dispatcher", "s1-d", {"changefeed": "cf", "span": "s1", "tableID": 1, "startKey": "00",
                                           "endKey": "ff", "capture": "c1", "startTs": 5, "epoch": 1})  # fmt: skip

            def chain() -> Decision:
                create = I.Create(dispatcher_from_resource({**d, "metadata": {"name": "s1-d", "namespace": ns}}))
                writes = (I.record_unchanged(seen), create)
                return Decision(chains=(I.Chain(writes, "Move mv AddDest"),), memory=Memory(epoch=1, identity="m"))

            await client.patch(RESOURCES[Kind.OPERATOR], ns, "mv", {"metadata": {"annotations": {"by": "a zombie"}}})
            out = await executor.apply(chain())
            assert (out.failed, out.writes, dict(out.errors)) == (1, 0, {STALE_VIEW: 1})
            assert (await client.list(RESOURCES[Kind.DISPATCHER], ns))[0] == []  # nothing created on a stale record
            newer = informer.store.record(Kind.OPERATOR, "mv")
            assert newer is not None
            assert newer.resource_version != seen.resource_version  # the next decision sees the rewrite

            seen = newer
            out = await executor.apply(chain())
            assert (out.failed, out.writes) == (0, 1)
            assert [o["metadata"]["name"] for o in (await client.list(RESOURCES[Kind.DISPATCHER], ns))[0]] == ["s1-d"]

    asyncio.run(scenario())


def test_a_span_the_view_lacks_is_read_before_it_is_taken_for_deleted(api_server: ApiServerHandle) -> None:
    """``ConfirmGone`` (simulator seed 867345: a Split took children another maintainer had created, not yet in its
    view, for deleted by hand): a GET that finds the span stops the chain before the record of its deletion and puts
    it in the view; a span really gone lets the chain go on."""

    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            spec = {"changefeed": "cf", "tableID": 1, "startKey": "00", "endKey": "ff"}
            informer = Informer(client, ns)  # no watch: only what the executor does reaches it
            executor = Executor(client, informer, ns)
            marker = {"changefeed": "cf", "tableID": 1, "startKey": "00", "endKey": "80"}

            def chain() -> Decision:
                create = I.Create(span_from_resource(obj("Span", "recorded", marker, namespace=ns)))
                writes = (I.ConfirmGone(Kind.SPAN, "child"), create)
                return Decision(chains=(I.Chain(writes, "give child up"),), memory=Memory(epoch=1, identity="m"))

            await client.create(RESOURCES[Kind.SPAN], ns, obj("Span", "child", spec))  # by another maintainer
            out = await executor.apply(chain())
            assert (out.failed, out.writes, dict(out.errors)) == (1, 0, {STALE_VIEW: 1})
            assert informer.store.record(Kind.SPAN, "child") is not None  # the next decision sees it
            assert [o["metadata"]["name"] for o in (await client.list(RESOURCES[Kind.SPAN], ns))[0]] == ["child"]

            await client.delete(RESOURCES[Kind.SPAN], ns, "child")
            out = await executor.apply(chain())
            assert (out.failed, out.writes) == (0, 1)

    asyncio.run(scenario())
