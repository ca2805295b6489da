"""The plugin's API session (controller/cli/kube.py) against the stricter embedded API: a bug it revealed would fail
on a real cluster too. The test names the real behaviour that shows the bug (the recorded transcript in
``tests/apiserver/corpus`` holds the evidence)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from controller.apiserver import start_server
from controller.kube.client import Client, Config

CRDS = Path(__file__).resolve().parents[2] / "crds"


def test_plugin_operator_watch_does_not_spin_after_an_expired_watch() -> None:
    """A watch from a compacted resourceVersion answers ERROR 410 (recorded probe watch-too-old-rv). After one,
    ``kubectl changefeed ... --wait`` read the SpanOperator again and resumed watching from the operator's own
    resourceVersion, as old as its last change, so compacted too: while the operator did not change, the plugin
    spun (about a hundred GET and watch requests a second against the API server). It must resume from a
    resourceVersion the server still has: a list's."""
    from controller.cli.kube import Session
    from controller.kube.client import EVENTS, RESOURCES
    from controller.model.states import API_VERSION, Kind

    handle = start_server(CRDS, bookmark_interval=3600, history_size=20)

    async def scenario() -> None:
        async with Client(Config(url=handle.url)) as client:
            spec = {"changefeed": "cf", "type": "Add", "spans": ["s1"], "target": "c1"}
            body = {"apiVersion": API_VERSION, "kind": "SpanOperator", "metadata": {"name": "op"}, "spec": spec}
            created = await client.create(RESOURCES[Kind.OPERATOR], "default", body)
            for i in range(40):  # push the operator's resourceVersion out of the API's history window
                event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": f"e{i}"}}
                event["involvedObject"] = {"kind": "SpanOperator", "name": "op", "namespace": "default"}
                await client.create(EVENTS, "default", event)
            seen: list[dict[str, object]] = []

            async def follow() -> None:
                async for obj in Session(client, "default").operator_updates("op", created, ""):
                    seen.append(obj)

            task = asyncio.create_task(follow())
            await asyncio.sleep(1.0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert len(seen) == 1, f"{len(seen)} re-reads of an unchanged operator in 1 s"
            assert client.requests["watch"] <= 2, dict(client.requests)

    try:
        asyncio.run(scenario())
    finally:
        handle.stop()
