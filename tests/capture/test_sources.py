"""The capture's ``Sources``: a changefeed whose source Secret cannot be used is looked at again after a back-off
(not only at the next full pass, a minute later), and not on every pass meanwhile, however many dispatchers wait;
what cannot be used is a trouble of its side, which says what and where (never a credential); a configured
changefeed's Secrets are read again, and their new values handed to the data plane."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from controller.apiserver.tls import self_signed
from controller.capture import sources
from controller.capture.sources import Sources
from controller.capture.troubles import Troubles
from controller.kube.client import ApiError
from controller.model.progress import SINK, SOURCE
from controller.sources.etcd import connection as etcd


def _secret(**data: str) -> dict[str, Any]:
    return {"data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


class Api:
    """What ``Sources`` reads: the Changefeed and its two Secrets, counted."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {
            "cf": {
                "apiVersion": "cdc.maintainer.dev/v1alpha1", "kind": "Changefeed",
                "metadata": {"name": "cf", "namespace": "ns"},
                "spec": {"source": {"etcd": {"secretRef": {"name": "src"}}},
                         "sink": {"postgres": {"secretRef": {"name": "dst"}}}},
            },
            "src": _secret(endpoints="https://etcd-0:2379,http://etcd-1:2379"),  # mixed: refused
            "dst": _secret(dsn="host=pg"),
        }  # fmt: skip
        self.reads = 0

    async def get(self, resource: Any, namespace: str, name: str) -> dict[str, Any]:
        self.reads += 1
        await asyncio.sleep(0.01)  # a round trip: other dispatchers' steps run meanwhile
        if name not in self.objects:
            raise ApiError(404, "NotFound", f"secrets {name!r} not found")
        return self.objects[name]


class Routed:
    """The data plane as ``Sources`` sees it: what it was configured with, and what it says of new values."""

    def __init__(self) -> None:
        self.given: dict[str, Any] = {}
        self.reconfigured: list[Any] = []
        self.problems: dict[str, str] = {}
        self.checkpoints: list[int] = []

    def configure(self, changefeed: str, endpoints: Any) -> None:
        self.given[changefeed] = endpoints

    def configured(self, changefeed: str) -> bool:
        return changefeed in self.given

    async def reconfigure(self, changefeed: str, endpoints: Any) -> dict[str, str]:
        self.reconfigured.append(endpoints)
        return self.problems

    def published(self, changefeed: str, checkpoint_ts: int) -> None:
        self.checkpoints.append(checkpoint_ts)


def test_a_source_that_cannot_be_used_is_looked_at_again_after_a_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "RETRY", (0.2, 0.4))
    api, routed = Api(), Routed()
    s = Sources(api, "ns", routed, Troubles())  # type: ignore[arg-type]

    async def body() -> None:
        assert not await s.ready("cf")
        reads = api.reads
        first = s.retry_at("cf")
        assert first is not None
        # A hundred dispatchers of it, one pass, stepping concurrently: no read.
        assert not any(await asyncio.gather(*(s.ready("cf") for _ in range(100))))
        assert api.reads == reads
        assert s.retry_at("cf") == first
        await asyncio.sleep(0.25)
        # Looked at again (still mixed), once for all of them: one Changefeed and two Secrets read.
        assert not any(await asyncio.gather(*(s.ready("cf") for _ in range(100))))
        assert api.reads == reads + 3
        second = s.retry_at("cf")
        assert second is not None
        assert second - first > 0.35  # the back-off doubled (0.45 s later; 0.25 had it not)
        ca, client = self_signed("127.0.0.1"), self_signed("127.0.0.1")
        tls = {"ca.crt": ca.cert_pem.decode(), "tls.crt": client.cert_pem.decode(), "tls.key": client.key_pem.decode()}
        api.objects["src"] = _secret(endpoints="https://etcd-0:2379,https://etcd-1:2379", **tls)  # fixed
        await asyncio.sleep(0.45)
        assert await s.ready("cf")
        assert s.retry_at("cf") is None
        endpoints = routed.given["cf"]
        assert endpoints.etcd == ("https://etcd-0:2379", "https://etcd-1:2379")
        assert endpoints.tls == etcd.Tls(ca=ca.cert_pem, cert=client.cert_pem, key=client.key_pem)
        reads = api.reads
        assert await s.ready("cf")
        assert api.reads == reads  # read once

    asyncio.run(body())


def working() -> Api:
    api = Api()
    api.objects["src"] = _secret(endpoints="http://etcd-0:2379", username="u", password="hunter2")
    api.objects["dst"] = _secret(dsn="host=pg user=cdc password=hunter2")
    return api


@pytest.mark.parametrize(
    ("change", "side", "message"),
    [
        (lambda o: o.pop("dst"), SINK, "the sink Secret ns/dst does not exist"),
        (lambda o: o.pop("src"), SOURCE, "the source Secret ns/src does not exist"),
        (lambda o: o.update(dst=_secret(url="x")), SINK, "the sink Secret ns/dst: no key dsn (a libpq connection "
         "string or postgresql:// URI)"),
        (lambda o: o.update(dst=_secret(dsn="host=pg password=hunter2 user")), SINK,
         "the sink Secret ns/dst: dsn is not a libpq connection string (key=value ...) nor a URI"),
        (lambda o: o.update(dst=_secret(dsn="postgresql://bob:hunter2@ss@db/x")), SINK,
         "the sink Secret ns/dst: dsn's host holds an @: percent-encode @, / and : in a URI's password"),
        (lambda o: o.update(src=_secret(password="hunter2")), SOURCE, "the source Secret ns/src has no key endpoints "
         "(comma-separated etcd endpoints)"),
        (lambda o: o.update(src=_secret(endpoints="etcd:port")), SOURCE,
         "the source Secret ns/src: etcd endpoint 'etcd:port' is not host:port"),
        (lambda o: o["cf"]["spec"].pop("sink"), SINK,
         "the changefeed names a source but no sink (spec.sink.postgres or spec.sink.mysql)"),
    ],
)  # fmt: skip
def test_what_cannot_be_used_is_a_trouble_of_its_side_that_says_what_and_where(
    change: Any, side: str, message: str
) -> None:
    api, routed, troubles = working(), Routed(), Troubles()
    change(api.objects)
    s = Sources(api, "ns", routed, troubles)  # type: ignore[arg-type]
    assert not asyncio.run(s.ready("cf"))
    [trouble] = troubles.report()
    assert (trouble.changefeed, trouble.side, trouble.transient, trouble.message) == ("cf", side, False, message)
    assert "hunter2" not in repr(troubles.report())
    assert routed.given == {}


def test_a_fixed_secret_clears_its_trouble_and_a_forgotten_changefeed_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "RETRY", (0.05, 0.05))
    api, routed, troubles = working(), Routed(), Troubles()
    dst = api.objects.pop("dst")
    s = Sources(api, "ns", routed, troubles)  # type: ignore[arg-type]

    async def body() -> None:
        assert not await s.ready("cf")
        assert [t.side for t in troubles.report()] == [SINK]
        api.objects["dst"] = dst
        await asyncio.sleep(0.06)
        assert await s.ready("cf")
        assert troubles.report() == ()
        assert routed.given["cf"].sink.dsn == "host=pg user=cdc password=hunter2"
        api.objects.pop("dst")
        s.waiting["cf"] = (0.0, 0.05)
        s.read.discard("cf")
        assert not await s.ready("cf")
        assert troubles.report() != ()
        s.keep({"other"})  # none of its dispatchers is here any more
        assert troubles.report() == ()

    asyncio.run(body())


def test_the_secrets_are_read_again_and_new_values_handed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "RELOAD", 0.05)
    api, routed, troubles = working(), Routed(), Troubles()
    api.objects["cf"]["status"] = {"checkpointTs": 1234}
    s = Sources(api, "ns", routed, troubles)  # type: ignore[arg-type]

    async def body() -> None:
        assert await s.ready("cf")
        stop = asyncio.Event()
        task = asyncio.create_task(s.run(stop))
        api.objects["dst"] = _secret(dsn="host=pg user=cdc password=rotated")
        await asyncio.sleep(0.12)
        assert routed.reconfigured[-1].sink.dsn == "host=pg user=cdc password=rotated"
        assert routed.checkpoints[-1] == 1234  # the published checkpoint goes along
        # New values that do not work: a trouble of that side, said by the data plane, kept until they work.
        routed.problems = {SINK: "the sink Secret's new dsn does not work: password authentication failed"}
        await asyncio.sleep(0.12)
        assert [(t.side, t.transient) for t in troubles.report()] == [(SINK, False)]
        routed.problems = {}
        await asyncio.sleep(0.12)
        assert troubles.report() == ()
        # A Secret gone while its values are in use: a trouble, and the values in use stay (nothing handed over).
        handed = len(routed.reconfigured)
        api.objects.pop("src")
        await asyncio.sleep(0.12)
        [trouble] = troubles.report()
        assert trouble.message == "the source Secret ns/src does not exist; still using the values read before"
        assert len(routed.reconfigured) == handed
        stop.set()
        await task

    asyncio.run(body())
