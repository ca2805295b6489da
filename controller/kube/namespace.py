"""A namespace being deleted: finalizers that nobody can honour any more, released by whoever is still there.

When a namespace is deleted with the maintainer's and captures' pods in it (the chart runs them there), the
namespace controller deletes everything at once: the pods (SIGTERM), the Leases (the maintainer's term ends,
a capture's renewal finds its Lease gone and it stops), and the Changefeeds, Tables and Dispatchers, which
wait for our finalizers. No process can start there again and no Lease can be re-created, so no maintainer
would ever finish the teardown: the namespace would stay Terminating for ever.

Nothing those finalizers protect is left to protect then. A Dispatcher's finalizer keeps its span from being
placed again while the dispatcher may still write; a Table's and a Changefeed's keep the objects until the
teardown has removed what replicates them. In a namespace being deleted nothing can be created, no new
dispatcher, span or operator, and everything in it is being deleted. So a maintainer that finds its namespace
terminating releases them:

* on stop (SIGTERM, its pod deleted with the namespace), every one of them, being deleted yet or not (the
  namespace controller marks them after; nobody would be left to release them then);
* while it runs (the maintainer's janitor), those of objects already being deleted.

How it knows, without permission to read the cluster-scoped Namespace: a dry-run create in the namespace is
refused by the NamespaceLifecycle admission (403 with cause ``NamespaceTerminating``), which runs for dry-run
requests as for any other; nothing is ever stored. With the maintainer SIGKILLed first, nobody is left at
all: ``kubectl changefeed teardown`` (docs/operations.md, "Deleting a namespace").
"""

from __future__ import annotations

import logging

from controller.kube.client import LEASES, RESOURCES, ApiError, Client, remove_finalizer
from controller.model.states import CHANGEFEED_FINALIZER, DISPATCHER_FINALIZER, TABLE_FINALIZER, Kind

log = logging.getLogger(__name__)

#: The name of the Lease a dry-run create asks about (never stored).
PROBE_LEASE = "cfm-namespace-probe"
#: Our finalizers, by kind, released in this order (what replicates first, the Changefeed last).
FINALIZERS = (
    (Kind.DISPATCHER, DISPATCHER_FINALIZER),
    (Kind.TABLE, TABLE_FINALIZER),
    (Kind.CHANGEFEED, CHANGEFEED_FINALIZER),
)


async def terminating(client: Client, namespace: str) -> bool:
    """Whether ``namespace`` is being deleted (a dry-run create of a Lease there is refused for that)."""
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": PROBE_LEASE}, "spec": {}}
    try:
        await client.request(
            "create", "POST", LEASES.path(namespace), params={"dryRun": "All"}, body=body, timeout=10.0
        )
    except ApiError as exc:
        return exc.status == 403 and "NamespaceTerminating" in exc.causes
    return False


async def release_finalizers(client: Client, namespace: str, *, deleting_only: bool) -> int:
    """Remove our finalizers in a namespace being deleted (see the module docstring); how many were removed."""
    released = 0
    for kind, finalizer in FINALIZERS:
        res = RESOURCES[kind]
        async for page, _rv in client.list_pages(res, namespace):
            for obj in page:
                meta = obj.get("metadata") or {}
                if finalizer not in (meta.get("finalizers") or []):
                    continue
                if deleting_only and not meta.get("deletionTimestamp"):
                    continue
                if await remove_finalizer(client, res, namespace, obj, finalizer):
                    released += 1
    if released:
        log.warning(
            "namespace %s is being deleted: released %d finalizer(s) that no maintainer could honour any more",
            namespace,
            released,
        )
    return released
