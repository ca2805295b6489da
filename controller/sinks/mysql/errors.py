"""What an error of the MySQL sink means to a person: retried and expected to pass (a server down or restarting, a
connection lost, a deadlock, a lock wait timeout, too many connections), or for somebody to fix (credentials, a grant,
TLS, a table altered by hand, a value too large for the server's ``max_allowed_packet``, a read-only server), in one
line that never quotes the password."""

from __future__ import annotations

from controller.sinks.words import AUTH, PASSES, TLS
from controller.sinks.words import line as _line

#: Server error codes (MySQL's and MariaDB's share them).
ACCESS_DENIED = 1045  # wrong user or password
DB_ACCESS_DENIED = 1044
TABLE_ACCESS_DENIED = 1142  # a grant missing
COLUMN_ACCESS_DENIED = 1143
SPECIFIC_ACCESS_DENIED = 1227
BAD_DB = 1049
NO_SUCH_TABLE = 1146
BAD_FIELD = 1054  # a column renamed by hand
PACKET_TOO_LARGE = 1153
DATA_TOO_LONG = 1406
READ_ONLY = 1290  # --read-only (a replica)
DISK_FULL = 1021
RECORD_FILE_FULL = 1114
#: Codes a person must act on.
_GRANTS = {DB_ACCESS_DENIED, TABLE_ACCESS_DENIED, COLUMN_ACCESS_DENIED, SPECIFIC_ACCESS_DENIED}
_ALTERED = {NO_SUCH_TABLE, BAD_FIELD, 1364, 1136, 1062, 1048}  # missing table or column, no default, counts, dup, null
_REFUSED = {PACKET_TOO_LARGE, DATA_TOO_LONG, READ_ONLY, DISK_FULL, RECORD_FILE_FULL, BAD_DB, 1064}
#: Client error codes: 2026, a TLS failure.
SSL_CONNECTION_ERROR = 2026


def code(exc: BaseException) -> int:
    """The MySQL error number of ``exc`` (0 if it has none): asyncmy's errors carry (number, message) in ``args``."""
    args = getattr(exc, "args", ())
    return int(args[0]) if args and isinstance(args[0], int) else 0


def sink_trouble(exc: BaseException, password: str = "") -> tuple[bool, str]:
    """(transient, message) of an error of the MySQL sink (asyncmy's errors, ``OSError``, ``TimeoutError``)."""
    number = code(exc)
    args: tuple[object, ...] = tuple(getattr(exc, "args", ()))
    text = _line(str(args[1]) if len(args) > 1 else str(exc))
    if password:
        text = text.replace(password, "<hidden>")
    words = f"{type(exc).__name__} {number}: {text}" if number else f"{type(exc).__name__}: {text}"
    if number == ACCESS_DENIED or (AUTH.search(text) and not PASSES.search(text)):
        return False, f"the sink refused the credentials (check the dsn's user and password): {words}"
    if number in _GRANTS:
        return False, f"the sink's user lacks a grant (it needs ALL on cfm\\_%.* or on cfm_<changefeed>.*): {words}"
    if number == SSL_CONNECTION_ERROR or TLS.search(text) or type(exc).__name__.startswith("SSL"):
        return False, f"TLS with the sink failed (check the dsn's ssl-mode and the Secret's ca.crt, tls.crt): {words}"
    if number in _ALTERED:
        return False, f"a statement of the sink failed (a sink table altered by hand?): {words}"
    if number in _REFUSED:
        return False, f"the sink refused the transaction: {words}"
    return True, f"cannot write the sink: {words}"
