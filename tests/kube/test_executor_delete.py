"""Issue 36: a Delete of ours takes the object out of the maintainer's view at once, whatever the watch does.

On a real cluster a Split's parent, deleted by the maintainer (200, a Status with no resourceVersion), stayed in the
view because the executor's ``forget`` without an object became ``remove(rv=0)``, which returns early over the
cached version. The Span watch was down (an API restart), and a repair removed the Split's children as an overlap
with the parent no operator explained. Here the informer runs no watch at all: only the write-through counts."""

from __future__ import annotations

import asyncio

from controller.apiserver import ApiServerHandle
from controller.engine import intents as I
from controller.engine.maintainer import Decision, Memory
from controller.kube.client import RESOURCES, Client, Config
from controller.kube.executor import Executor
from controller.kube.informer import Informer
from controller.model import resources as conv
from controller.model.keys import KeyRange, table_key
from controller.model.records import Span
from controller.model.states import DISPATCHER_FINALIZER, Kind, SpanState
from tests.kube.test_informer_relist import namespace


def _span(ns: str, name: str, finalizers: tuple[str, ...] = ()) -> dict[str, object]:
    span = Span(
        name=name,
        namespace=ns,
        changefeed="cf",
        table_id=1,
        key_range=KeyRange(table_key(1), table_key(2)),
        state=SpanState.REPLICATING,
        finalizers=finalizers,
    )
    body = conv.to_resource(span)
    body.pop("status", None)
    return body


def test_a_delete_of_ours_leaves_the_view_at_once_and_a_stale_copy_cannot_return(api_server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            informer = Informer(client, ns)  # never started: no watch delivers anything
            executor = Executor(client, informer, ns)
            memory = Memory(epoch=1, identity="m")
            for name in ("parent", "gone-already", "held"):
                finalizers = (DISPATCHER_FINALIZER,) if name == "held" else ()
                created = await client.create(RESOURCES[Kind.SPAN], ns, _span(ns, name, finalizers))
                informer.offer(Kind.SPAN.value, created)
            stale = {n: informer.store.record(Kind.SPAN, n) for n in ("parent", "gone-already", "held")}
            await client.delete(RESOURCES[Kind.SPAN], ns, "gone-already")  # by someone else: our Delete finds 404

            def delete(name: str) -> I.Chain:
                rec = stale[name]
                assert rec is not None
                return I.Chain((I.Delete(Kind.SPAN, name, rec.uid),), f"delete {name}")

            out = await executor.apply(Decision((delete("parent"), delete("gone-already")), memory))
            assert out.failed == 0
            assert informer.store.record(Kind.SPAN, "parent") is None  # 200, a Status
            assert informer.store.record(Kind.SPAN, "gone-already") is None  # 404
            # The parent's last version, as a watch running late (or a LIST page from before) would bring it:
            late = conv.to_resource(stale["parent"])  # type: ignore[arg-type]
            late["metadata"]["resourceVersion"] = str(int(late["metadata"]["resourceVersion"]) + 1)
            informer.offer(Kind.SPAN.value, late)
            assert informer.store.record(Kind.SPAN, "parent") is None
            # A finalized object: the Delete answers the object (deletionTimestamp), which stays until released.
            out = await executor.apply(Decision((delete("held"),), memory))
            held = informer.store.record(Kind.SPAN, "held")
            assert held is not None
            assert held.deleting
            release = I.Chain((I.RemoveFinalizer(Kind.SPAN, "held", DISPATCHER_FINALIZER),), "release held")
            out = await executor.apply(Decision((release,), memory))
            assert out.failed == 0
            assert informer.store.record(Kind.SPAN, "held") is None

    asyncio.run(scenario())
