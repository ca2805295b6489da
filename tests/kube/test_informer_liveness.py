"""The informer's liveness is progress, not silence (issue 36), and its watches are ended by the server.

A real kube-apiserver promises no BOOKMARK at any interval, or at all: an idle maintainer whose probe failed on
"no event or bookmark for Capture in 131s" was restarted by its kubelet for being quiet. Here the embedded API
sends no BOOKMARK at all (``bookmark_interval=None``), as a real watch cache for a kind it has seen no event for.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from controller.apiserver import ApiServerHandle, start_server
from controller.kube import informer as informer_module
from controller.kube import reflector as reflector_module
from controller.kube.client import LEASES, RESOURCES, ApiError, Client, Config
from controller.kube.informer import PROGRESS_WINDOW, Informer, Stream
from controller.kube.liveness import LEASE
from controller.kube.reflector import IDLE_MARGIN, WATCH_TIMEOUT
from controller.model.states import API_VERSION, Kind
from tests.kube.conftest import namespace, until

CRDS = Path(__file__).resolve().parents[2] / "crds"


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServerHandle]:
    handle = start_server(CRDS, bookmark_interval=None)
    try:
        yield handle
    finally:
        handle.stop()


def span(name: str) -> dict[str, object]:
    spec = {"changefeed": "cf", "tableID": 1, "startKey": "00", "endKey": "ff"}
    return {"apiVersion": API_VERSION, "kind": "Span", "metadata": {"name": name}, "spec": spec}


class Recording:
    """Wraps ``client.watch``: the ``timeoutSeconds`` each watch asked for, and the events it delivered."""

    def __init__(self, client: Client) -> None:
        self.timeouts: list[int] = []
        self.types: list[str] = []
        inner = client.watch

        async def watch(*args: Any, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
            self.timeouts.append(kwargs["timeout_seconds"])
            async for ev in inner(*args, **kwargs):
                self.types.append(str(ev.get("type")))
                yield ev

        client.watch = watch  # type: ignore[method-assign]


def test_each_watch_asks_for_a_random_server_timeout_of_5_to_10_minutes(server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=server.url)) as client:
            ns = await namespace(client)
            recording = Recording(client)
            informer = Informer(client, ns)
            await informer.start()
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                await until(lambda: len(recording.timeouts) >= len(informer.kinds), "every kind watched")
            finally:
                await informer.stop()
            assert WATCH_TIMEOUT == 300
            assert all(WATCH_TIMEOUT <= t <= 2 * WATCH_TIMEOUT for t in recording.timeouts), recording.timeouts
            assert len(set(recording.timeouts)) > 1, "drawn at random (client-go: minWatchTimeout * (1 + rand))"

    asyncio.run(scenario())


def test_a_watch_the_server_ends_is_resumed_not_relisted_and_stays_healthy(server: ApiServerHandle) -> None:
    """Server-side timeouts of 1-2 s and no BOOKMARK at all: every stream is ended again and again by the server
    and resumed from its resourceVersion (no LIST), an event written later still arrives, and the informer stays
    healthy throughout although no stream has delivered anything since its LIST."""

    async def scenario() -> None:
        async with Client(Config(url=server.url)) as client:
            ns = await namespace(client)
            recording = Recording(client)
            informer = Informer(client, ns, watch_timeout=1)
            await informer.start()
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                lists = client.requests["list"]
                seen = dict(informer.last_seen)
                await until(lambda: client.requests["watch"] >= 3 * len(informer.kinds), "each kind resumed twice")
                assert client.requests["list"] == lists, "a watch the server ended is resumed, not relisted"
                assert "BOOKMARK" not in recording.types
                assert informer.last_seen == seen, "nothing delivered: the streams were quiet"
                ok, why = informer.healthy()
                assert ok, why
                await client.create(RESOURCES[Kind.SPAN], ns, span("later"))
                await until(lambda: "later" in informer.store.records.get("Span", {}), "the resumed watch's event")
                assert client.requests["list"] == lists
            finally:
                await informer.stop()

    asyncio.run(scenario())


def test_a_quiet_watch_is_healthy(server: ApiServerHandle) -> None:
    """Streams that delivered nothing for far longer than any probe window (their last event pushed back by an
    hour), while the API answers requests: healthy. The old check ("no event or bookmark for ...") failed here."""

    async def scenario() -> None:
        async with Client(Config(url=server.url)) as client:
            ns = await namespace(client)
            informer = Informer(client, ns)
            await informer.start()
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                for key in informer.last_seen:
                    informer.last_seen[key] -= 3600
                await client.list(LEASES, ns)  # the API answers
                assert informer.healthy() == (True, "ok")
            finally:
                await informer.stop()

    asyncio.run(scenario())


def test_no_request_answered_within_the_window_is_unhealthy(server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=server.url)) as client:
            ns = await namespace(client)
            informer = Informer(client, ns)
            await informer.start()
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                client.last_success = time.monotonic() - PROGRESS_WINDOW - 1
                ok, why = informer.healthy()
                assert not ok
                assert "no request answered by the API in 61s" in why
                informer.progress_window = 120  # the maintainer's --liveness-window
                assert informer.healthy() == (True, "ok")
                assert not informer.healthy(window=30)[0]
                await client.list(LEASES, ns)  # answered: progress again
                informer.progress_window = PROGRESS_WINDOW
                assert informer.healthy() == (True, "ok")
            finally:
                await informer.stop()

    asyncio.run(scenario())


def test_a_watch_task_that_ended_is_unhealthy(server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=server.url)) as client:
            ns = await namespace(client)
            informer = Informer(client, ns)
            await informer.start()
            try:
                await asyncio.wait_for(informer.synced.wait(), 20)
                task = informer._tasks["Span"]
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                ok, why = informer.healthy()
                assert not ok
                assert why == "watch task informer-Span ended"
            finally:
                await informer.stop()

    asyncio.run(scenario())


def test_the_client_records_when_the_api_last_answered(server: ApiServerHandle) -> None:
    async def scenario() -> None:
        async with Client(Config(url=server.url)) as client:
            ns = await namespace(client)
            client.last_success = 0.0
            with pytest.raises(ApiError):
                await client.get(LEASES, ns, "absent")
            assert client.last_success == 0.0, "an error status is no success"
            await client.list(LEASES, ns)
            assert client.last_success > 0.0
            client.last_success = 0.0
            events = client.watch(RESOURCES[Kind.SPAN], ns, "", timeout_seconds=5)
            first = asyncio.ensure_future(anext(events))
            await until(lambda: client.last_success > 0.0, "the watch connected")
            assert not first.done(), "nothing delivered yet: connecting counts"
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            await events.aclose()  # type: ignore[attr-defined]

    asyncio.run(scenario())


class Hanging:
    """A client whose watches connect and then deliver nothing, ever (a connection that died silently)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.timeouts: list[int] = []
        self.error = error
        self.last_success = time.monotonic()

    async def watch(self, *_: Any, timeout_seconds: int, **__: Any) -> AsyncIterator[dict[str, Any]]:
        self.timeouts.append(timeout_seconds)
        if self.error is not None:
            raise self.error
        await asyncio.Event().wait()
        yield {}


def test_a_silent_connection_ends_the_stream_after_the_server_timeout_plus_a_margin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client-side idle limit is longer than the timeout asked of the server (which would have ended a
    live stream by then), and its expiry just ends the stream (the caller resumes it): no error."""
    monkeypatch.setattr(reflector_module, "IDLE_MARGIN", 0.2)

    async def scenario() -> None:
        fake = Hanging()
        informer = Informer(cast(Client, fake), "ns", watch_timeout=1)
        loop = asyncio.get_running_loop()
        start = loop.time()
        events = [ev async for ev in informer.reflector(Stream("Span", RESOURCES[Kind.SPAN]))._events("7")]
        elapsed = loop.time() - start
        assert events == []
        (timeout,) = fake.timeouts
        assert 1 <= timeout <= 2
        assert elapsed >= timeout + 0.2, "not before the server's own timeout (plus the margin) is over"

    asyncio.run(scenario())
    assert IDLE_MARGIN > 0


def test_a_quiet_lease_stream_is_resumed_sooner_without_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(informer_module, "IDLE", {LEASE: 0.05})

    async def scenario() -> None:
        fake = Hanging()
        informer = Informer(cast(Client, fake), "ns")
        events = [ev async for ev in informer.reflector(Stream(LEASE, LEASES))._events("7")]
        assert events == []
        (timeout,) = fake.timeouts
        assert WATCH_TIMEOUT <= timeout <= 2 * WATCH_TIMEOUT, "the server is asked for the usual timeout"

    asyncio.run(scenario())


def test_the_clients_own_timeout_is_an_error() -> None:
    """A TimeoutError from inside the client (its socket read timeout) is not the idle limit: it propagates."""

    async def scenario() -> None:
        informer = Informer(cast(Client, Hanging(error=TimeoutError("sock_read"))), "ns")
        with pytest.raises(TimeoutError, match="sock_read"):
            [ev async for ev in informer.reflector(Stream("Span", RESOURCES[Kind.SPAN]))._events("7")]

    asyncio.run(scenario())


def test_the_maintainers_flags_reach_its_informer(server: ApiServerHandle) -> None:
    from controller.maintainer import __main__ as cli
    from controller.maintainer.runner import Maintainer, Settings

    a = cli.parse(["--namespace", "x"])
    assert (a.watch_timeout, a.liveness_window) == (WATCH_TIMEOUT, PROGRESS_WINDOW)
    a = cli.parse(["--watch-timeout", "10", "--liveness-window", "20"])
    assert (a.watch_timeout, a.liveness_window) == (10, 20)
    for bad in (["--watch-timeout", "0"], ["--liveness-window", "0"]):
        with pytest.raises(SystemExit):
            cli.parse(bad)

    async def scenario() -> None:
        async with Client(Config(url=server.url)) as client:
            m = Maintainer(client, Settings(namespace="x", watch_timeout=10, liveness_window=20))
            assert (m.informer.watch_timeout, m.informer.progress_window) == (10, 20)

    asyncio.run(scenario())
