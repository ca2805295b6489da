"""The embedded API's namespace controller takes a realistic moment, and the server can serve HTTPS (issue 36).

On a real v1.36 cluster the namespace controller deleted a Terminating namespace's Leases and marked its
Changefeed about 5 s after the namespace's DELETE; the double's waits ``namespace_delay`` (default
``NAMESPACE_DELAY``) before its first pass, so that a client that expects the marks at once fails here too.
With ``tls=True`` the double serves HTTPS with a self-signed certificate that its kubeconfig carries as CA.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import urllib.error
import urllib.request

import pytest

from controller.apiserver import start_server
from controller.apiserver.__main__ import main as apiserver_main
from controller.apiserver.controllers import NAMESPACE_DELAY
from controller.kube.client import ApiError, Client, Config

CM = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "finalizers": ["cfm.test/hold"]}}


async def gone(client: Client, path: str) -> bool:
    try:
        await client.request("get", "GET", path)
    except ApiError as exc:
        if exc.not_found:
            return True
        raise
    return False


def test_the_namespace_controller_acts_a_realistic_moment_after_the_deletion() -> None:
    assert NAMESPACE_DELAY == 5.0  # what a real v1.36 cluster took
    handle = start_server(None)

    async def scenario() -> None:
        async with Client(Config(url=handle.url)) as client:
            ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}}
            await client.request("create", "POST", "/api/v1/namespaces", body=ns)
            await client.request("create", "POST", "/api/v1/namespaces/team/configmaps", body=CM)
            deleted = time.monotonic()
            out = await client.request("delete", "DELETE", "/api/v1/namespaces/team")
            assert out["status"]["phase"] == "Terminating"
            await asyncio.sleep(1.0)
            cm = await client.request("get", "GET", "/api/v1/namespaces/team/configmaps/cm")
            assert "deletionTimestamp" not in cm["metadata"], "marked before the namespace controller's moment"
            while "deletionTimestamp" not in cm["metadata"]:
                assert time.monotonic() - deleted < 60, "never marked"
                await asyncio.sleep(0.1)
                cm = await client.request("get", "GET", "/api/v1/namespaces/team/configmaps/cm")
            assert time.monotonic() - deleted >= NAMESPACE_DELAY
            # From then on it follows the content at once: the finalizer's removal lets the namespace go.
            patch = {"metadata": {"finalizers": None}}
            await client.request(
                "patch", "PATCH", "/api/v1/namespaces/team/configmaps/cm", body=patch,
                content_type="application/merge-patch+json",
            )  # fmt: skip
            while not await gone(client, "/api/v1/namespaces/team"):
                assert time.monotonic() - deleted < 60, "the namespace never went"
                await asyncio.sleep(0.1)

    try:
        asyncio.run(scenario())
    finally:
        handle.stop()


def test_the_delay_is_configurable_and_not_negative() -> None:
    handle = start_server(None, namespace_delay=0.0)

    async def scenario() -> None:
        async with Client(Config(url=handle.url)) as client:
            ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "quick"}}
            await client.request("create", "POST", "/api/v1/namespaces", body=ns)
            await client.request("delete", "DELETE", "/api/v1/namespaces/quick")
            for _ in range(600):
                if await gone(client, "/api/v1/namespaces/quick"):
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("the empty namespace never went")

    try:
        asyncio.run(scenario())
    finally:
        handle.stop()
    with pytest.raises(ValueError, match="namespace_delay must not be negative"):
        start_server(None, namespace_delay=-1)
    with pytest.raises(SystemExit) as exit_:
        apiserver_main(["--namespace-delay", "-1"])
    assert exit_.value.code == 2


def test_over_tls_the_kubeconfig_verifies_the_server() -> None:
    handle = start_server(None, tls=True)
    try:
        assert handle.url.startswith("https://127.0.0.1:")
        assert handle.ca_pem is not None
        # The kubeconfig's CA verifies the server (hostname 127.0.0.1 included), as a real cluster's does.
        config = Config.load(str(handle.kubeconfig_path))
        assert (config.url, config.verify) == (handle.url, True)

        async def scenario() -> None:
            async with Client(config) as client:
                out = await client.request("list", "GET", "/api/v1/namespaces")
                assert out["kind"] == "NamespaceList"

        asyncio.run(scenario())
        # Without the CA the certificate is refused; plain HTTP is not served.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(handle.url + "/version", context=ssl.create_default_context(), timeout=10)
        plain = handle.url.replace("https://", "http://")
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(plain + "/version", timeout=10).read()
    finally:
        handle.stop()
