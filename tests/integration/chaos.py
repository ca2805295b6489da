"""Outages of the Kubernetes API, as a process sees them: a TCP proxy per process that can be cut.

Each process under test gets its own kubeconfig pointing at its own :class:`Proxy`, which forwards to the
API server. ``cut()`` closes every connection through it at once and closes its listening socket, so new
connections are refused (what a client sees while a kube-apiserver restarts, or a control plane fails
over); ``restore()`` listens again on the same port. Cutting every proxy is an outage of the API for
everyone; cutting one isolates one process (a network partition of one node). ``cut(blackhole=True)``
is the nastier kind: nothing is closed or refused, bytes just stop flowing, and the connections open
during the cut stay dead after ``restore()`` (a load balancer that lost its backend); only new ones work.

The proxies run on an event loop in a daemon thread of their own, so a test drives them synchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

import yaml


class Proxy:
    def __init__(self, upstream: str, loop: asyncio.AbstractEventLoop, host: str = "127.0.0.1") -> None:
        parts = urlsplit(upstream)
        if not (parts.hostname and parts.port):
            raise ValueError(f"not a host:port URL: {upstream}")
        self.upstream = (parts.hostname, parts.port)
        self.host = host
        self.port = 0
        self.loop = loop
        self.server: asyncio.Server | None = None
        self.conns: set[asyncio.StreamWriter] = set()
        self.cuts = 0
        self.blackhole = False
        self.dead: set[asyncio.StreamWriter] = set()  # connections that carry nothing any more

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)  # type: ignore[arg-type]

    # -- on the proxy loop -------------------------------------------------------------------------------

    async def _listen(self) -> None:
        self.server = await asyncio.start_server(self._serve, self.host, self.port, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Tracked from the first moment, and closed on every way out (a cut, the upstream refusing, the
        # proxies shutting down): a socket left to the garbage collector is a ResourceWarning in the test.
        self.conns.add(writer)
        up_writer: asyncio.StreamWriter | None = None
        if self.blackhole:
            self.dead.add(writer)  # accepted, never answered
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            self.conns.add(up_writer)

            async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
                with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                    while data := await src.read(65536):
                        if writer in self.dead:
                            continue  # swallowed
                        dst.write(data)
                        await dst.drain()
                dst.transport.abort()

            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except (OSError, asyncio.CancelledError):
            # Not re-raised: asyncio's stream server logs a handler task that ends cancelled as an error.
            pass
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.transport.abort()
                    self.conns.discard(w)
                    self.dead.discard(w)

    async def _cut(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for w in list(self.conns):
            w.transport.abort()
        self.conns.clear()

    async def _blackhole(self) -> None:
        self.blackhole = True
        self.dead |= self.conns

    async def _listen_or_open(self) -> None:
        self.blackhole = False
        if self.server is None:
            await self._listen()

    # -- from the test --------------------------------------------------------------------------------

    def start(self) -> Proxy:
        self._call(self._listen())
        return self

    def cut(self, blackhole: bool = False) -> None:
        """Drop every connection and refuse new ones; or (``blackhole``) let them all hang."""
        self.cuts += 1
        self._call(self._blackhole() if blackhole else self._cut())

    def restore(self) -> None:
        self._call(self._listen_or_open())

    @property
    def is_cut(self) -> bool:
        return self.server is None


class Chaos:
    """Proxies, one per process, on one event loop in a daemon thread."""

    def __init__(self, upstream: str, kubeconfig: Path, workdir: Path) -> None:
        self.upstream = upstream
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="chaos-proxies", daemon=True)
        self.thread.start()
        self.proxies: dict[str, Proxy] = {}
        self.kubeconfigs: dict[str, Path] = {}

    def proxy(self, name: str) -> tuple[Proxy, Path]:
        """A proxy for process ``name`` and a kubeconfig that points at it."""
        proxy = Proxy(self.upstream, self.loop).start()
        self.proxies[name] = proxy
        config = yaml.safe_load(self.kubeconfig.read_text())
        for cluster in config["clusters"]:
            cluster["cluster"]["server"] = proxy.url
        path = self.workdir / f"kubeconfig-{name}"
        path.write_text(yaml.safe_dump(config))
        self.kubeconfigs[name] = path
        return proxy, path

    def cut(self, names: Iterable[str] | None = None, blackhole: bool = False) -> None:
        for name in sorted(self.proxies if names is None else names):
            self.proxies[name].cut(blackhole)

    def restore(self, names: Iterable[str] | None = None) -> None:
        for name in sorted(self.proxies if names is None else names):
            self.proxies[name].restore()

    def close(self) -> None:
        async def shutdown() -> None:
            for proxy in self.proxies.values():
                await proxy._cut()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()
