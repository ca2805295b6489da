"""The process that answers ``/metrics`` for a maintainer (``python -m controller.maintainer.metrics_relay``).

Why a process of its own (issue 37): served by a thread of the maintainer, a scrape still shared the GIL with the
event loop and the decision's thread. It took the GIL at least five times (the socket readable, the loop woken,
the collection back, the encoding, the answer sent) and waited up to a switch interval (5 ms) each time, then for
the OS on a busy machine: 55-66 ms at worst at 100,000 spans. This process shares no GIL with the maintainer.

What it does, and nothing else:

- It serves ``GET /metrics`` on the listening socket its maintainer bound and handed it (``--listen-fd``), so a
  port that cannot be bound fails the maintainer's start, and a relay started again takes over the same socket.
- For each scrape it asks its maintainer, over a socket pair (``--channel-fd``), for a collection of the
  maintainer's registry, which the maintainer's event loop makes (the only place that reads its cache without
  locks) and sends back pickled. It waits at most ``--fresh-within`` seconds; past that the scrape is answered
  with the last collection (and the maintainer told, which counts it), and the late one, once it arrives, answers
  the next scrape. One collection is asked for at a time.
- It encodes (text or OpenMetrics, as the scrape's ``Accept`` asks) and filters by ``name[]``, as
  prometheus_client's own server does.
- It exits when the channel closes: its maintainer stopped it, exited or was killed (the kernel closes the
  maintainer's end), so no relay outlives its maintainer.

It imports nothing of the project but this module (an import-linter contract says so): a Python interpreter and
prometheus_client, about 25 MB resident, whatever the number of spans.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import io
import pickle
import select
import signal
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any

from prometheus_client.exposition import choose_encoder
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


class Channel:
    """The relay's end of the socket pair: asks for collections and receives them (:meth:`collection`)."""

    def __init__(self, sock: socket.socket, fresh_within: float, first_within: float = FIRST_WITHIN) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fresh_within = fresh_within
        self.first_within = first_within
        self.lock = threading.Lock()
        self._buffer = bytearray()
        #: Collections received, and the latest of them (what a scrape the maintainer is late for is answered with).
        self.received = 0
        self.last: list[Metric] | None = None
        self.stale = 0
        self._asked = False
        self.closed = False

    def collection(self) -> tuple[list[Metric], bool]:
        """A collection to answer a scrape with, and whether it is the last one rather than one made for it."""
        with self.lock:
            if self.closed:
                raise Unavailable("the maintainer is gone")
            received = self.received
            if not self._asked:
                self.sock.sendall(MESSAGE.pack(ASK, self.stale))  # a few bytes: the socket's buffer is never full
                self._asked = True
            wait = self.fresh_within if self.last is not None else self.first_within
            self._receive(time.monotonic() + wait, received)
            if self.received > received:
                assert self.last is not None
                return self.last, False
            if self.closed or self.last is None:
                raise Unavailable("the maintainer is gone" if self.closed else "the maintainer has not collected yet")
            self.stale += 1
            self.sock.sendall(MESSAGE.pack(STALE, self.stale))
            return self.last, True

    def poll(self) -> None:
        """Take what has arrived without waiting (a late collection; the end of the channel)."""
        with self.lock:
            self._receive(time.monotonic(), self.received)

    def _receive(self, deadline: float, received: int) -> None:
        """Read until a collection beyond ``received`` has arrived, the channel closed or ``deadline`` passed."""
        while not self.closed:
            self._frames()
            if self.received > received:
                return
            left = deadline - time.monotonic()
            readable, _, _ = select.select([self.sock], [], [], max(0.0, left))
            if not readable:
                return
            try:
                chunk = self.sock.recv(1 << 20)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                return
            self._buffer += chunk

    def _frames(self) -> None:
        """Take every whole frame in the buffer: the maintainer answers each ask with one."""
        while len(self._buffer) >= FRAME.size:
            kind, size = FRAME.unpack_from(self._buffer)
            if len(self._buffer) < FRAME.size + size:
                return
            payload = bytes(self._buffer[FRAME.size : FRAME.size + size])
            del self._buffer[: FRAME.size + size]
            self._asked = False
            if kind == COLLECTED:
                self.last = decode(payload)
                self.received += 1
            else:  # the maintainer's collection failed: the scrape that waits for it fails with its reason
                raise CollectionFailed(payload.decode(errors="replace"))


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


class Handler(http.server.BaseHTTPRequestHandler):
    """``GET /metrics`` (404 elsewhere); no access log."""

    server: Server
    timeout = 30  # a client that connects and sends nothing holds only its own thread, and for so long
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path != "/metrics":
            self.send_error(404)
            return
        try:
            metrics, _ = self.server.channel.collection()
        except Unavailable as exc:
            self.send_error(503, explain=str(exc))
            return
        except CollectionFailed as exc:
            self.send_error(500, explain=f"the maintainer's collection failed: {exc}")
            return
        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        names = urllib.parse.parse_qs(url.query).get("name[]", [])
        body = encoder(Restricted(metrics, names))  # type: ignore[arg-type]
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
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


def serve(listener: socket.socket, channel_sock: socket.socket, fresh_within: float, first_within: float) -> None:
    """Serve until the channel closes."""
    channel = Channel(channel_sock, fresh_within, first_within)
    server = Server(listener, channel)
    server.timeout = 0.5  # how often the channel is looked at while no scrape comes
    channel_sock.sendall(READY)
    try:
        while not channel.closed:
            server.handle_request()  # one connection accepted (its thread serves it), or none within the timeout
            with contextlib.suppress(CollectionFailed):  # a failed collection nobody waited for any more
                channel.poll()
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
    a = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C: the maintainer stops, and this relay with it
    listener = socket.socket(fileno=a.listen_fd)
    channel = socket.socket(fileno=a.channel_fd)
    serve(listener, channel, a.fresh_within, a.first_within)


if __name__ == "__main__":
    main()
