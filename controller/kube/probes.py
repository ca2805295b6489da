"""A readiness endpoint (``--readiness http://0.0.0.0:8081/readyz``) for the maintainer and the capture agent.

Kubernetes routes nothing to these pods, so readiness is not about traffic: it is what ``helm install
--wait``, ``kubectl rollout status`` and a rolling update wait for. A pod that crash-loops, cannot list
its kinds (RBAC, CRDs missing) or never competes for its Leases must not count as available, or an
install "succeeds" while nothing works.

Liveness stays Kopf's endpoint in the maintainer (it reports watch health); readiness is served here, in
the running event loop (aiohttp), because the check reads state owned by that loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlsplit

from aiohttp import web

log = logging.getLogger(__name__)

#: A check answers (ready, why); ``why`` is the body of the answer, for ``kubectl describe pod``.
Check = Callable[[], tuple[bool, str]]


def parse_endpoint(url: str) -> tuple[str, int, str]:
    """``http://host:port/path`` -> (host, port, path). ValueError with a message a person can act on."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{url!r}: expected http://HOST:PORT/PATH")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    if port is None:
        raise ValueError(f"{url!r}: a port is required")
    return parts.hostname, port, parts.path or "/"


class ProbeServer:
    """``GET <path>``: 200 ``ok: <why>`` when ``check()`` says ready, else 503 ``not ready: <why>``."""

    def __init__(self, url: str, check: Check) -> None:
        self.host, self.port, self.path = parse_endpoint(url)
        self.check = check
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(self.path, self._probe)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        if not self.port:  # an ephemeral port (tests): report the one the OS chose
            self.port = int(runner.addresses[0][1])
        log.info("readiness served on http://%s:%d%s", self.host, self.port, self.path)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _probe(self, _: web.Request) -> web.Response:
        try:
            ready, why = self.check()
        except Exception as exc:  # a broken check must read as "not ready", never crash the endpoint
            ready, why = False, f"check failed: {exc!r}"
        if ready:
            return web.Response(text=f"ok: {why}\n")
        return web.Response(status=503, text=f"not ready: {why}\n")
