"""The demo against an API without the project's CRDs (controller/demo/__main__.py), on the stricter embedded API: a
bug it revealed would fail on a real cluster too. The test names the real behaviour that shows the bug (the recorded
transcript in ``tests/apiserver/corpus`` holds the evidence)."""

from __future__ import annotations

import asyncio

from controller.apiserver import start_server
from controller.demo import __main__ as demo
from controller.kube.client import Client, Config

CRD_BASE = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def test_demo_waits_until_its_crds_are_established() -> None:
    """A CRD's resources are served only once it is Established, a moment after its create (the recorded CRD
    creates answer with no conditions at all). Against a cluster without the CRDs, the demo created them and
    applied examples/changefeed.yaml at once: 404, and the maintainer and captures it had just started failed
    the same way."""
    handle = start_server(None)  # a cluster without the project's CRDs

    async def scenario() -> None:
        async with Client(Config(url=handle.url)) as client:
            await demo.ensure_crds(client)
            for path in sorted((demo.ROOT / "crds").glob("*.yaml")):
                name = path.stem + ".cdc.maintainer.dev"
                crd = await client.request("get", "GET", f"{CRD_BASE}/{name}")
                conditions = (crd.get("status") or {}).get("conditions") or []
                assert any(c["type"] == "Established" and c["status"] == "True" for c in conditions), name
            assert await demo.apply_file(client, "default", demo.ROOT / "examples" / "changefeed.yaml")

    try:
        asyncio.run(scenario())
    finally:
        handle.stop()
