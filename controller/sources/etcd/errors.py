"""What an error of the etcd source means to a person (each sink says it for itself: ``Sink.trouble``): retried and
expected to pass by itself (a server down, restarting or refusing connections, a connection reset, an expired auth
token), or for somebody to change something (a wrong password, a certificate the other side does not trust, a
missing permission on the span's keys)? And what to say, in one line that names what and where but never a
credential. Pure over the exception (its gRPC status and details); the capture reports the answer on its Lease
(``progress.Trouble``) and the maintainer turns it into the Changefeed's condition SourceUnavailable, reason
``ConfigurationError`` for what is not transient and ``Retrying`` for what is.
"""

from __future__ import annotations

from controller.sinks.words import AUTH, PASSES, TLS
from controller.sources.etcd.connection import describe


def source_trouble(exc: BaseException) -> tuple[bool, str]:
    """(transient, message) of an error of the etcd client (``grpc.aio.AioRpcError`` and what
    ``watch.TRANSPORT`` names)."""
    code = getattr(exc, "code", None)
    name = getattr(code(), "name", "") if callable(code) else ""
    words = describe(exc)
    if PASSES.search(words) or name == "OUT_OF_RANGE":  # OUT_OF_RANGE: compacted under a paged scan, scanned again
        return True, f"cannot read the source: {words}"
    if TLS.search(words):
        return False, f"TLS with the source failed (check the Secret's ca.crt, tls.crt and tls.key): {words}"
    if name in ("UNAUTHENTICATED",) or AUTH.search(words):
        return False, f"the source refused the credentials (check the Secret's username and password): {words}"
    if name == "PERMISSION_DENIED":
        return False, f"the source's user may not read the span's keys (grant it read on them): {words}"
    if name in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNIMPLEMENTED"):
        return False, f"the source refused the request: {words}"
    return True, f"cannot reach the source: {words}"
