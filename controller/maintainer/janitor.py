"""The janitor: what no changefeed's loop owns any more.

- Tables whose changefeed is gone but which still hold our finalizer are detached (``teardown.detach_orphans``);
  sharded, they are among the unassigned objects (labelled with no live changefeed), written through their own
  executor over that store.
- While a Changefeed is being deleted because its namespace is, finalizers the namespace's deletion waits on are
  released (``controller.kube.namespace``).
"""

from __future__ import annotations

from controller.engine import teardown
from controller.engine.maintainer import Decision, Memory
from controller.kube import namespace
from controller.kube.client import Client
from controller.kube.executor import Executor
from controller.kube.informer import Informer
from controller.maintainer.stats import Stats
from controller.model.records import Table
from controller.model.states import Kind

#: Seconds between the janitor's passes.
JANITOR_INTERVAL = 2.0


class Janitor:
    def __init__(
        self,
        client: Client,
        namespace: str,
        identity: str,
        informer: Informer,
        executor: Executor,
        orphans: Executor,
        stats: Stats,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.identity = identity
        self.informer = informer
        #: The executor of the led changefeeds' writes (warm: the orphans are in its store).
        self.executor = executor
        #: The executor over the unassigned objects (sharded: where the orphans are).
        self.orphans = orphans
        self.stats = stats

    async def sweep(self) -> None:
        store = self.informer.store
        if any(cf.deleting for cf in store.all(Kind.CHANGEFEED).values()) and await namespace.terminating(
            self.client, self.namespace
        ):
            await namespace.release_finalizers(self.client, self.namespace, deleting_only=True)
        sharded = self.informer.sharded
        source = self.informer.unassigned if sharded else store
        tables = [t for t in source.all(Kind.TABLE).values() if isinstance(t, Table)]
        chains = teardown.detach_orphans(tables, set(store.all(Kind.CHANGEFEED)))
        if chains:
            executor = self.orphans if sharded else self.executor
            out = await executor.apply(Decision(tuple(chains), Memory(epoch=0, identity=self.identity)))
            self.stats.writes += out.writes
            self.stats.failed_chains += out.failed
