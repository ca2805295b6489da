"""The maintainer's informer across a restart of the API server (``ApiServerHandle.restart``).

A real kube-apiserver's watch cache starts again at the current resourceVersion when it restarts, so every watch
the informer resumes from before the restart answers ERROR 410 Expired and each kind relists on its own; the
embedded API does the same (tests/apiserver/test_restart.py). Without that, the watches would resume and replay
what was missed, and no kind would relist.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.apiserver import ApiServerHandle, start_server
from controller.kube.client import EVENTS, RESOURCES, Client, Config
from controller.kube.informer import Informer
from controller.model.states import API_VERSION, Kind
from tests.kube.conftest import until

CRDS = Path(__file__).resolve().parents[2] / "crds"


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServerHandle]:
    # No BOOKMARKs: an informer's resourceVersions stay those of its LISTs, older than the restart.
    handle = start_server(CRDS, bookmark_interval=3600)
    try:
        yield handle
    finally:
        handle.stop()


def span(name: str) -> dict[str, object]:
    spec = {"changefeed": "cf", "tableID": 1, "startKey": "00", "endKey": "ff"}
    return {"apiVersion": API_VERSION, "kind": "Span", "metadata": {"name": name}, "spec": spec}


def test_maintainer_informer_relists_every_kind_after_a_restart_of_the_api(server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=server.url)) as client:
            ns = f"restart-{uuid.uuid4().hex[:6]}"
            await client.request("create", "POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
            await client.create(RESOURCES[Kind.SPAN], ns, span("before"))
            informer = Informer(client, ns)
            await informer.start()
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                listed = client.requests["list"]
                # A write of a kind the informer does not watch: every kind it watches was last seen before it.
                event = {
                    "apiVersion": "v1",
                    "kind": "Event",
                    "metadata": {"name": "marker"},
                    "involvedObject": {"kind": "Changefeed", "name": "cf", "namespace": ns},
                    "reason": "Marker",
                }
                await client.create(EVENTS, ns, event)
                await asyncio.wrap_future(server.restart(1.0, wait=False))
                await until(lambda: client.requests["list"] >= listed + len(informer.kinds), "a relist of every kind")
                await client.create(RESOURCES[Kind.SPAN], ns, span("after"))
                await until(lambda: "after" in informer.store.records.get("Span", {}), "the watch to run again")
                assert "before" in informer.store.records["Span"]
                healthy, why = informer.healthy()
                assert healthy, why
            finally:
                await informer.stop()

    asyncio.run(scenario())
