"""The words of failures that mean the same whichever source or sink says them: a TLS verification failure, an
authentication failure, and what passes by itself though it reads like one of those. Pure; each kind's classifier
(``controller.sources.etcd.errors`` for etcd, ``controller.sinks.postgres.errors``, ``controller.sinks.mysql.errors``)
uses them with its own codes."""

from __future__ import annotations

import re

#: Words of a TLS verification failure in gRPC's details (BoringSSL's and gRPC's own) or libpq's message. Not a
#: bare "handshake" (gRPC's "tcp handshaker shutdown" is a host that does not answer) nor "SSL error" (libpq's
#: "SSL error: unexpected eof" is a server restarting).
TLS = re.compile(
    r"(ssl|tls) handshake failed|SSL_ERROR_SSL|certificate verify failed|CERTIFICATE_VERIFY_FAILED|tlsv1 alert|"
    r"unknown ca|bad certificate|certificate has expired|self[- ]signed|hostname mismatch|does not match host name|"
    r"server does not support SSL|WRONG_VERSION_NUMBER",
    re.IGNORECASE,
)
#: Words of what passes by itself though it reads like one of the above: a connection cut mid-handshake (a server
#: restarting), an etcd auth token gone with a restart (the next connection asks for a new one), etcd's auth store
#: moved on meanwhile.
PASSES = re.compile(r"unexpected eof|invalid auth token|auth store is old|connection reset", re.IGNORECASE)
#: Words of an authentication failure, in etcd's and libpq's messages.
AUTH = re.compile(
    r"authentication failed|invalid user ID or password|password authentication|no password supplied|"
    r"no pg_hba.conf entry|role .* does not exist|user name is not found",
    re.IGNORECASE,
)


def line(text: str, limit: int = 240) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
