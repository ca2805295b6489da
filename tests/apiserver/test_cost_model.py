"""The storage cost model of the embedded API (controller/apiserver/cost.py, issue 25): writes wait for commits
that run one at a time and take every write waiting, so concurrent writes share commits and sequential ones
do not. Counts, not timings: how many commits ran for how many writes."""

from __future__ import annotations

import asyncio

import pytest

from controller.apiserver import start_server
from controller.apiserver.cost import Committer, CostModel
from controller.kube.client import RESOURCES, Client, Config
from controller.model import resources as conv
from controller.model.records import Table
from controller.model.states import Kind
from tests.apiserver.conftest import CRD_DIR


def test_concurrent_writes_share_a_commit() -> None:
    async def scenario() -> Committer:
        c = Committer(CostModel(latency=0.01, per_write=0.0))
        await asyncio.gather(*(c.turn() for _ in range(16)))
        return c

    c = asyncio.run(scenario())
    assert (c.commits, c.writes) == (1, 16)


def test_sequential_writes_commit_one_by_one() -> None:
    async def scenario() -> Committer:
        c = Committer(CostModel(latency=0.0, per_write=0.001))
        for _ in range(3):
            await c.turn()
        return c

    c = asyncio.run(scenario())
    assert (c.commits, c.writes) == (3, 3)


def test_writes_arriving_during_a_commit_wait_for_the_next() -> None:
    async def scenario() -> tuple[Committer, list[int]]:
        c = Committer(CostModel(latency=0.05, per_write=0.0))
        seen: list[int] = []

        async def write() -> None:
            await c.turn()
            seen.append(c.commits)

        first = asyncio.create_task(write())
        await asyncio.sleep(0.01)  # the first commit has started: these two arrive during it
        await asyncio.gather(write(), write(), first)
        return c, seen

    c, seen = asyncio.run(scenario())
    assert (c.commits, c.writes) == (2, 3)
    assert seen == [1, 2, 2]


@pytest.mark.parametrize("parallel", [1, 8])
def test_the_server_commits_every_write(parallel: int) -> None:
    """Through the server: every create and status patch waits for a commit; concurrent clients' writes
    share them. Reads do not commit."""
    handle = start_server(CRD_DIR, cost=CostModel(latency=0.005, per_write=0.0))
    try:

        async def scenario() -> None:
            async with Client(Config(url=handle.url)) as client:
                res = RESOURCES[Kind.TABLE]

                async def one(i: int) -> None:
                    body = conv.to_resource(Table(name=f"t{i}", changefeed="cf", table_id=i + 1))
                    body.pop("status", None)
                    created = await client.create(res, "default", body)
                    rv = created["metadata"]["resourceVersion"]
                    patch = {"status": {"state": "Active"}, "metadata": {"resourceVersion": rv}}
                    await client.patch(res, "default", f"t{i}", patch, sub="status")
                    await client.get(res, "default", f"t{i}")

                await asyncio.gather(*(one(i) for i in range(parallel)))

        asyncio.run(scenario())
        assert handle.commits is not None
        assert handle.commits.writes == 2 * parallel
        if parallel == 1:
            assert handle.commits.commits == 2
        else:
            assert handle.commits.commits < handle.commits.writes
    finally:
        handle.stop()


def test_no_cost_model_by_default() -> None:
    handle = start_server(CRD_DIR)
    try:
        assert handle.commits is None
    finally:
        handle.stop()


@pytest.mark.parametrize(
    "argv",
    [["--commit-latency-ms", "1"], ["--api-cost", "--commit-per-write-ms", "-1"]],
    ids=["without-api-cost", "negative"],
)
def test_bad_cost_options_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from controller.apiserver.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "--commit-" in capsys.readouterr().err


def test_a_paged_list_builds_its_snapshot_once() -> None:
    """A LIST in pages reads each page from one snapshot built at its first page (as etcd reads a range from
    the continue key), not one rebuilt and sorted for every page: at 100,000 objects that made it quadratic.
    Writes between the pages do not show in them."""
    handle = start_server(CRD_DIR)
    try:
        store = handle.store
        built = 0
        snapshot = store.snapshot

        def counting(skey: tuple[str, str], rv: int) -> dict[tuple[str, str], dict[str, object]]:
            nonlocal built
            built += 1
            return snapshot(skey, rv)

        store.snapshot = counting  # type: ignore[method-assign]

        async def scenario() -> list[str]:
            async with Client(Config(url=handle.url)) as client:
                res = RESOURCES[Kind.TABLE]
                for i in range(25):
                    body = conv.to_resource(Table(name=f"t{i:02d}", changefeed="cf", table_id=i + 1))
                    body.pop("status", None)
                    await client.create(res, "default", body)
                names: list[str] = []
                async for items, _ in client.list_pages(res, "default", limit=5):
                    names.extend(o["metadata"]["name"] for o in items)
                    if len(names) == 5:  # written after the first page: not in the LIST
                        body = conv.to_resource(Table(name="t99", changefeed="cf", table_id=99))
                        body.pop("status", None)
                        await client.create(res, "default", body)
                return names

        names = asyncio.run(scenario())
        assert names == [f"t{i:02d}" for i in range(25)]
        assert built == 1
    finally:
        handle.stop()
