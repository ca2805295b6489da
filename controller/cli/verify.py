"""``kubectl changefeed verify``: compare etcd at a revision R with the sink, row by row, while writes go on.

The comparison and its argument are in ``controller.dataplane.verify``. This module is the command around
it: the Changefeed (its checkpoint and, raw, ``spec.source.etcd.secretRef`` / ``spec.sink.postgres.secretRef``,
fields the model does not carry yet), its Spans, the two Secrets (or ``--etcd-endpoints`` / ``--dsn``), the
output, and the result recorded on the Changefeed as the annotation ``cdc.maintainer.dev/last-verify``
(``controller.model.verification``), which the maintainer's metrics export.

The DSN and the credentials are never printed: errors say which server failed, not how it was reached.
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from controller.cli import render, validate
from controller.cli.errors import EXIT_FAILED, EXIT_OK, Failed, NotFound, Refused, Usage
from controller.cli.kube import Session
from controller.dataplane import verify as check
from controller.engine.maintainer import REPLICATION_FAILED, SINK_UNAVAILABLE, SOURCE_UNAVAILABLE
from controller.kube.client import RESOURCES, ApiError
from controller.model import resources as conv
from controller.model.states import Kind
from controller.model.verification import LAST_VERIFY_ANNOTATION, Verification
from controller.sinks import api as sinks
from controller.sinks import kinds
from controller.sources.etcd import connection as etcd

JSON = dict[str, Any]
CHANGEFEEDS, SPANS = RESOURCES[Kind.CHANGEFEED], RESOURCES[Kind.SPAN]
#: Bytes of a value shown in a difference.
VALUE_CHARS = 24


def _get(obj: Mapping[str, Any], *path: str) -> Any:
    for p in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(p)  # type: ignore[assignment]
    return obj


def secret_names(cf: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(etcd Secret, sink Secret) the raw Changefeed names, None where it names none."""
    etcd = _get(cf, "spec", "source", "etcd", "secretRef", "name")
    sink = _get(cf, "spec", "sink", sink_kind(cf) or "postgres", "secretRef", "name")
    return (etcd if isinstance(etcd, str) and etcd else None, sink if isinstance(sink, str) and sink else None)


def sink_kind(cf: Mapping[str, Any]) -> str | None:
    """The sink kind the raw Changefeed names (``spec.sink``'s one key), None if it names none."""
    sink = _get(cf, "spec", "sink")
    named = [k for k in kinds.KINDS if isinstance(sink, Mapping) and k in sink]
    return named[0] if named else None


def secret_data(secret: Mapping[str, Any]) -> dict[str, str]:
    """A Secret's ``data`` (base64) decoded, with ``stringData`` over it."""
    out: dict[str, str] = {}
    data = secret.get("data")
    if isinstance(data, Mapping):
        for k, v in data.items():
            try:
                out[str(k)] = base64.b64decode(str(v), validate=True).decode()
            except ValueError:
                continue
    string_data = secret.get("stringData")
    if isinstance(string_data, Mapping):
        out.update({str(k): str(v) for k, v in string_data.items()})
    return out


def endpoints_of(text: str) -> list[str]:
    return [e.strip() for e in text.split(",") if e.strip()]


def short(value: bytes | None) -> str:
    """A value as a short Python bytes literal (``b'abc'``), cut with ``...``; ``-`` for none."""
    if value is None:
        return "-"
    text = repr(value)
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 3] + "..."


def _side(row: check.Row | None) -> str:
    if row is None:
        return "no row"
    return f"deleted @{row.revision}" if row.deleted else f"{short(row.value)} @{row.revision}"


def _etcd_side(kv: check.KV | None) -> str:
    return "no key" if kv is None else f"{short(kv.value)} @{kv.mod_revision}"


def summary(result: check.TableResult, revision: int) -> str:
    n = len(result.differences)
    line = (
        f"table {result.table_id} ({result.mode.value}): {result.keys:,} keys at revision {revision}: "
        f"{n:,} difference{'' if n == 1 else 's'}"
    )
    extras = []
    if result.ahead:
        extras.append(f"{result.ahead:,} rows ahead of {revision} checked at their own revision")
    if result.unverifiable:
        extras.append(f"{result.unverifiable:,} unverifiable (their revision is compacted)")
    if result.absent_downstream:
        extras.append("no table downstream")
    return line + (f" ({'; '.join(extras)})" if extras else "")


def render_result(results: Sequence[check.TableResult], revision: int, limit: int) -> str:
    lines = [summary(r, revision) for r in results]
    diffs = [(r, d) for r in results for d in r.differences]
    if diffs and limit > 0:
        rows = [
            [d.kind.value, r.table_id, r.mode.value, d.key.hex(), d.at, _side(d.row), _etcd_side(d.etcd)]
            for r, d in diffs[:limit]
        ]
        lines += ["", render.table(["KIND", "TABLE", "MODE", "KEY", "AT", "DOWNSTREAM", "ETCD"], rows)]
        if len(diffs) > limit:
            lines.append(f"... and {len(diffs) - limit:,} more (--limit)")
    return "\n".join(lines)


def totals(results: Sequence[check.TableResult], revision: int, now: float) -> Verification:
    return Verification(
        revision=revision,
        differences=sum(len(r.differences) for r in results),
        keys=sum(r.keys for r in results),
        unverifiable=sum(r.unverifiable for r in results),
        at=now,
    )


#: The conditions that say why a changefeed's checkpoint does not move.
STUCK = (SOURCE_UNAVAILABLE, SINK_UNAVAILABLE, REPLICATION_FAILED)


def choose_revision(checkpoint: int, wanted: int | None, changefeed: str, why: str = "") -> int:
    """The revision to compare at. ``why``: what the Changefeed's conditions say keeps its checkpoint from moving."""
    if checkpoint <= 0:
        because = why or "no capture reports a trouble: its dispatchers may still be scanning"
        raise Refused(
            f"changefeed {changefeed!r} has no checkpoint yet (status.checkpointTs): nothing to verify ({because})"
        )
    if wanted is None:
        return checkpoint
    if wanted <= 0:
        raise Refused(f"--revision must be positive, got {wanted}")
    if wanted > checkpoint:
        raise Refused(
            f"--revision {wanted} is above the changefeed's checkpoint {checkpoint}: the sink need not have it yet"
        )
    return wanted


async def _read_secret(session: Session, name: str, what: str) -> dict[str, str]:
    with session.errors(f"reading Secret {name!r} ({what})"):
        try:
            secret = await session.client.request(
                "get", "GET", f"/api/v1/namespaces/{session.namespace}/secrets/{name}"
            )
        except ApiError as exc:
            if exc.status == 404:
                raise NotFound(
                    f"Secret {name!r} ({what}) not found in namespace {session.namespace!r} "
                    "(or this API serves no Secrets: pass --etcd-endpoints / --dsn)"
                ) from None
            raise
    return secret_data(secret)


def _tls_files(args: argparse.Namespace) -> etcd.Tls:
    """``--etcd-cacert`` / ``--etcd-cert`` / ``--etcd-key`` (etcdctl's ``--cacert``, ``--cert``, ``--key``)."""
    pem: dict[str, bytes | None] = {}
    for flag in ("cacert", "cert", "key"):
        path = getattr(args, f"etcd_{flag}", None)
        try:
            pem[flag] = Path(path).read_bytes() if path else None
        except OSError as exc:
            raise Usage(f"--etcd-{flag}: cannot read {path}: {exc.strerror}") from None
    return etcd.Tls(ca=pem["cacert"], cert=pem["cert"], key=pem["key"])


async def _connection(
    session: Session, args: argparse.Namespace, cf: JSON, name: str
) -> tuple[list[str], str | None, str | None, etcd.Tls, sinks.Sink]:
    """etcd endpoints, username, password, TLS and the sink: the flags, else the Secrets the Changefeed names."""
    etcd_secret, sink_secret = secret_names(cf)
    username = password = None
    if args.etcd_endpoints:
        endpoints = endpoints_of(args.etcd_endpoints)
        tls = _tls_files(args)
    elif etcd_secret:
        if any(getattr(args, f"etcd_{flag}", None) for flag in ("cacert", "cert", "key")):
            raise Usage("--etcd-cacert, --etcd-cert and --etcd-key go with --etcd-endpoints (else the Secret's own)")
        data = await _read_secret(session, etcd_secret, "the etcd source")
        endpoints = endpoints_of(data.get("endpoints", ""))
        username, password = data.get("username") or None, data.get("password") or None
        tls = etcd.tls_of(data)
        if not endpoints:
            raise Refused(f"Secret {etcd_secret!r} has no key 'endpoints' (comma-separated host:port)")
    else:
        raise Refused(f"changefeed {name!r} names no etcd source (spec.source.etcd.secretRef): pass --etcd-endpoints")
    kind = sink_kind(cf) or ("mysql" if str(args.dsn or "").startswith("mysql://") else "postgres")
    if args.dsn:
        data = {"dsn": str(args.dsn)}
    elif sink_secret:
        data = await _read_secret(session, sink_secret, f"the {kind} sink")
    else:
        raise Refused(f"changefeed {name!r} names no sink (spec.sink.postgres or spec.sink.mysql): pass --dsn")
    try:
        sink = kinds.from_secret(kind, name, data)
    except sinks.Unusable as exc:
        where = "--dsn" if args.dsn else f"Secret {sink_secret!r}"
        raise Refused(f"{where}: {exc}") from None
    return endpoints, username, password, tls, sink


async def _record(session: Session, name: str, result: Verification) -> None:
    """The result as the Changefeed's annotation; a failure to write it is a warning, not the verdict."""
    patch = {"metadata": {"annotations": {LAST_VERIFY_ANNOTATION: result.to_json()}}}
    try:
        with session.errors(f"recording the result on Changefeed {name!r}"):
            await session.client.patch(CHANGEFEEDS, session.namespace, name, patch)
    except (Failed, NotFound, Refused) as exc:
        print(f"warning: {exc.message} (the result above stands)", file=sys.stderr)


async def verify(session: Session, args: argparse.Namespace) -> int:
    items = await session.list(CHANGEFEEDS)
    by_name = {str(_get(o, "metadata", "name")): o for o in items}
    name = validate.resolve_changefeed(sorted(by_name), args.changefeed, session.namespace)
    raw = by_name[name]
    try:
        cf = conv.changefeed_from_resource(raw)
    except conv.InvalidResource as exc:
        raise Failed(str(exc)) from None
    why = "; ".join(f"{c.type}: {c.message}" for c in cf.conditions if c.type in STUCK and c.status == "True")
    revision = choose_revision(cf.checkpoint_ts, args.revision, name, why)
    endpoints, username, password, tls, sink = await _connection(session, args, raw, name)
    snap = await session.snapshot((CHANGEFEEDS, SPANS))
    for w in snap.warnings:
        print(f"warning: {w}", file=sys.stderr)
    spans = [check.SpanToVerify(s.table_id, s.mode, s.key_range, s.name) for s in snap.spans_of(name)]
    if not spans:
        raise Refused(f"changefeed {name!r} has no spans: nothing to verify")
    try:
        async with check.EtcdReader(endpoints, username, password, tls=tls) as reader:
            # The default revision (the checkpoint, read before the sink's snapshot) is raised to the tables'
            # tombstone horizon if one passed it meanwhile; one asked for is refused below it (check.verify).
            results = await check.verify(reader, sink, revision, spans, raise_to_horizon=args.revision is None)
    except check.VerifyError as exc:
        raise (Refused if exc.refused else Failed)(str(exc)) from None
    except ValueError as exc:  # e.g. a DSN libpq cannot parse (psycopg raises ProgrammingError, a psycopg.Error)
        raise Usage(f"cannot use the connection settings: {type(exc).__name__}") from None
    compared = max((r.revision for r in results), default=revision)
    if compared != revision:
        print(
            f"note: compared at revision {compared}, not the checkpoint {revision} read before: the sink's tombstones "
            f"at or below {compared} were collected meanwhile (its tombstone horizon)",
            file=sys.stderr,
        )
        revision = compared
    print(render_result(results, revision, args.limit), flush=True)
    result = totals(results, revision, time.time())
    await _record(session, name, result)
    return EXIT_OK if result.differences == 0 else EXIT_FAILED
