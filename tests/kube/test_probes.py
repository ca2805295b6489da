"""The readiness endpoint (controller.kube.probes)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from controller.kube.probes import ProbeServer, parse_endpoint


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("0.0.0.0:8081/readyz", "expected http://HOST:PORT/PATH"),
        ("https://0.0.0.0:8081/readyz", "expected http://HOST:PORT/PATH"),
        ("http://0.0.0.0/readyz", "a port is required"),
        ("http://0.0.0.0:99999/readyz", "out of range"),
    ],
)
def test_bad_endpoints_say_why(url: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_endpoint(url)


def test_parse_endpoint() -> None:
    assert parse_endpoint("http://0.0.0.0:8081/readyz") == ("0.0.0.0", 8081, "/readyz")
    assert parse_endpoint("http://127.0.0.1:0") == ("127.0.0.1", 0, "/")


def test_answers_follow_the_check() -> None:
    state: dict[str, object] = {"answer": (False, "listing")}

    def check() -> tuple[bool, str]:
        answer = state["answer"]
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, tuple)
        return answer

    async def main() -> list[tuple[int, str]]:
        server = ProbeServer("http://127.0.0.1:0/readyz", check)
        await server.start()
        out = []
        try:
            async with aiohttp.ClientSession() as session:
                for answer in [(False, "listing"), (True, "leading 1"), RuntimeError("boom")]:
                    state["answer"] = answer
                    async with session.get(f"http://127.0.0.1:{server.port}/readyz") as r:
                        out.append((r.status, await r.text()))
                async with session.get(f"http://127.0.0.1:{server.port}/other") as r:
                    out.append((r.status, ""))
        finally:
            await server.stop()
        return out

    assert asyncio.run(main()) == [
        (503, "not ready: listing\n"),
        (200, "ok: leading 1\n"),
        (503, "not ready: check failed: RuntimeError('boom')\n"),
        (404, ""),
    ]
