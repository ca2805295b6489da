"""What an error of the PostgreSQL sink means to a person (``controller.sources.etcd.errors`` says it for the source):
retried and expected to pass (a server restarting, a connection reset, a serialization failure), or for somebody to
fix (a password, a grant, a missing database, a table altered by hand), in one line that never quotes a credential."""

from __future__ import annotations

import re

from controller.sinks.words import AUTH, PASSES, TLS
from controller.sinks.words import line as _line

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
    if PASSES.search(text):
        return True, f"cannot write the sink: {words}"
    if sqlstate == "54000" and "index row" in text:
        return False, (
            "a key is longer than PostgreSQL can index (about 2,700 bytes, less what compresses): the changes of this "
            f"span cannot be written to this sink (a MySQL sink takes any key): {words}"
        )
    if sqlstate == "42501":
        return False, f"the sink's user lacks a grant (permission denied): {words}"
    if sqlstate[:2] == "42":
        return False, f"a statement of the sink failed (a sink table altered by hand?): {words}"
    if sqlstate[:2] == "28" or AUTH.search(text):
        return False, f"the sink refused the credentials (check the dsn's user and password): {words}"
    if TLS.search(text):
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
