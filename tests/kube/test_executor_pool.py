"""The executor runs a decision's chains through a pool of workers, never a task per chain, in order, and
paces each write (controller/kube/executor.py, controller/process/pacing.py)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from controller.engine import intents as I
from controller.engine.maintainer import Decision, Memory
from controller.kube.client import Client
from controller.kube.executor import Executor
from controller.kube.store import Store, StoreCache
from controller.model import resources as conv
from controller.model.keys import KeyRange
from controller.model.records import Span
from controller.model.states import SpanState
from controller.process.pacing import Pacer


def span(i: int) -> Span:
    return Span(
        name=f"s{i:04d}",
        changefeed="cf",
        table_id=1,
        key_range=KeyRange.of_table(1),
        start_ts=100,
        state=SpanState.ABSENT,
        checkpoint_ts=100,
        resource_version="1",
    )


class SlowClient:
    """Status writes that answer after a few turns of the loop; counts what runs at once."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.most_tasks = 0

    async def patch(self, res: Any, namespace: str, name: str, patch: Any, sub: str = "") -> Any:
        self.order.append(name)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.most_tasks = max(self.most_tasks, len(asyncio.all_tasks()))
        for _ in range(3):
            await asyncio.sleep(0)
        self.in_flight -= 1
        obj = conv.to_resource(span(int(name[1:])))
        obj["metadata"]["resourceVersion"] = "2"
        return obj


def test_a_decision_of_a_thousand_chains_runs_on_a_pool_of_workers() -> None:
    """1,000 chains at a concurrency of 8: at most 8 writes in flight, no more than a handful of tasks (a task
    per chain started 1,000 in one turn of the loop), every chain written once, started in the decision's
    order, and every response written through into the cache."""
    client = SlowClient()
    cache = StoreCache(Store())
    executor = Executor(cast(Client, client), cache, "ns", concurrency=8, pacer=Pacer())
    chains = tuple(I.Chain((I.WriteStatus(span(i)),), "test") for i in range(1000))

    out = asyncio.run(executor.apply(Decision(chains, Memory(epoch=1, identity="m"))))
    assert (out.chains, out.failed, out.writes) == (1000, 0, 1000)
    assert client.most_in_flight == 8
    assert client.most_tasks <= 8 + 1  # the workers and asyncio.run's main task
    assert client.order == [f"s{i:04d}" for i in range(1000)]
    assert len(cache.store.records["Span"]) == 1000


def test_failed_chains_are_counted_by_the_pool() -> None:
    """A chain that fails counts once in ``failed``; the worker goes on with the next chain."""

    class Failing(SlowClient):
        async def patch(self, res: Any, namespace: str, name: str, patch: Any, sub: str = "") -> Any:
            if int(name[1:]) % 3 == 0:
                from controller.kube.client import ApiError

                raise ApiError(409, "Conflict", "stale")
            return await super().patch(res, namespace, name, patch, sub)

    client = Failing()
    executor = Executor(cast(Client, client), StoreCache(Store()), "ns", concurrency=4)
    chains = tuple(I.Chain((I.WriteStatus(span(i)),), "test") for i in range(30))
    out = asyncio.run(executor.apply(Decision(chains, Memory(epoch=1, identity="m"))))
    assert (out.failed, out.writes, dict(out.errors)) == (10, 20, {"Conflict": 10})
    assert executor.errors == {"Conflict": 10}
