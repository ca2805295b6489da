"""The capture's ``Sources``: a changefeed whose source Secret cannot be used is looked at again after a back-off
(not only at the next full pass, a minute later), and not on every pass meanwhile, however many dispatchers wait."""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any

import pytest

from controller.apiserver.tls import self_signed
from controller.capture import sources
from controller.capture.logs import Notes
from controller.capture.sources import Sources
from controller.dataplane import etcd


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
        return self.objects[name]


class Routed:
    def __init__(self) -> None:
        self.configured: dict[str, Any] = {}

    def configure(self, changefeed: str, endpoints: Any) -> None:
        self.configured[changefeed] = endpoints


def test_a_source_that_cannot_be_used_is_looked_at_again_after_a_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "RETRY", (0.2, 0.4))
    api, routed = Api(), Routed()
    s = Sources(api, "ns", routed, Notes(logging.getLogger("test")))  # type: ignore[arg-type]

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
        endpoints = routed.configured["cf"]
        assert endpoints.etcd == ("https://etcd-0:2379", "https://etcd-1:2379")
        assert endpoints.tls == etcd.Tls(ca=ca.cert_pem, cert=client.cert_pem, key=client.key_pem)
        reads = api.reads
        assert await s.ready("cf")
        assert api.reads == reads  # read once

    asyncio.run(body())
