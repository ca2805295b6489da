"""Issue 36: a kind whose watch broke is in doubt until it has been listed again, and it relists (not resumes).

On a real cluster the Span watch was down for 14 s across an API restart while the other kinds were back; the
maintainer decided for 1.8 s on a Span view that still held a deleted Split parent, and a repair removed the Split's
children. The informer now says which kinds are in doubt (``in_doubt``: ``World.stale``), and the engine's rules that
remove anything wait for them. Leases and Captures resume as before (their liveness has its own clock)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from controller.kube.client import LEASES, RESOURCES, Resource
from controller.kube.informer import Informer
from controller.model.states import Kind
from tests.kube.conftest import until

JSON = dict[str, Any]


class FlakyClient:
    """LISTs answer at once (the second LIST of Spans only once ``release`` is set); the first watch of Spans breaks
    (a connection reset) once ``breaking`` is set; every other watch stays open and quiet."""

    def __init__(self) -> None:
        self.lists: dict[str, int] = {}
        self.watches: dict[str, list[str]] = {}
        self.breaking = asyncio.Event()
        self.release = asyncio.Event()
        self.last_success = time.monotonic()  # what ``Informer.healthy`` reads: the API answered just now

    async def list_pages(
        self, res: Resource, namespace: str, label_selector: str = "", **_: object
    ) -> AsyncIterator[tuple[list[JSON], str]]:
        n = self.lists[res.kind] = self.lists.get(res.kind, 0) + 1
        if res.kind == "Span" and n > 1:
            await self.release.wait()
        yield [], "10"

    async def watch(self, res: Resource, namespace: str, resource_version: str, **_: object) -> AsyncIterator[JSON]:
        self.watches.setdefault(res.kind, []).append(resource_version)
        if res.kind == "Span" and len(self.watches["Span"]) == 1:
            await self.breaking.wait()
            raise ConnectionResetError("reset by peer")
        await asyncio.Event().wait()
        yield {}  # pragma: no cover


def test_a_broken_record_watch_is_in_doubt_until_relisted_and_a_lease_watch_resumes() -> None:
    async def scenario() -> None:
        client = FlakyClient()
        informer = Informer(client, "ns")  # type: ignore[arg-type]
        assert informer.in_doubt("cf") == frozenset(Kind) - {Kind.CAPTURE}  # nothing listed yet
        await informer.start()
        try:
            await asyncio.wait_for(informer.synced.wait(), 10)
            assert informer.in_doubt("cf") == frozenset()
            client.breaking.set()
            await until(lambda: client.lists.get("Span") == 2, "the Span stream relists")
            assert informer.in_doubt("cf") == {Kind.SPAN}  # its LIST has not ended
            assert informer.healthy()[0]
            client.release.set()
            await until(lambda: not informer.in_doubt("cf"), "the Span view is current again")
            # The Span stream relisted rather than resumed; no other kind relisted.
            await until(lambda: len(client.watches["Span"]) == 2, "the Span watch again")
            assert client.lists == dict.fromkeys([LEASES.kind, *(r.kind for r in RESOURCES.values())], 1) | {"Span": 2}
        finally:
            await informer.stop()

    asyncio.run(scenario())
