"""The API client against a tiny in-process HTTP server: a server URL with a path, and answers that are
not the API's (a proxy's HTML page) becoming errors the callers handle, not JSON decoding tracebacks."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from aiohttp import web

from controller.kube.client import RESOURCES, ApiError, BadResponse, Client, Config, sleep_or
from controller.model.states import Kind


async def serve(routes: web.RouteTableDef) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def test_a_server_url_with_a_path_and_answers_that_are_not_json() -> None:
    routes = web.RouteTableDef()
    cf = RESOURCES[Kind.CHANGEFEED]

    @routes.get("/k8s/clusters/c1" + cf.path("ns", "good"))
    async def good(_: web.Request) -> web.Response:
        return web.json_response({"metadata": {"name": "good"}})

    @routes.get("/k8s/clusters/c1" + cf.path("ns", "html"))
    async def html(_: web.Request) -> web.Response:
        return web.Response(text="<html>welcome</html>", content_type="text/html")

    @routes.get("/k8s/clusters/c1" + cf.path("ns", "bad-gateway"))
    async def bad_gateway(_: web.Request) -> web.Response:
        return web.Response(status=502, text="<html>502 Bad Gateway</html>", content_type="text/html")

    async def main() -> None:
        runner, port = await serve(routes)
        try:
            async with Client(Config(url=f"http://127.0.0.1:{port}/k8s/clusters/c1")) as client:
                assert (await client.get(cf, "ns", "good"))["metadata"]["name"] == "good"
                with pytest.raises(BadResponse, match="not JSON"):
                    await client.get(cf, "ns", "html")
                with pytest.raises(ApiError) as err:
                    await client.get(cf, "ns", "bad-gateway")
                assert (err.value.status, err.value.reason) == (502, "502")
                assert "Bad Gateway" in err.value.message
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_sleep_or_never_swallows_a_cancellation() -> None:
    """A loop around ``sleep_or`` ends when cancelled, even when the event is set in the same instant. With
    ``asyncio.wait_for`` (Python 3.11) the cancellation was swallowed and the loop went on for ever: a capture
    agent SIGTERMed just as a watch event woke its loop hung in its shutdown."""

    async def main() -> None:
        ev = asyncio.Event()
        rounds = 0

        async def loop() -> None:
            nonlocal rounds
            while True:
                await sleep_or(ev, 10.0)
                rounds += 1

        task = asyncio.create_task(loop())
        await asyncio.sleep(0)  # the loop waits on the event
        ev.set()
        task.cancel()  # in the same instant
        with contextlib.suppress(asyncio.CancelledError):
            async with asyncio.timeout(2.0):
                await task
        assert task.cancelled()
        assert rounds == 0

    asyncio.run(main())
