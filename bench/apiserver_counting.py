"""The embedded API server, counting every request it serves by verb and resource (for ``bench/run.py``).

Why here and not in ``controller/apiserver``: the count is a benchmark's instrument, and the server is
not changed, only observed: ``ApiServer.dispatch`` (the handler of every route) is wrapped before the
server starts, so every client (the maintainer, the captures, the driver) is counted, from the server's
side, as kube-apiserver's ``apiserver_request_total{verb, resource, subresource}`` would count them.
``GET /_bench/requests`` answers the counts so far (that request itself is not counted).

Same command line as ``python -m controller.apiserver``; prints the URL and the kubeconfig path.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiohttp import web  # noqa: E402

from controller.apiserver import __main__ as apiserver_main  # noqa: E402
from controller.apiserver import server  # noqa: E402

COUNTS: Counter[str] = Counter()
COUNTS_PATH = "/_bench/requests"


def classify(method: str, path: str, query: dict[str, str]) -> str:
    """``"<verb> <resource>[/<subresource>]"`` as kube-apiserver names them (verb: get, list, watch,
    create, update, patch, delete, deletecollection); ``"<method> <path>"`` for anything else."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        rest = parts[2:]
    elif parts[:1] == ["apis"]:
        rest = parts[3:]
    else:
        return f"{method.lower()} /{'/'.join(parts[:1])}"
    watch = query.get("watch") in ("true", "1")
    if rest[:1] == ["watch"]:
        watch, rest = True, rest[1:]
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    if not rest:
        return f"{method.lower()} discovery"
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    verb = {
        "GET": "get" if named else ("watch" if watch else "list"),
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if named else "deletecollection",
    }.get(method, method.lower())
    return f"{verb} {resource}"


_dispatch = server.ApiServer.dispatch


async def counted(self: server.ApiServer, request: web.Request) -> web.StreamResponse:
    if request.path == COUNTS_PATH:
        return web.json_response(dict(COUNTS))
    COUNTS[classify(request.method, request.path, dict(request.query))] += 1
    return await _dispatch(self, request)


server.ApiServer.dispatch = counted  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> Any:
    return apiserver_main.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
