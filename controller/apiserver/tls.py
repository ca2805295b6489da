"""HTTPS for the embedded API server: a self-signed certificate made at start, as a real kube-apiserver serves.

A real cluster is reached over TLS only, and a client's TLS connections behave differently from plain ones
(closing one is a shutdown exchange that can outlive the event loop, leaving a transport unclosed);
``start_server(tls=True)`` makes the double serve the same way. The certificate is its own CA (valid for the
host it listens on, ``127.0.0.1`` and ``localhost``), handed to clients in the kubeconfig's
``certificate-authority-data``, so that they verify it as they verify a real cluster's.

Needs the ``cryptography`` package (the ``test`` extra of pyproject.toml).
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificate:
    cert_pem: bytes
    key_pem: bytes


def self_signed(host: str) -> Certificate:
    """A fresh key and a certificate for ``host`` (plus 127.0.0.1 and localhost), valid for a day."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise RuntimeError("the embedded API server's TLS needs the cryptography package (the test extra)") from exc

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cfm-embedded-apiserver")])
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            names.append(x509.DNSName(host))
    else:
        if not address.is_unspecified and str(address) != "127.0.0.1":
            names.append(x509.IPAddress(address))
    start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Certificate(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def server_context(cert: Certificate, directory: Path) -> ssl.SSLContext:
    """A server-side context serving ``cert`` (written to ``directory``, which the caller removes)."""
    cert_path, key_path = directory / "apiserver.crt", directory / "apiserver.key"
    cert_path.write_bytes(cert.cert_pem)
    key_path.touch(mode=0o600)
    key_path.write_bytes(cert.key_pem)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_path, key_path)
    return ctx
