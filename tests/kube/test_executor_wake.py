"""A chain that says ``wake=False`` lands in the cache without a notification (no decision runs for it); every
other chain's write-through notifies, and so does its watch event when it is newer than the cache."""

from __future__ import annotations

import asyncio

from controller.apiserver import ApiServerHandle
from controller.engine import intents as I
from controller.engine.maintainer import Decision, Memory
from controller.kube.client import RESOURCES, Client, Config
from controller.kube.executor import Executor
from controller.kube.informer import Informer
from controller.model import resources as conv
from controller.model.records import Changefeed
from controller.model.states import Kind
from tests.kube.test_informer_relist import namespace


def test_a_quiet_chain_lands_in_the_cache_without_waking_anyone(api_server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=api_server.url)) as client:
            ns = await namespace(client)
            informer = Informer(client, ns)
            changed: list[str] = []
            informer.on_change = lambda change: changed.append(f"{change.kind}/{change.name}")
            executor = Executor(client, informer, ns)
            body = conv.to_resource(Changefeed(name="cf", start_ts=100))
            body.pop("status", None)
            body["metadata"]["namespace"] = ns
            created = await client.create(RESOURCES[Kind.CHANGEFEED], ns, body)
            cf = conv.from_resource(created)
            assert isinstance(cf, Changefeed)
            memory = Memory(epoch=1, identity="m")

            quiet = I.Chain((I.WriteStatus(cf.evolve(checkpoint_ts=150)),), "changefeed status", wake=False)
            out = await executor.apply(Decision((quiet,), memory))
            assert (out.failed, out.writes) == (0, 1)
            rec = informer.store.record(Kind.CHANGEFEED, "cf")
            assert isinstance(rec, Changefeed)
            assert rec.checkpoint_ts == 150
            assert changed == []  # and nobody told

            loud = I.Chain((I.WriteStatus(rec.evolve(checkpoint_ts=160)),), "changefeed status")
            out = await executor.apply(Decision((loud,), memory))
            assert (out.failed, out.writes) == (0, 1)
            assert changed == ["Changefeed/cf"]

    asyncio.run(scenario())
