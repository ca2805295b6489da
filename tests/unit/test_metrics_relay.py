"""The process that answers /metrics for a maintainer (controller.maintainer.metrics_relay), and its keeping by
``MetricsServer``: started with the maintainer, started again if it exits, gone when the maintainer is, however the
maintainer ends."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterable, Iterator

import pytest
import urllib3
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from controller.maintainer import metrics_relay
from controller.maintainer.metrics import MetricsServer, RelayFailed


def _get(port: int, path: str = "/metrics") -> tuple[int, str]:
    r = urllib3.request("GET", f"http://127.0.0.1:{port}{path}", timeout=urllib3.Timeout(5, 40), retries=False)
    return r.status, r.data.decode()


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited: it is no more, or a zombie its parent (init, for an orphan) has not reaped
    yet."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.split()[:2] == ["State:", "Z"] for line in status)
    except FileNotFoundError:
        return True


def _gone(pid: int, within: float = 10.0) -> bool:
    """Whether process ``pid`` has exited within ``within`` seconds."""
    deadline = time.monotonic() + within
    while not _exited(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class Flaky(Collector):
    """A collector that raises while ``broken``."""

    def __init__(self) -> None:
        self.broken = True

    def collect(self) -> Iterable[Metric]:
        if self.broken:
            raise ValueError("the cache is not readable")
        return []


def test_a_failed_collection_is_a_500_with_its_reason_and_the_next_scrape_is_served() -> None:
    registry = CollectorRegistry()
    Counter("things", "Things.", registry=registry).inc()
    flaky = Flaky()
    registry.register(flaky)

    async def scrape() -> tuple[tuple[int, str], tuple[int, str]]:
        server = MetricsServer(registry, "127.0.0.1", 0)
        await server.start()
        try:
            failed = await asyncio.to_thread(_get, server.port)
            flaky.broken = False
            served = await asyncio.to_thread(_get, server.port)
            return failed, served
        finally:
            await server.stop()

    (status, text), (status2, text2) = asyncio.run(scrape())
    assert status == 500
    assert "the cache is not readable" in text
    assert status2 == 200
    assert "things_total 1.0" in text2


def test_a_relay_that_exits_is_started_again_on_the_same_port(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    Counter("things", "Things.", registry=registry).inc()

    async def run() -> tuple[int, int | None, int, str]:
        server = MetricsServer(registry, "127.0.0.1", 0)
        await server.start()
        try:
            assert server.relay is not None
            first = server.relay.pid
            assert (await asyncio.to_thread(_get, server.port))[0] == 200
            os.kill(first, signal.SIGKILL)
            for _ in range(200):  # 1 s of pause, then a new relay
                await asyncio.sleep(0.05)
                if server.relay is not None and server.relay.pid != first:
                    break
            second = None if server.relay is None else server.relay.pid
            status, text = await asyncio.to_thread(_get, server.port)
            return first, second, status, text
        finally:
            await server.stop()

    with caplog.at_level(logging.ERROR, logger="controller.maintainer.metrics"):
        first, second, status, text = asyncio.run(run())
    assert second is not None
    assert second != first
    assert _gone(first)
    assert status == 200
    assert "things_total 1.0" in text
    assert any(f"relay (pid {first}) exited" in r.getMessage() for r in caplog.records)
    assert _gone(second)  # and stopped with the server


PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from prometheus_client import CollectorRegistry, Counter
    from controller.maintainer.metrics import MetricsServer

    async def main():
        registry = CollectorRegistry()
        Counter("things", "Things.", registry=registry).inc()
        server = MetricsServer(registry, "127.0.0.1", 0)
        await server.start()
        print(server.port, server.relay.pid, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@pytest.fixture
def maintainer() -> Iterator[subprocess.Popen[str]]:
    """A process that serves metrics as the maintainer does (with a relay), stopped after the test."""
    with subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True) as proc:
        try:
            yield proc
        finally:
            proc.kill()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_the_relay_ends_with_its_maintainer(maintainer: subprocess.Popen[str], how: signal.Signals) -> None:
    """However the maintainer ends (killed, or stopped without stopping the server), its relay does not outlive
    it: the kernel closes the maintainer's end of the channel, and the relay exits on its own."""
    assert maintainer.stdout is not None
    port, relay = map(int, maintainer.stdout.readline().split())
    assert _get(port)[0] == 200
    maintainer.send_signal(how)
    maintainer.wait(10)
    try:
        assert _gone(relay)
    finally:
        if not _exited(relay):
            os.kill(relay, signal.SIGKILL)
    assert _closed(port)


def test_a_relay_whose_maintainer_never_answers_says_so() -> None:
    """The first scrape has no earlier collection to fall back on: past ``--first-within`` it is a 503, not a hang;
    and the relay exits when its channel closes."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours, theirs = socket.socketpair()
        port = listener.getsockname()[1]
        relay = subprocess.Popen(
            [sys.executable, "-m", metrics_relay.__name__, "--listen-fd", str(listener.fileno()), "--channel-fd",
             str(theirs.fileno()), "--fresh-within", "0.01", "--first-within", "0.5", "--refresh", "0.2"],
            pass_fds=(listener.fileno(), theirs.fileno()),
        )  # fmt: skip
        theirs.close()
        try:
            assert ours.recv(1) == metrics_relay.READY
            status, text = _get(port)
            assert status == 503
            assert "has not collected yet" in text
            kind, stale = metrics_relay.MESSAGE.unpack(ours.recv(metrics_relay.MESSAGE.size))
            assert (kind, stale) == (metrics_relay.ASK, 0)
            ours.close()
            assert relay.wait(10) == 0
        finally:
            ours.close()
            relay.kill()
            relay.wait()


def test_a_relay_that_cannot_start_fails_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_relay, "__name__", "controller.maintainer.no_such_relay")

    async def start() -> None:
        server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
        await server.start()

    with pytest.raises(RelayFailed, match="did not start"):
        asyncio.run(start())


def test_the_relay_makes_nothing_but_metrics_from_what_it_receives() -> None:
    """The relay unpickles only prometheus_client's classes: a frame that names any other is refused."""
    metric = Metric("things", "Things.", "counter")
    metric.add_sample("things_total", {}, 1.0)
    assert metrics_relay.decode(pickle.dumps([metric])) == [metric]
    for other in ([os.getcwd], [MetricsServer], {"a": 1}):
        with pytest.raises(pickle.UnpicklingError):
            metrics_relay.decode(pickle.dumps(other))


class PlayedMaintainer:
    """The maintainer's end of a channel, played by a thread: it answers every ask with a collection of one counter
    at the number of asks so far, and records when each message came."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.asks: list[float] = []
        self.stale: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                message = self.sock.recv(metrics_relay.MESSAGE.size, socket.MSG_WAITALL)
            except OSError:  # closed by the test
                return
            if len(message) < metrics_relay.MESSAGE.size:
                return
            kind, stale = metrics_relay.MESSAGE.unpack(message)
            self.stale.append(stale)
            if kind != metrics_relay.ASK:
                continue
            self.asks.append(time.monotonic())
            metric = Metric("asks", "Asks.", "counter")
            metric.add_sample("asks_total", {}, float(len(self.asks)))
            payload = pickle.dumps([metric])
            try:
                self.sock.sendall(metrics_relay.FRAME.pack(metrics_relay.COLLECTED, len(payload)) + payload)
            except OSError:
                return


def test_collections_are_asked_for_ahead_of_scrapes_only_while_scrapes_come() -> None:
    ours, theirs = socket.socketpair()
    channel = metrics_relay.Channel(theirs, fresh_within=0.01, refresh=0.05, keep_for=0.3)
    maintainer = PlayedMaintainer(ours)
    threads = [threading.Thread(target=t, daemon=True) for t in (channel.receive, channel.refresh_loop)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        assert maintainer.asks == []  # never scraped: nothing asked for
        collection, how = channel.answer()  # the first scrape asks and waits
        assert how == "fresh"
        time.sleep(0.2)  # scraped: asked for every 0.05 s
        assert len(maintainer.asks) >= 3
        collection, how = channel.answer()
        assert how == "cached"  # made ahead of the scrape, at most 0.1 s old
        assert time.monotonic() - collection.at <= 0.1
        time.sleep(0.5)  # 0.3 s after the last scrape the refresher stops asking
        quiet = len(maintainer.asks)
        time.sleep(0.3)
        assert len(maintainer.asks) == quiet
        collection, how = channel.answer()  # the first after the pause: its own
        assert how == "fresh"
        assert b"asks_total %d.0" % (quiet + 1) in collection.text
    finally:
        ours.shutdown(socket.SHUT_RDWR)  # wakes both ends' readers
        ours.close()
        for t in threads:
            t.join(5)
        maintainer.thread.join(5)
        theirs.close()
    assert channel.closed


def test_a_frame_the_relay_cannot_read_fails_the_scrape_waiting_for_it_and_not_the_next() -> None:
    ours, theirs = socket.socketpair()
    channel = metrics_relay.Channel(theirs, fresh_within=5.0, refresh=60.0, first_within=5.0)
    reader = threading.Thread(target=channel.receive, daemon=True)
    reader.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answers = []
            for payload in (pickle.dumps([os.getcwd]), pickle.dumps([Metric("things", "Things.", "gauge")])):
                answer = pool.submit(channel.answer)  # a scrape: it asks, then waits
                kind, _ = metrics_relay.MESSAGE.unpack(ours.recv(metrics_relay.MESSAGE.size, socket.MSG_WAITALL))
                assert kind == metrics_relay.ASK
                ours.sendall(metrics_relay.FRAME.pack(metrics_relay.COLLECTED, len(payload)) + payload)
                answers.append(answer)
            with pytest.raises(metrics_relay.CollectionFailed, match="could not read the collection"):
                answers[0].result(10)
            collection, how = answers[1].result(10)
        assert how == "fresh"
        assert [m.name for m in collection.metrics] == ["things"]
    finally:
        ours.shutdown(socket.SHUT_RDWR)
        ours.close()
        reader.join(5)
        theirs.close()


def test_a_signal_to_the_process_group_leaves_the_relay_to_end_with_its_maintainer(
    maintainer: subprocess.Popen[str],
) -> None:
    """SIGTERM or SIGINT sent to every process (a supervisor stopping a group, ^C in a terminal) is the maintainer's
    to act on: the relay keeps answering while the maintainer is still there, and ends with it."""
    assert maintainer.stdout is not None
    port, relay = map(int, maintainer.stdout.readline().split())
    for how in (signal.SIGTERM, signal.SIGINT):
        os.kill(relay, how)
    time.sleep(0.5)
    assert not _exited(relay)
    assert _get(port)[0] == 200
    maintainer.kill()
    maintainer.wait(10)
    assert _gone(relay)


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_the_endpoint_listens_on_an_ipv6_address() -> None:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            pass
    except OSError:
        pytest.skip("no IPv6 loopback here")
    registry = CollectorRegistry()
    Counter("things", "Things.", registry=registry).inc()

    async def scrape() -> tuple[int, str]:
        server = MetricsServer(registry, "::1", 0)
        await server.start()
        try:
            r = await asyncio.to_thread(
                urllib3.request, "GET", f"http://[::1]:{server.port}/metrics", timeout=10, retries=False
            )
            return r.status, r.data.decode()
        finally:
            await server.stop()

    status, text = asyncio.run(scrape())
    assert status == 200
    assert "things_total 1.0" in text
