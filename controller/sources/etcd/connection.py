"""A connection to an etcd source: plaintext or TLS, with or without a username (the capture's runtime and verify).

aetcd (pinned, docs/architecture.md "Data plane") supplies the generated gRPC stubs and messages; its ``Client``
opens only plaintext channels (``grpc.aio.insecure_channel``, aetcd 1.0.0), so the channel is opened here, with
``grpc.ssl_channel_credentials`` for an ``https://`` endpoint, and the stubs are aetcd's.

What a source Secret may hold (the Kubernetes ``kubernetes.io/tls`` key names, so a cert-manager Certificate's
Secret can be merged in as it is):

- ``endpoints``: comma-separated, all ``http://`` / bare ``host:port`` (plaintext) or all ``https://`` (TLS);
- ``username`` and ``password``: etcd's own authentication (a token asked for at connect);
- ``ca.crt``: the CA bundle (PEM) that signed the server's certificate; without it, the system's roots;
- ``tls.crt`` and ``tls.key``: a client certificate and its key (PEM), for an etcd that asks for one
  (``--client-cert-auth``). One without the other is refused.

The server's certificate must name the endpoint's host (a DNS name or IP SAN), as etcdctl requires.
"""

from __future__ import annotations

import re
import ssl
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # grpc is imported when a connection is opened: the plugin's other verbs never load it
    import grpc
    import grpc.aio

#: Never through an ``http_proxy`` from the environment.
CHANNEL_OPTIONS = (("grpc.enable_http_proxy", 0),)


@dataclass(frozen=True)
class Tls:
    """TLS material for an etcd source (PEM bytes). Never printed: see ``__repr__``."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    def __repr__(self) -> str:
        return f"Tls(ca={'set' if self.ca else 'system roots'}, client certificate={'set' if self.cert else 'none'})"

    __str__ = __repr__

    def credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def tls_of(data: Mapping[str, str]) -> Tls:
    """The TLS keys of a source Secret's data (decoded): ``ca.crt``, ``tls.crt``, ``tls.key``."""

    def pem(key: str) -> bytes | None:
        value = data.get(key) or ""
        return value.encode() if value.strip() else None

    return Tls(ca=pem("ca.crt"), cert=pem("tls.crt"), key=pem("tls.key"))


def describe(exc: BaseException) -> str:
    """An error of the etcd client in one short line, for a log: gRPC's status and details (e.g. "UNAVAILABLE:
    failed to connect to all addresses; ... Tls handshake failed"), which name the endpoint, never a credential."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        status = code()
        text = f"{getattr(status, 'name', status)}: {details() or ''}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def secure(endpoints: Sequence[str]) -> bool:
    return any(e.strip().lower().startswith("https://") for e in endpoints)


def problem(endpoints: Sequence[str], tls: Tls | None = None) -> str | None:
    """Why this source cannot be used as given, or None: an empty list, an endpoint that is not ``host:port``, a
    mix of plaintext and TLS endpoints (one channel kind serves all of them), a client certificate without its key
    (or the reverse), TLS material given for plaintext endpoints (most likely a forgotten ``https://``), PEM that
    does not load (a CA bundle, a certificate and its unencrypted key)."""
    if not endpoints:
        return "no etcd endpoint"
    for e in endpoints:
        try:
            host_port(e)
        except ValueError as exc:
            return str(exc)
    schemes = {e.strip().lower().startswith("https://") for e in endpoints}
    if len(schemes) > 1:
        return "the etcd endpoints mix http:// and https://: use one scheme for all of them"
    tls = tls or Tls()
    if bool(tls.cert) != bool(tls.key):
        return "a client certificate (tls.crt) needs its key (tls.key), and the key its certificate"
    if not schemes.pop() and (tls.ca or tls.cert):
        return "TLS material (ca.crt, tls.crt) is given for http:// endpoints: use https:// endpoints for TLS"
    return _loads(tls)


_HOST = re.compile(r"[A-Za-z0-9_.-]+")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]+")


def host_port(endpoint: str) -> tuple[str, int]:
    """``host`` and ``port`` of ``http://host:port``, ``https://host:port``, ``host:port`` or ``host`` (port 2379);
    an IPv6 address in brackets. ValueError for anything else (a path, a second scheme, credentials, an IPv6
    address without brackets), its message never quoting a ``user:password@`` part."""
    text = endpoint.strip()
    if "@" in text:
        raise ValueError(
            "an etcd endpoint holds a user name or password (user@host): put them in the Secret's username and "
            "password keys"
        )
    lower = text.lower()
    for scheme in ("http://", "https://"):
        if lower.startswith(scheme):
            text = text[len(scheme) :]
            break
    text = text.removesuffix("/")
    bad = ValueError(f"etcd endpoint {endpoint.strip()!r} is not host:port")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if not _IPV6.fullmatch(host) or (rest and not rest.startswith(":")):
            raise bad
        port = rest[1:] if rest else "2379"
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            host, port = text, "2379"
        if not _HOST.fullmatch(host):
            raise bad  # also a second scheme, a path, or an IPv6 address without brackets
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise bad
    return host, int(port)


def _loads(tls: Tls) -> str | None:
    """Why ``tls``'s PEM cannot be used, or None: the CA bundle and the certificate with its key loaded as the
    client would load them (never quoting them)."""
    if tls.ca:
        try:
            ssl.create_default_context(cadata=tls.ca.decode(errors="replace"))
        except (ssl.SSLError, ValueError):
            return "ca.crt is not a PEM CA certificate (bundle)"
    if tls.cert and tls.key:
        with tempfile.TemporaryDirectory(prefix="cfm-tls-") as directory:
            cert, key = Path(directory) / "tls.crt", Path(directory) / "tls.key"
            for path, data in ((cert, tls.cert), (key, tls.key)):
                path.touch(mode=0o600)
                path.write_bytes(data)
            try:
                ssl.create_default_context().load_cert_chain(cert, key)
            except (ssl.SSLError, ValueError):
                return "tls.crt and tls.key are not a PEM certificate and its (unencrypted) private key"
    return None


class Connection:
    """One gRPC channel to one etcd endpoint, authenticated if a username is given: ``channel``, ``kvstub`` and
    ``metadata`` (the auth token, or None), what aetcd's ``Client`` offers and this code uses."""

    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] | None) -> None:
        import aetcd.rpc

        self.channel = channel
        self.metadata = metadata
        self.kvstub: Any = aetcd.rpc.KVStub(channel)

    @classmethod
    async def open(
        cls,
        endpoint: str,
        *,
        username: str | None = None,
        password: str | None = None,
        tls: Tls | None = None,
        auth_timeout: float = 10.0,
    ) -> Connection:
        """Open a channel to ``endpoint`` (TLS for ``https://``) and, with a username, ask for a token. Raises what
        gRPC raises (``grpc.aio.AioRpcError``) when the server cannot be reached or refuses."""
        import aetcd.rpc
        import grpc.aio

        host, port = host_port(endpoint)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if secure([endpoint]):
            channel = grpc.aio.secure_channel(target, (tls or Tls()).credentials(), options=CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        metadata = None
        try:
            if username is not None and password is not None:
                answer = await aetcd.rpc.AuthStub(channel).Authenticate(
                    aetcd.rpc.AuthenticateRequest(name=username, password=password), timeout=auth_timeout
                )
                metadata = (("token", answer.token),)
        except BaseException:
            await channel.close()
            raise
        return cls(channel, metadata)

    async def close(self) -> None:
        await self.channel.close()
