"""Tenure (controller/process/tenure.py): what survives a step is frozen out of the collector's full passes;
garbage cycles are collected before, not frozen; a step comes every period even with no young collection."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from controller.apiserver import ApiServerHandle
from controller.capture.agent import Agent
from controller.capture.agent import Settings as CaptureSettings
from controller.kube.client import Client, Config
from controller.maintainer.runner import Maintainer, Settings
from controller.process import tenure
from controller.process.tenure import Tenure
from tests.kube.conftest import namespace, until


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    """Each test starts and ends with nothing frozen and the garbage collected (not left to a later test's
    pass, where a ResourceWarning would be blamed on it)."""
    gc.unfreeze()
    gc.collect()
    yield
    gc.unfreeze()
    gc.collect()


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


def test_a_step_freezes_what_survived_and_collects_the_garbage_cycles_first() -> None:
    t = Tenure(1.0)
    kept = [cycle() for _ in range(1000)]
    dead = cycle()
    gone = weakref.ref(dead)
    del dead
    t.promoted = 1
    t.step()
    assert gone() is None  # collected, not frozen for good
    frozen = gc.get_freeze_count()
    assert frozen >= 2000  # the kept nodes are out of every later pass
    assert t.promoted == 0
    assert t.steps == 1
    assert len(kept) == 1000


def test_records_that_replace_frozen_ones_are_frozen_on_the_period_without_a_young_collection() -> None:
    """The collector counts allocations net of deallocations: records that replace frozen ones (status writes,
    watch events) leave the count near zero, so no young collection comes while generation 0 grows (40,000
    objects between two steps while 100,000 spans were placed; the step that then visited them held the loop
    up to 99 ms). The period alone makes a step: it used to wait for a young collection."""
    records = [[i] for i in range(30000)]  # lists: always tracked by the collector
    gc.collect()
    gc.freeze()
    t = Tenure(0.01)
    young: list[int] = []

    async def main() -> None:
        collections = len(young)
        gc.callbacks.append(on_gc)
        try:
            for i in range(20000):
                records[i] = [-i]  # replaces a frozen record: one made, one freed
            assert len(young) == collections  # no young collection came
            assert len(gc.get_objects(0)) >= 20000
            task = asyncio.create_task(t.run())
            await until(lambda: t.steps >= 1, "a step on the period", timeout=5.0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            gc.callbacks.remove(on_gc)

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            young.append(info["generation"])

    asyncio.run(main())
    assert len(gc.get_objects(0)) < 1000  # what the step froze is out of every later pass
    assert gc.get_freeze_count() >= 50000


def test_the_young_collections_mark_a_step_due() -> None:
    t = Tenure(0.01)

    async def main() -> None:
        task = asyncio.create_task(t.run())
        await asyncio.sleep(0)  # its callback is in place
        assert t._on_gc in gc.callbacks
        gc.collect(1)  # as a young collection promotes survivors
        assert t.promoted >= 1
        for _ in range(100):
            await asyncio.sleep(0.01)
            if t.steps:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert t.steps >= 1
    assert gc.get_freeze_count() > 0
    assert t._on_gc not in gc.callbacks  # removed when the task ends


def test_a_full_pass_after_a_step_does_not_visit_the_frozen_objects() -> None:
    """What the step buys: a full collection's work no longer includes the frozen records."""
    t = Tenure(1.0)
    kept = [cycle() for _ in range(20000)]
    t.step()
    assert len(gc.get_objects(2)) < 20000 <= gc.get_freeze_count()
    assert len(kept) == 20000


def test_freeze_now_collects_the_young_garbage_cycles_and_freezes_the_rest() -> None:
    """What the maintainer does after each LIST page of records: fresh garbage cycles are collected, not frozen for
    good; what is alive leaves every later full pass. Not a step (the steps' figures are the period's)."""
    t = Tenure(1.0)
    kept = [cycle() for _ in range(1000)]
    dead = cycle()
    gone = weakref.ref(dead)
    del dead
    t.freeze_now()
    assert gone() is None
    assert gc.get_freeze_count() >= 2000
    assert t.steps == 0
    assert len(kept) == 1000


def test_the_maintainer_has_its_informer_freeze_each_list_page_only_with_tenure_on(server: ApiServerHandle) -> None:
    """The informer knows nothing of the collector: the runner hands it the tenure's ``freeze_now`` as what to do
    after each LIST page of records (``--gc-tenure 0``: nothing)."""

    async def main() -> None:
        async with Client(Config.load(str(server.kubeconfig_path))) as client:
            off = Maintainer(client, Settings(namespace="ns", identity="m0", gc_tenure=0))
            assert off.informer.after_page is None
            on = Maintainer(client, Settings(namespace="ns", identity="m1", gc_tenure=0.5))
            assert on.tenure is not None
            assert on.informer.after_page == on.tenure.freeze_now

    asyncio.run(main())


def test_the_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Tenure(0)


def test_the_maintainer_runs_its_steps_and_stops_them(server: ApiServerHandle) -> None:
    async def main() -> None:
        async with Client(Config.load(str(server.kubeconfig_path))) as client:
            ns = await namespace(client)
            off = Maintainer(client, Settings(namespace=ns, identity="m0", gc_tenure=0))
            assert off.tenure is None
            m = Maintainer(client, Settings(namespace=ns, identity="m1", tick=0.1, gc_tenure=0.02))
            assert m.tenure is not None
            await m.start()
            try:
                await until(lambda: m.tenure is not None and m.tenure.steps > 0, "a tenure step")
                assert gc.get_freeze_count() > 0
            finally:
                await m.stop()
            assert m.tenure._on_gc not in gc.callbacks

    asyncio.run(main())


def test_a_capture_runs_its_steps_too(server: ApiServerHandle) -> None:
    async def main() -> None:
        async with Client(Config.load(str(server.kubeconfig_path))) as client:
            ns = await namespace(client)
            assert Agent(client, CaptureSettings(name="c0", namespace=ns, gc_tenure=0)).tenure is None
            with pytest.raises(ValueError, match="gc-tenure"):
                CaptureSettings(name="c0", namespace=ns, gc_tenure=-1).check()
            agent = Agent(client, CaptureSettings(name="c1", namespace=ns, gc_tenure=0.02))
            run = asyncio.create_task(agent.run())
            try:
                await until(lambda: agent.ready()[0], "the capture registered and watching")
                gc.collect(1)  # a young collection: something promoted (an idle capture allocates little)
                await until(lambda: agent.tenure is not None and agent.tenure.steps > 0, "a capture's tenure step")
            finally:
                agent.request_stop()
                assert await run == 0
            assert agent.tenure._on_gc not in gc.callbacks

    asyncio.run(main())


def test_the_processes_step_by_default_the_classes_do_not() -> None:
    """The command lines' default is a step every 2 s; a Settings made in code (a test's, a library user's)
    freezes nothing unless asked."""
    from controller.capture import __main__ as capture_cli
    from controller.maintainer import __main__ as maintainer_cli

    assert capture_cli.parse_args(["--name", "c", "--namespace", "ns"]).gc_tenure == tenure.PERIOD == 0.5
    assert maintainer_cli.parse(["--namespace", "ns"]).gc_tenure == tenure.PERIOD == 0.5
    assert Settings(namespace="ns").gc_tenure == 0
    assert CaptureSettings(name="c", namespace="ns").gc_tenure == 0


def test_a_batch_of_young_collections_makes_a_step_due_before_the_period() -> None:
    """A step's pause is what was promoted since the last one: after BATCH young collections (each promotes at
    most about 7,700 objects) the step runs at once, however long the period, so its pause stays bounded."""

    t = Tenure(60.0)

    async def main() -> None:
        task = asyncio.create_task(t.run())
        await asyncio.sleep(0)
        try:
            for _ in range(tenure.BATCH - 1):
                gc.collect(1)
            await asyncio.sleep(0.2)
            assert t.steps == 0  # not yet: the period is a minute
            gc.collect(1)  # the BATCH-th
            await until(lambda: t.steps == 1, "a step before the period", timeout=5.0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
