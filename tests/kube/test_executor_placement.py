"""A fresh span is created already placed: the create records the placement, in the Span's annotation.

The status subresource drops a created object's status (the real API server and the embedded one alike),
so a placement written into the status of a create would be lost; the annotation
``cdc.maintainer.dev/placement`` is kept, and a Span whose status was never written is read as Scheduling
there. That saves the status write a fresh span's first placement used to need. The create is
*exclusive*: a Span of that name already there is not this chain's, and neither is its placement, so the
chain stops before it creates a dispatcher for a placement the API does not hold.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

from controller.apiserver import ApiServerHandle
from controller.engine import intents as I
from controller.engine.maintainer import Decision, Memory
from controller.kube.client import RESOURCES, Client, Config
from controller.kube.executor import Executor
from controller.kube.informer import Informer
from controller.model import resources as conv
from controller.model.keys import KeyRange
from controller.model.records import Dispatcher, Span
from controller.model.states import Kind, SpanState
from controller.sim import executor as sim_executor
from controller.sim.api import Api
from tests.kube.test_informer_relist import namespace

TABLE = KeyRange.of_table(1)


def placed(capture: str, dispatcher: str) -> Span:
    """A span as the engine creates it placed (``placement.create_placed``)."""
    return Span(
        name="s",
        changefeed="cf",
        table_id=1,
        key_range=TABLE,
        start_ts=100,
        state=SpanState.SCHEDULING,
        capture=capture,
        dispatcher=dispatcher,
        checkpoint_ts=100,
        created_capture=capture,
        created_dispatcher=dispatcher,
    )


def dispatcher_of(span: Span) -> Dispatcher:
    return Dispatcher(
        name=span.dispatcher,
        changefeed="cf",
        span=span.name,
        table_id=1,
        key_range=span.key_range,
        capture=span.capture,
        start_ts=span.start_ts,
        epoch=1,
    )


def one(*writes: I.Write) -> Decision:
    return Decision(chains=(I.Chain(writes, "test"),), memory=Memory(epoch=1, identity="m"))


def chain(span: Span, exclusive: bool = True) -> Decision:
    return one(I.Create(span, exclusive=exclusive), I.Create(dispatcher_of(span)))


def test_a_span_created_placed_reads_back_scheduling_there(api_server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            informer = Informer(client, ns)
            executor = Executor(client, informer, ns)
            span = placed("c1", "s-d1")

            out = await executor.apply(chain(span))
            assert (out.failed, out.writes) == (0, 2)
            raw = await client.get(RESOURCES[Kind.SPAN], ns, "s")
            assert "status" not in raw or not raw["status"]  # the create's status was dropped
            annotation = raw["metadata"]["annotations"][conv.PLACEMENT_ANNOTATION]
            assert conv.placement_from_json(annotation) == ("c1", "s-d1")
            for rec in (conv.span_from_resource(raw), informer.store.record(Kind.SPAN, "s")):
                assert isinstance(rec, Span)
                assert (rec.state, rec.capture, rec.dispatcher, rec.checkpoint_ts, rec.operator) == (
                    SpanState.SCHEDULING,
                    "c1",
                    "s-d1",
                    100,
                    "",
                )
            assert (await client.get(RESOURCES[Kind.DISPATCHER], ns, "s-d1"))["spec"]["capture"] == "c1"

            # Another placement of a span of that name (a deposed maintainer's, from a view without it):
            # the create finds the span there and the chain stops; no dispatcher for a placement not held.
            other = placed("c2", "s-d2")
            out = await executor.apply(chain(other))
            assert (out.failed, out.writes, dict(out.errors)) == (1, 0, {"AlreadyExists": 1})
            dispatchers = (await client.list(RESOURCES[Kind.DISPATCHER], ns))[0]
            assert [d["metadata"]["name"] for d in dispatchers] == ["s-d1"]
            # A plain create (no intent rides on it) takes AlreadyExists for success and goes on.
            out = await executor.apply(chain(other, exclusive=False))
            assert (out.failed, out.writes) == (0, 2)

            # Once the status is written, the status is the record; the annotation is history.
            done = replace(span, state=SpanState.REPLICATING, capture="c1", dispatcher="s-d1", checkpoint_ts=150)
            rv = raw["metadata"]["resourceVersion"]
            out = await executor.apply(one(I.WriteStatus(replace(done, resource_version=rv))))
            assert (out.failed, out.writes) == (0, 1)
            absent = replace(done, state=SpanState.ABSENT, capture="", dispatcher="", checkpoint_ts=150)
            rv = (await client.get(RESOURCES[Kind.SPAN], ns, "s"))["metadata"]["resourceVersion"]
            out = await executor.apply(one(I.WriteStatus(replace(absent, resource_version=rv))))
            assert (out.failed, out.writes) == (0, 1)
            rec = conv.span_from_resource(await client.get(RESOURCES[Kind.SPAN], ns, "s"))
            assert (rec.state, rec.capture, rec.dispatcher, rec.checkpoint_ts) == (SpanState.ABSENT, "", "", 150)

    asyncio.run(scenario())


def test_the_simulated_api_and_executor_follow_the_same_rules() -> None:
    """The simulator's API drops a created object's status and keeps the annotation, as the real one does; its
    executor stops a chain at an exclusive create that finds the object there."""
    api = Api(random.Random(0), lambda: 0.0)
    cache = sim_executor.Cache()
    span = placed("c1", "s-d1")
    out = sim_executor.apply(api, cache, chain(span), kill=lambda: False)
    assert out.writes == 2
    held = api.get(Kind.SPAN, "s")
    assert isinstance(held, Span)
    assert (held.state, held.capture, held.dispatcher, held.checkpoint_ts) == (SpanState.SCHEDULING, "c1", "s-d1", 100)
    assert held == replace(span, uid=held.uid, resource_version=held.resource_version, generation=1, created=0.0)

    out = sim_executor.apply(api, cache, chain(placed("c2", "s-d2")), kill=lambda: False)
    assert out.writes == 0
    assert api.get(Kind.DISPATCHER, "s-d2") is None
    out = sim_executor.apply(api, cache, chain(placed("c2", "s-d2"), exclusive=False), kill=lambda: False)
    assert out.writes == 2
    assert api.get(Kind.DISPATCHER, "s-d2") is not None


def test_a_placement_annotation_that_does_not_parse_is_no_placement() -> None:
    base = conv.to_resource(placed("c1", "s-d1"))
    del base["status"]  # as created
    assert conv.span_from_resource(base).state is SpanState.SCHEDULING
    bad = (
        "not json",
        "[]",
        '{"capture": "c1"}',
        '{"capture": "", "dispatcher": "d"}',
        '{"capture": 1, "dispatcher": "d"}',
    )
    for text in bad:
        obj = {**base, "metadata": {**base["metadata"], "annotations": {conv.PLACEMENT_ANNOTATION: text}}}
        rec = conv.span_from_resource(obj)
        assert (rec.state, rec.capture, rec.created_capture) == (None, "", ""), text
    # No annotation at all (a person's Span): not yet validated, as before.
    plain = conv.to_resource(replace(placed("c1", "s-d1"), created_capture="", created_dispatcher=""))
    del plain["status"]
    assert "annotations" not in plain["metadata"]
    assert conv.span_from_resource(plain).state is None
