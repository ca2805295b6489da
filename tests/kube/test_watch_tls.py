"""A watch its reader leaves early closes its connection before the event loop ends, over TLS too (issue 36).

Over TLS a close is a shutdown exchange that takes turns of the event loop; the connection of a watch left
mid-stream is no longer tracked by the session, so closing the session did not wait for it, and a loop ended
first (``asyncio.run`` returning, as each ``kubectl changefeed ... --wait`` does) left the socket unclosed: a
ResourceWarning, an error here (``filterwarnings = error``). Plain HTTP closes at once and never showed it.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from controller.apiserver import ApiServerHandle, start_server
from controller.kube.client import LEASES, Client, Config
from tests.kube.conftest import CRDS
from tests.kube.test_informer_relist import namespace


@pytest.fixture(scope="module")
def tls_server() -> Iterator[ApiServerHandle]:
    handle = start_server(CRDS, tls=True)
    try:
        yield handle
    finally:
        handle.stop()


def lease(name: str) -> dict[str, object]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name}, "spec": {}}


@pytest.mark.parametrize("how", ["aclose", "break", "cancel"])
def test_a_watch_left_mid_stream_over_tls_leaves_no_open_socket(tls_server: ApiServerHandle, how: str) -> None:
    async def scenario() -> None:
        async with Client(Config.load(str(tls_server.kubeconfig_path))) as client:
            ns = await namespace(client)
            _, rv = await client.list(LEASES, ns)
            events = client.watch(LEASES, ns, rv, timeout_seconds=60)
            await client.create(LEASES, ns, lease("a"))
            if how == "cancel":

                async def read_for_ever() -> None:
                    async for _ev in events:
                        pass

                task = asyncio.create_task(read_for_ever())
                await asyncio.sleep(0.5)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            elif how == "break":
                async for ev in events:
                    assert ev["type"] == "ADDED"
                    break
                await events.aclose()
            else:
                assert (await anext(events))["type"] == "ADDED"
                await events.aclose()

    asyncio.run(scenario())
    gc.collect()  # an unclosed transport or socket warns here (ResourceWarning: an error under filterwarnings)
