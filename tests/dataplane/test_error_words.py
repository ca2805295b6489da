"""What an error of the source (``controller.sources.etcd.errors``) or a sink (its ``errors`` module) means to a
person (retried and expected to pass, or a configuration to fix), in words that say what and where and never quote a
credential."""

from __future__ import annotations

import grpc
import psycopg
import pytest

from controller.sinks.postgres.errors import sink_trouble
from controller.sources.etcd.errors import source_trouble


class RpcError(Exception):
    """What the etcd client raises: a gRPC status and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


U = grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("code", "details", "transient", "starts"),
    [
        (U, "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2: Failed to connect to remote "
            "host: Connection refused", True, "cannot reach the source"),
        (U, "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:10.0.0.9:2379: tcp handshaker shutdown",
         True, "cannot reach the source"),
        (U, "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: Ssl handshake failed: "
            "SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED", False,
         "TLS with the source failed"),
        (U, "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: Tls handshake failed "
            "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:10000412:SSL routines:OPENSSL_internal:SSLV3_ALERT_BAD_"
            "CERTIFICATE", False, "TLS with the source failed"),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: authentication failed, invalid user ID or password", False,
         "the source refused the credentials"),
        (grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token", True, "cannot read the source"),
        (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", False, "the source's user may not read"),
        (grpc.StatusCode.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted", True,
         "cannot read the source"),
    ],
)  # fmt: skip
def test_source_errors(code: grpc.StatusCode, details: str, transient: bool, starts: str) -> None:
    got = source_trouble(RpcError(code, details))
    assert got[0] is transient, got
    assert got[1].startswith(starts), got


def operational(message: str, sqlstate: str | None = None) -> psycopg.Error:
    exc = psycopg.OperationalError(message)
    if sqlstate:
        exc.sqlstate = sqlstate  # type: ignore[misc]
    return exc


DSN = "host=pg.db port=5432 dbname=cdc user=cdc password=hunter2"


@pytest.mark.parametrize(
    ("exc", "transient", "starts"),
    [
        (operational('connection failed: connection to server at "127.0.0.1", port 5433 failed: Connection refused'),
         True, "cannot write the sink"),
        (operational('connection failed: FATAL:  password authentication failed for user "cdc"', "28P01"), False,
         "the sink refused the credentials"),
        (operational('connection failed: FATAL:  database "nope" does not exist'), False,
         "the sink refused the transaction"),
        (operational("consuming input failed: SSL error: unexpected eof while reading"), True, "cannot write the sink"),
        (operational("connection failed: SSL error: certificate verify failed"), False, "TLS with the sink failed"),
        (psycopg.errors.InsufficientPrivilege("permission denied for database cdc"), False, "the sink's user lacks"),
        (psycopg.errors.UndefinedColumn('column "revision" does not exist'), False,
         "a statement of the sink failed (a sink table altered by hand?)"),
        (psycopg.errors.SerializationFailure("could not serialize access"), True, "cannot write the sink"),
        (psycopg.errors.DiskFull("could not extend file"), False, "the sink refused the transaction"),
        (OSError("Connection reset by peer"), True, "cannot write the sink"),
    ],
)  # fmt: skip
def test_sink_errors(exc: BaseException, transient: bool, starts: str) -> None:
    got = sink_trouble(exc, DSN)
    assert got[0] is transient, got
    assert got[1].startswith(starts), got


def test_no_credential_is_quoted() -> None:
    """libpq quotes what it could not use: a password that spilled into a URI's host (an ``@`` not encoded) or any
    value but where the DSN points is cut out."""
    dsn = "postgresql://bob:p@ss@db/x"
    exc = operational("connection failed: failed to resolve host 'ss@db': Name or service not known")
    got = sink_trouble(exc, dsn)
    assert "ss@db" not in got[1]
    assert "<hidden>@db" in got[1]
    leaky = operational("connection failed: FATAL:  the password hunter2 is wrong")
    assert "hunter2" not in sink_trouble(leaky, DSN)[1]


@pytest.mark.parametrize(
    ("number", "words", "transient", "said"),
    [
        (1045, "Access denied for user 'u'@'10.0.0.1' (using password: YES)", False, "refused the credentials"),
        (1142, "INSERT command denied to user 'u'@'%' for table 't1'", False, "lacks a grant"),
        (1054, "Unknown column 'v' in 'field list'", False, "altered by hand"),
        (1146, "Table 'cfm_cf.t1' doesn't exist", False, "altered by hand"),
        (1153, "Got a packet bigger than 'max_allowed_packet' bytes", False, "refused the transaction"),
        (1290, "The MariaDB server is running with the --read-only option", False, "refused the transaction"),
        (2003, "Can't connect to MySQL server on '127.0.0.1' (111)", True, "cannot write the sink"),
        (2013, "Lost connection to MySQL server during query", True, "cannot write the sink"),
        (1213, "Deadlock found when trying to get lock; try restarting transaction", True, "cannot write the sink"),
        (1205, "Lock wait timeout exceeded; try restarting transaction", True, "cannot write the sink"),
        (2026, "SSL connection error: certificate verify failed", False, "TLS with the sink failed"),
    ],
)
def test_mysql_errors(number: int, words: str, transient: bool, said: str) -> None:
    import asyncmy.errors

    from controller.sinks.mysql.errors import sink_trouble as mysql_trouble

    got = mysql_trouble(asyncmy.errors.OperationalError(number, words + " s3cret"), "s3cret")
    assert got[0] is transient, got
    assert said in got[1], got
    assert "s3cret" not in got[1]
    assert str(number) in got[1]
