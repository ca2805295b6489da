"""What an error of the source or the sink means to a person: is it retried and expected to pass by itself
(transient: a server down, restarting or refusing connections, a connection reset, a serialization failure), or
must somebody change something (a wrong password, a certificate the other side does not trust, a missing grant,
a table altered by hand)? And what to say, in one line that names what and where but never a credential.

Both functions are pure over the exception (its gRPC status and details, or PostgreSQL's SQLSTATE and message);
the capture reports their answer on its Lease (``progress.Trouble``) and the maintainer turns it into the
Changefeed's conditions SourceUnavailable and SinkUnavailable, whose reason is ``ConfigurationError`` for what is
not transient and ``Retrying`` for what is.
"""

from __future__ import annotations

import re

from controller.dataplane.etcd import describe

#: Words of a TLS verification failure in gRPC's details (BoringSSL's and gRPC's own) or libpq's message. Not a
#: bare "handshake" (gRPC's "tcp handshaker shutdown" is a host that does not answer) nor "SSL error" (libpq's
#: "SSL error: unexpected eof" is a server restarting).
_TLS = re.compile(
    r"(ssl|tls) handshake failed|SSL_ERROR_SSL|certificate verify failed|CERTIFICATE_VERIFY_FAILED|tlsv1 alert|"
    r"unknown ca|bad certificate|certificate has expired|self[- ]signed|hostname mismatch|does not match host name|"
    r"server does not support SSL|WRONG_VERSION_NUMBER",
    re.IGNORECASE,
)
#: Words of what passes by itself though it reads like one of the above: a connection cut mid-handshake (a server
#: restarting), an etcd auth token gone with a restart (the next connection asks for a new one), etcd's auth store
#: moved on meanwhile.
_PASSES = re.compile(r"unexpected eof|invalid auth token|auth store is old|connection reset", re.IGNORECASE)
#: Words of an authentication failure, in etcd's and libpq's messages.
_AUTH = re.compile(
    r"authentication failed|invalid user ID or password|password authentication|no password supplied|"
    r"no pg_hba.conf entry|role .* does not exist|user name is not found",
    re.IGNORECASE,
)


def _line(text: str, limit: int = 240) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def source_trouble(exc: BaseException) -> tuple[bool, str]:
    """(transient, message) of an error of the etcd client (``grpc.aio.AioRpcError`` and what
    ``etcdwatch.TRANSPORT`` names)."""
    code = getattr(exc, "code", None)
    name = getattr(code(), "name", "") if callable(code) else ""
    words = describe(exc)
    if _PASSES.search(words) or name == "OUT_OF_RANGE":  # OUT_OF_RANGE: compacted under a paged scan, scanned again
        return True, f"cannot read the source: {words}"
    if _TLS.search(words):
        return False, f"TLS with the source failed (check the Secret's ca.crt, tls.crt and tls.key): {words}"
    if name in ("UNAUTHENTICATED",) or _AUTH.search(words):
        return False, f"the source refused the credentials (check the Secret's username and password): {words}"
    if name == "PERMISSION_DENIED":
        return False, f"the source's user may not read the span's keys (grant it read on them): {words}"
    if name in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNIMPLEMENTED"):
        return False, f"the source refused the request: {words}"
    return True, f"cannot reach the source: {words}"


#: SQLSTATE classes (their first two characters) that a person must act on: authorization (28), a missing database
#: (3D), an access rule or syntax (42: a grant missing, a table or column altered by hand), a data exception (22), an
#: integrity constraint (23: a constraint added by hand), insufficient resources (53: a disk full), a configuration
#: file error (F0).
_NEEDS_A_PERSON = {"28", "3D", "42", "22", "23", "53", "F0"}


def sink_trouble(exc: BaseException, dsn: str = "") -> tuple[bool, str]:
    """(transient, message) of an error of the PostgreSQL sink (``psycopg.Error`` or ``OSError``). Every value of
    ``dsn`` but where it points (host, port, database, user) is cut out of the words: libpq may quote what it could
    not use (a password that spilled into the host of a URI whose ``@`` was not percent-encoded)."""
    sqlstate = getattr(exc, "sqlstate", None) or ""
    text = _scrub(_line(str(exc)), dsn)
    words = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if _PASSES.search(text):
        return True, f"cannot write the sink: {words}"
    if sqlstate == "42501":
        return False, f"the sink's user lacks a grant (permission denied): {words}"
    if sqlstate[:2] == "42":
        return False, f"a statement of the sink failed (a sink table altered by hand?): {words}"
    if sqlstate[:2] == "28" or _AUTH.search(text):
        return False, f"the sink refused the credentials (check the dsn's user and password): {words}"
    if _TLS.search(text):
        return False, f"TLS with the sink failed (check the dsn's sslmode, sslrootcert, sslcert and sslkey): {words}"
    if sqlstate[:2] in _NEEDS_A_PERSON or _MISSING_DATABASE.search(text):
        return False, f"the sink refused the transaction: {words}"
    if type(exc).__name__ == "ProgrammingError" and not sqlstate:
        # libpq's words about a malformed connection string may quote part of it (a password): not repeated.
        return False, "the sink's dsn is not a libpq connection string (key=value ...) nor a postgresql:// URI"
    return True, f"cannot write the sink: {words}"


#: libpq's words for a database that does not exist, at connect time (no SQLSTATE reaches psycopg then).
_MISSING_DATABASE = re.compile(r'database ".*" does not exist', re.IGNORECASE)
#: The connection parameters that say where, not who: kept in a message.
_WHERE = {"host", "hostaddr", "port", "dbname", "user"}


def _scrub(text: str, dsn: str) -> str:
    if not dsn:
        return text
    try:
        import psycopg.conninfo

        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except Exception:  # a DSN that does not parse: nothing of it is quoted anywhere but here
        return text
    for key, value in params.items():
        if key in _WHERE or not value:
            continue
        text = text.replace(str(value), "<hidden>")
    host = str(params.get("host") or "")
    if "@" in host:  # a password spilled into the host (a URI's unencoded "@"): only what follows the last "@"
        text = text.replace(host, "<hidden>@" + host.rsplit("@", 1)[1])
    return text
