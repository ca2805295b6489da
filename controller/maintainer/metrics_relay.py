"""The process that answers ``/metrics`` for a maintainer (``python -m controller.maintainer.metrics_relay``).

Why a process of its own: served by a thread of the maintainer, a scrape still shared the GIL with the
event loop and the decision's thread. It took the GIL at least five times (the socket readable, the loop woken,
the collection back, the encoding, the answer sent) and waited up to a switch interval (5 ms) each time, then for
the OS on a busy machine: 55-66 ms at worst at 100,000 spans. This process shares no GIL with the maintainer.

What it does, and nothing else:

- It serves ``GET /metrics`` on the listening socket its maintainer bound and handed it (``--listen-fd``), so a
  port that cannot be bound fails the maintainer's start, and a relay started again takes over the same socket.
- While scrapes come, it asks its maintainer every ``--refresh`` seconds, over a socket pair (``--channel-fd``),
  for a collection of the maintainer's registry, which the maintainer's event loop makes (the only place that
  reads its cache without locks) and sends back pickled, and encodes it when it arrives. A scrape is answered at
  once with the latest collection if it is at most twice ``--refresh`` old. Otherwise (the first scrape, the
  first after ``KEEP_FOR`` without any, a maintainer whose loop is late) the scrape asks for one and waits at
  most ``--fresh-within`` seconds; past that it is answered with the latest (and the maintainer told, which
  counts it). One collection is asked for at a time (:class:`Channel`).
- It encodes (text or OpenMetrics, as the scrape's ``Accept`` asks) and filters by ``name[]``, as
  prometheus_client's own server does; the text format of the latest collection is encoded once.
- It exits when the channel closes: its maintainer stopped it, exited or was killed (the kernel closes the
  maintainer's end), so no relay outlives its maintainer.

It imports nothing of the project but this module (an import-linter contract says so): a Python interpreter and
prometheus_client, about 24 MiB resident (11 of them shared libraries), whatever the number of spans.
"""

from __future__ import annotations

import argparse
import http.server
import io
import pickle
import signal
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any

from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.metrics_core import Metric

#: Relay -> maintainer: the kind (``ASK`` for a collection, ``STALE`` when a scrape was answered with the last one)
#: and how many scrapes this relay has answered stale so far.
MESSAGE = struct.Struct("!BQ")
ASK, STALE = 0, 1
#: Maintainer -> relay, one per ask: the kind (``COLLECTED``, ``FAILED``) and the length of what follows (a pickled
#: list of :class:`Metric`, or the UTF-8 text of the collection's error).
FRAME = struct.Struct("!BI")
COLLECTED, FAILED = 0, 1
#: Relay -> maintainer, once, when it serves.
READY = b"R"
#: How long the first scrape waits for a collection (there is no earlier one to answer with).
FIRST_WITHIN = 30.0
#: How long after the last scrape collections are still asked for ahead of the next (Prometheus scrapes every 15 s
#: to 5 min; past this the next scrape asks for its own).
KEEP_FOR = 600.0


class Unavailable(Exception):
    """No collection to answer with: the maintainer did not answer in time, or is gone (a 503)."""


class CollectionFailed(Exception):
    """The maintainer's collection raised; the reason is its error's text (a 500)."""


class _Unpickler(pickle.Unpickler):
    """Only prometheus_client's classes (a metric family, its samples) are made from what the maintainer sends."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("prometheus_client."):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"not a metric: {module}.{name}")


def decode(payload: bytes) -> list[Metric]:
    metrics = _Unpickler(io.BytesIO(payload)).load()
    if not isinstance(metrics, list) or not all(isinstance(m, Metric) for m in metrics):
        raise pickle.UnpicklingError("not a list of metrics")
    return metrics


class Restricted:
    """A collection, as the encoders take a registry (what they use of one: ``collect``), restricted to ``names``
    (the ``name[]`` query parameters) if any."""

    def __init__(self, metrics: list[Metric], names: list[str]) -> None:
        self.metrics = metrics
        self.names = set(names)

    def collect(self) -> Iterable[Metric]:
        if not self.names:
            yield from self.metrics
            return
        for metric in self.metrics:
            restricted = metric._restricted_metric(self.names)  # type: ignore[no-untyped-call]  # prometheus_client's
            if restricted is not None:
                yield restricted


class Collection:
    """A collection received from the maintainer: its metrics, when it arrived (monotonic), and its text encoding
    (the default answer, made once, when it arrives)."""

    def __init__(self, metrics: list[Metric], at: float) -> None:
        self.metrics = metrics
        self.at = at
        self.text = generate_latest(Restricted(metrics, []))  # type: ignore[arg-type]


class Channel:
    """The relay's end of the socket pair: asks for collections (:meth:`answer` for a scrape, :meth:`refresh_loop`
    ahead of them) and receives them (:meth:`receive`, the reader thread).

    A scrape is answered at once with the latest collection if it is at most ``max_age`` seconds old, which the
    refresher keeps it while scrapes come: it asks for one every ``refresh`` seconds until ``keep_for`` seconds
    after the last scrape. Otherwise (the first scrape, the first after a pause, or a maintainer whose loop is late)
    the scrape asks for one and waits up to ``fresh_within`` seconds (``first_within`` if there is none yet), then
    is answered with the latest (counted stale) or, if there is none, fails. One collection is asked for at a
    time."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        fresh_within: float,
        refresh: float,
        first_within: float = FIRST_WITHIN,
        keep_for: float = KEEP_FOR,
    ) -> None:
        self.sock = sock
        self.fresh_within = fresh_within
        self.first_within = first_within
        self.refresh = refresh
        self.max_age = 2 * refresh
        self.keep_for = keep_for
        self._changed = threading.Condition()
        # All below under ``_changed``.
        self.last: Collection | None = None
        #: Answers received: collections, and failures (the text of the latest).
        self.received = 0
        self.failures = 0
        self.failure = ""
        self.stale = 0
        self.closed = False
        self.scraped_at: float | None = None
        self._asked = False
        self._out = bytearray()

    def answer(self) -> tuple[Collection, str]:
        """The collection to answer a scrape with, and how it was had: ``cached`` (made ahead of it), ``fresh``
        (asked for by it) or ``stale`` (the latest, older than ``max_age``: the maintainer did not answer in
        time)."""
        with self._changed:
            now = time.monotonic()
            self.scraped_at = now
            if self.closed:
                raise Unavailable("the maintainer is gone")
            if self.last is not None and now - self.last.at <= self.max_age:
                return self.last, "cached"
            received, failures = self.received, self.failures
            self._ask()
            wait = self.fresh_within if self.last is not None else self.first_within
            self._changed.wait_for(
                lambda: self.closed or self.received > received or self.failures > failures, timeout=wait
            )
            if self.failures > failures:
                raise CollectionFailed(self.failure)
            if self.received > received:
                assert self.last is not None
                return self.last, "fresh"
            if self.closed or self.last is None:
                raise Unavailable("the maintainer is gone" if self.closed else "the maintainer has not collected yet")
            self.stale += 1
            self._send(STALE)
            return self.last, "stale"

    def refresh_loop(self) -> None:
        """The refresher's thread: while scrapes come, ask for a collection every ``refresh`` seconds."""
        with self._changed:
            due = time.monotonic()
            while not self.closed:
                now = time.monotonic()
                if now >= due:
                    if self.scraped_at is not None and now - self.scraped_at <= self.keep_for:
                        self._ask()
                    due = now + self.refresh
                self._changed.wait(due - now)  # woken early by each answer and at the end: wait again until due

    def receive(self) -> None:
        """The reader's thread: take each answer as it arrives, until the channel closes."""
        buffer = bytearray()
        while True:
            try:
                chunk = self.sock.recv(1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buffer += chunk
            while len(buffer) >= FRAME.size:
                kind, size = FRAME.unpack_from(buffer)
                if len(buffer) < FRAME.size + size:
                    break
                payload = bytes(buffer[FRAME.size : FRAME.size + size])
                del buffer[: FRAME.size + size]
                self._take(kind, payload)
        with self._changed:
            self.closed = True
            self._changed.notify_all()

    def _take(self, kind: int, payload: bytes) -> None:
        collection = None
        if kind == COLLECTED:
            try:
                collection = Collection(decode(payload), time.monotonic())
            except Exception as exc:  # never seen: a scrape waiting for it fails with the reason, the next asks again
                kind, payload = FAILED, f"the relay could not read the collection: {exc!r}".encode()
        with self._changed:
            self._asked = False
            if collection is not None:
                self.last = collection
                self.received += 1
            else:  # the maintainer's collection failed: the scrape that waits for it fails with its reason
                self.failure = payload.decode(errors="replace")
                self.failures += 1
            self._changed.notify_all()

    def _ask(self) -> None:
        if not self._asked:
            self._asked = True
            self._send(ASK)

    def _send(self, kind: int) -> None:
        """Send a message (with the count of stale answers so far), without waiting: what the socket does not take
        now (its buffer full: a maintainer whose loop has not read for long) goes before the next message, so that
        no message is sent in part."""
        self._out += MESSAGE.pack(kind, self.stale)
        while self._out and not self.closed:
            try:
                sent = self.sock.send(self._out, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                self.closed = True
                self._changed.notify_all()
                return
            del self._out[:sent]


class Handler(http.server.BaseHTTPRequestHandler):
    """``GET /metrics`` (404 elsewhere); no access log."""

    server: Server
    timeout = 30  # a client that connects and sends nothing holds only its own thread, and for so long
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        began = time.monotonic()
        url = urllib.parse.urlsplit(self.path)
        if url.path != "/metrics":
            self.send_error(404)
            return
        try:
            collection, how = self.server.channel.answer()
        except Unavailable as exc:
            self.send_error(503, explain=str(exc))
            return
        except CollectionFailed as exc:
            self.send_error(500, explain=f"the maintainer's collection failed: {exc}")
            return
        accept = self.headers.get("Accept", "")
        names = urllib.parse.parse_qs(url.query).get("name[]", [])
        encoder, content_type = choose_encoder(accept)
        if names or encoder is not generate_latest:
            body = encoder(Restricted(collection.metrics, names))  # type: ignore[arg-type]
        else:
            body = collection.text
        done = time.monotonic()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        # How long the relay took and how old the collection is (ms), for whoever measures (bench/run.py).
        self.send_header(
            "Server-Timing",
            f'relay;dur={(done - began) * 1000:.1f};desc="{how}", age;dur={(done - collection.at) * 1000:.0f}',
        )
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, listener: socket.socket, channel: Channel) -> None:
        super().__init__(listener.getsockname()[:2], Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = listener  # bound and listening already: the maintainer's
        self.channel = channel


def serve(listener: socket.socket, channel: Channel) -> None:
    """Serve until the channel closes."""
    server = Server(listener, channel)
    server.timeout = 0.5  # how often the main thread looks whether the channel closed while no scrape comes
    for target, name in ((channel.receive, "receive"), (channel.refresh_loop, "refresh")):
        threading.Thread(target=target, name=name, daemon=True).start()
    channel.sock.sendall(READY)
    try:
        while not channel.closed:
            server.handle_request()  # one connection accepted (its thread serves it), or none within the timeout
    finally:
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m controller.maintainer.metrics_relay", description=__doc__)
    parser.add_argument("--listen-fd", type=int, required=True, help="the listening socket to serve on")
    parser.add_argument("--channel-fd", type=int, required=True, help="this relay's end of the maintainer's channel")
    parser.add_argument("--fresh-within", type=float, required=True, help="seconds a scrape waits for a collection")
    parser.add_argument(
        "--first-within", type=float, default=FIRST_WITHIN, help="seconds the first scrape waits (there is no last)"
    )
    parser.add_argument("--refresh", type=float, required=True, help="seconds between collections while scraped")
    a = parser.parse_args(argv)
    # A signal to the whole process group (a terminal's ^C, a supervisor's SIGTERM) is for the maintainer: it stops
    # (releasing its Leases may take seconds, while this relay still answers), and this relay ends with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    listener = socket.socket(fileno=a.listen_fd)
    channel = Channel(
        socket.socket(fileno=a.channel_fd), fresh_within=a.fresh_within, refresh=a.refresh, first_within=a.first_within
    )
    serve(listener, channel)


if __name__ == "__main__":
    main()
