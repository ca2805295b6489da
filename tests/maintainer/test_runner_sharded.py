"""The maintainer with a sharded cache (issue 23), in-process against the embedded API server: it lists a
changefeed's objects only once it leads it, and decides only after that LIST; it labels what a user created
without ``cdc.maintainer.dev/changefeed`` for a changefeed it leads (only labelled objects reach its shard);
it detaches the Tables of a changefeed that is gone (they are among the unassigned objects); and when it stops
leading a changefeed, that changefeed's records leave its memory."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from controller.apiserver import ApiServerHandle
from controller.kube.client import RESOURCES, Client, Config
from controller.maintainer.runner import Maintainer, Settings
from controller.model import resources as conv
from controller.model.states import API_VERSION, TABLE_FINALIZER, Kind
from tests.kube.conftest import namespace, until
from tests.maintainer.test_runner import GatedClient

JSON = dict[str, Any]


def settings(ns: str, identity: str = "m1") -> Settings:
    return Settings(
        namespace=ns,
        identity=identity,
        tick=0.1,
        lease_duration=2.0,
        renew_deadline=1.5,
        retry=0.1,
        cache="sharded",
    )


def obj(kind: Kind, name: str, spec: JSON, labels: dict[str, str] | None = None, **meta: Any) -> JSON:
    metadata: JSON = {"name": name, **meta}
    if labels:
        metadata["labels"] = labels
    return {"apiVersion": API_VERSION, "kind": kind.value, "metadata": metadata, "spec": spec}


def test_a_sharded_maintainer_labels_places_detaches_and_forgets(server: ApiServerHandle) -> None:
    async def main() -> None:
        async with Client(Config.load(str(server.kubeconfig_path))) as client:
            ns = await namespace(client, "sharded")
            await client.create(RESOURCES[Kind.CHANGEFEED], ns, obj(Kind.CHANGEFEED, "cf", {}))
            # A Table created without the label (kubectl apply of a plain manifest), and one of a changefeed that
            # was deleted while no maintainer ran (still holding the maintainer's finalizer).
            await client.create(RESOURCES[Kind.TABLE], ns, obj(Kind.TABLE, "t1", {"changefeed": "cf", "tableID": 1}))
            orphan = obj(
                Kind.TABLE,
                "t-gone",
                {"changefeed": "gone", "tableID": 2},
                {conv.CHANGEFEED_LABEL: "gone"},
                finalizers=[TABLE_FINALIZER],
            )
            await client.create(RESOURCES[Kind.TABLE], ns, orphan)
            m = Maintainer(client, settings(ns))
            await m.start()
            try:
                await until(lambda: "cf" in m.leading, "leading cf")
                # The leader labels the Table, its shard watch sees it, and a decision places its span.
                await until(
                    lambda: "t1" in m.informer.store.index("cf").tables and m.informer.store.index("cf").spans,
                    "the unlabelled Table labelled, seen, and its span created",
                )
                t1 = await client.get(RESOURCES[Kind.TABLE], ns, "t1")
                assert t1["metadata"]["labels"][conv.CHANGEFEED_LABEL] == "cf"
                assert TABLE_FINALIZER in t1["metadata"].get("finalizers", [])
                for span in (await client.list(RESOURCES[Kind.SPAN], ns))[0]:
                    assert span["metadata"]["labels"][conv.CHANGEFEED_LABEL] == "cf"

                async def detached() -> bool:
                    table = await client.get(RESOURCES[Kind.TABLE], ns, "t-gone")
                    status = table.get("status") or {}
                    return status.get("state") == "Detached" and not table["metadata"].get("finalizers")

                deadline = time.monotonic() + 30
                while not await detached():
                    assert time.monotonic() < deadline, "the orphan Table detached"
                    await asyncio.sleep(0.1)
                # Only the changefeed it leads is in its shard; the orphan never entered it.
                assert set(m.informer.tracked()) == {"cf"}
                assert "t-gone" not in m.informer.store.records.get(Kind.TABLE.value, {})

                # A user's SpanOperator without the label: labelled too (and so seen by the leader).
                op = obj(Kind.OPERATOR, "op1", {"changefeed": "cf", "type": "Remove", "spans": ["nope"]})
                await client.create(RESOURCES[Kind.OPERATOR], ns, op)
                await until(lambda: "op1" in m.informer.store.index("cf").operators, "the unlabelled operator seen")
                labelled = await client.get(RESOURCES[Kind.OPERATOR], ns, "op1")
                assert labelled["metadata"]["labels"][conv.CHANGEFEED_LABEL] == "cf"
            finally:
                await m.stop()
            # Stopped: the changefeed was given up, and its records left with it.
            assert m.informer.tracked() == set()
            assert not m.informer.store.records.get(Kind.SPAN.value)
            assert not m.informer.store.records.get(Kind.TABLE.value)

    asyncio.run(main())


def test_a_sharded_taker_decides_only_once_its_changefeed_is_listed(server: ApiServerHandle) -> None:
    """The mutant ``taker-decides-before-listed`` of the simulator, in production: the Lease is taken, the shard's
    LIST of Dispatchers hangs, and no decision is made until it ends."""

    async def main() -> None:
        async with GatedClient(Config.load(str(server.kubeconfig_path))) as client:
            client.leases.set()
            ns = await namespace(client, "sharded")
            await client.create(RESOURCES[Kind.CHANGEFEED], ns, obj(Kind.CHANGEFEED, "cf", {}))
            m = Maintainer(client, replace(settings(ns), balance=False))
            await m.start()
            try:
                await until(lambda: "cf" in m.leading, "the Lease taken")
                await asyncio.sleep(0.5)
                assert "Dispatcher (unassigned)" in m.informer.unlisted()  # held at the gate, as the shard's LIST
                assert m.stats.decisions == 0
                client.lists.set()
                await until(lambda: m.stats.decisions > 0, "a decision once the shard is listed")
            finally:
                await m.stop()

    asyncio.run(main())


def test_max_leases_holds_when_every_changefeed_is_bid_for_at_once(server: ApiServerHandle) -> None:
    """Found by the scale-out bench: a replica's changefeed loops all asked "may I bid?" before any bid had been
    won, so all of them bid, and a replica whose share was 10 of 30 took 18 (``maxLeases`` was no hard cap either).
    A bid now holds its place in the count until it is answered."""

    async def main() -> None:
        async with Client(Config.load(str(server.kubeconfig_path))) as client:
            ns = await namespace(client, "sharded")
            for i in range(6):
                await client.create(RESOURCES[Kind.CHANGEFEED], ns, obj(Kind.CHANGEFEED, f"cf{i}", {}))
            m = Maintainer(client, replace(settings(ns), max_leases=2, balance=False))
            most = 0
            await m.start()
            try:
                deadline = time.monotonic() + 3.0
                while time.monotonic() < deadline:
                    most = max(most, len(m.leading))
                    await asyncio.sleep(0.01)
            finally:
                await m.stop()
            assert most == 2

    asyncio.run(main())


def test_a_replica_warming_up_takes_the_share_of_the_replicas_expected(server: ApiServerHandle) -> None:
    """The scale-out bench's start: three replicas started together announce themselves seconds apart, and the
    first up took all 30 changefeeds, then handed 20 over (its peak memory that of one replica leading all). With
    ``expected_replicas`` it takes ceil(C/expected) for its first lease duration; alone after that, all."""

    async def main() -> None:
        async with Client(Config.load(str(server.kubeconfig_path))) as client:
            ns = await namespace(client, "sharded")
            for i in range(6):
                await client.create(RESOURCES[Kind.CHANGEFEED], ns, obj(Kind.CHANGEFEED, f"cf{i}", {}))
            s = replace(settings(ns), expected_replicas=3, lease_duration=6.0, renew_deadline=4.0)
            m = Maintainer(client, s)
            most = 0
            await m.start()
            try:
                await until(lambda: len(m.leading) == 2, "its share of three")
                while time.monotonic() - m.started < 0.5 * s.lease_duration:
                    most = max(most, len(m.leading))
                    await asyncio.sleep(0.01)
                await until(lambda: len(m.leading) == 6, "every changefeed once the others did not show up")
            finally:
                await m.stop()
            assert most == 2

    asyncio.run(main())


def test_a_bid_held_back_counts_the_lapse_from_when_the_watch_saw_the_last_renewal(server: ApiServerHandle) -> None:
    """Found by bench/scale_out.py: a replica whose share was full held its bids back until the SIGKILLed replica's
    member Lease lapsed; its first bid then started the lapse clock afresh, and the victim's changefeeds were led
    again 31 s after the kill with a 15 s Lease. The elector now counts from when our watch saw the Lease last
    change (``LeaseLiveness.silence``), on our clock as before."""
    from controller.kube.client import LEASES
    from controller.kube.lease import LeaderElector
    from controller.model.resources import format_time

    async def main() -> None:
        async with Client(Config.load(str(server.kubeconfig_path))) as client:
            ns = await namespace(client, "sharded")
            renew = format_time(time.time(), micro=True)
            spec = {"holderIdentity": "gone", "leaseDurationSeconds": 5, "renewTime": renew, "leaseTransitions": 3}
            lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "cfm-x"}}
            await client.create(LEASES, ns, {**lease, "spec": spec})

            def elector(silent: Any) -> LeaderElector:
                return LeaderElector(client, ns, "cfm-x", "me", duration=5.0, retry=0.1, silent=silent)

            assert not await elector(lambda holder, r: 0.0).try_acquire()  # never seen before: a duration to wait
            # Seen unchanged for 4 s of 5: not yet; for 6 s: taken at once, at a new epoch.
            assert not await elector(lambda holder, r: 4.0 if (holder, r) == ("gone", renew) else 0.0).try_acquire()
            e = elector(lambda holder, r: 6.0 if (holder, r) == ("gone", renew) else 0.0)
            assert await e.try_acquire()
            assert e.epoch == 4

    asyncio.run(main())
