"""Verify a changefeed online, row by row: etcd's state at a revision R against the sink's rows.

``kubectl changefeed verify`` (controller/cli) picks R and the spans; this module compares. TiCDC needs a
syncpoint barrier and a snapshot-capable downstream for such a check; etcd's MVCC makes it exact without
stopping anything: etcd answers a read *at* any revision it has not compacted, and every downstream row
carries the etcd ``mod_revision`` of the change it holds (each sink's layout: controller/sinks/api.py).

The argument. The changefeed's checkpoint (``status.checkpointTs``, for an etcd source the etcd revision
itself) says that every dispatcher has applied every change of its span with revision <= checkpoint, in
transactions committed before the checkpoint was reported. Choose R <= checkpoint. A snapshot of the sink
taken after the checkpoint was read (one REPEATABLE READ transaction over every span) therefore holds, for
every key, a row at least as new as the key's last change at or before R, possibly newer (the sink runs
ahead while writes continue; a row never moves backwards, ``schema.APPLY``). So, for each span:

- a downstream row with ``revision <= R`` is the key's last change at or before R, and must say what etcd
  says at R: a live row, that etcd holds the key at R with the same value and ``mod_revision ==
  row.revision`` (else **mismatch**; etcd holding no key at R: **extra**); a tombstone at revision d, that
  etcd holds no key at R (etcd holding it with ``mod_revision > d``: the put after the delete never
  arrived, **missing**; with ``mod_revision <= d``: downstream deleted a key etcd did not delete at d,
  **mismatch**);
- a downstream row with ``revision > R`` must say what etcd says *at its own revision* (a point read at
  ``row.revision``): a live row, that etcd holds the key there with that value and ``mod_revision ==
  row.revision`` (absent: **extra**, different: **mismatch**); a tombstone, that etcd holds no key there
  (else **mismatch**). A revision etcd has compacted cannot be read: the row is counted **unverifiable**,
  which is not a difference;
- every key etcd holds at R must have a downstream row (any row ahead of R, or one at or below R judged
  above): else **missing**.

Only the changefeed's spans are read: rows and keys outside every span, and tables of the sink no span
names, are ignored. Spans that are not Replicating are compared all the same: once the checkpoint has
passed R, their data up to R must be there.

Collected tombstones (``controller.dataplane.horizon``). A table's tombstones at or below its horizon H are
deleted, and H never exceeds a published checkpoint. The snapshot reads every horizon with the rows; a tombstone
missing from it was deleted after a horizon at or above its revision d had committed, so d <= the H the snapshot
shows. With R >= H, etcd at R holds no such key either, unless it was put again after d and at or before R, and
that put is committed in the sink (R <= a checkpoint): the key has a row. No "missing" is false. So R must be at
or above every horizon of the spans' tables: :func:`verify` refuses a lower one, or (``raise_to_horizon``, for a
default R) raises it to the highest horizon, which is at most a checkpoint published before the snapshot (the
capture wrote it after reading that checkpoint), so every change up to it is in the snapshot.

The comparison (:func:`compare`, :func:`needs_point_read`) is pure, over :class:`Row` and :class:`KV`;
:class:`EtcdReader` and :func:`read_rows` are the I/O (aetcd's KV stub with ``revision=``, psycopg 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller.model.keys import KeyRange
from controller.model.states import Mode
from controller.sinks.api import Sink, StoredRow
from controller.sources.etcd import connection as etcd

#: Keys per page of etcd's range read at R.
PAGE = 1000
#: Point reads (rows ahead of R) in flight at once.
POINT_READS = 32


#: A downstream row (``Snapshot.rows``).
Row = StoredRow


@dataclass(frozen=True, slots=True)
class KV:
    """A key as etcd holds it at some revision."""

    key: bytes
    value: bytes
    mod_revision: int


class Compacted(enum.Enum):
    """A point read at a revision etcd has compacted."""

    COMPACTED = "compacted"


COMPACTED = Compacted.COMPACTED
#: What a point read at a row's revision found: the key there, None (absent there), or COMPACTED.
PointRead = KV | None | Compacted


class DiffKind(enum.StrEnum):
    MISSING = "missing"  # etcd holds the key at R; downstream has no row for it (or a tombstone older than the put)
    EXTRA = "extra"  # downstream holds a live row for a key etcd did not hold (at R, or at the row's revision)
    MISMATCH = "mismatch"  # both hold the key, but value or revision differ (or a tombstone etcd does not have)


@dataclass(frozen=True, slots=True)
class Difference:
    kind: DiffKind
    key: bytes
    #: The revision the comparison was made at: R, or the row's own revision for a row ahead of R.
    at: int
    row: Row | None = None
    etcd: KV | None = None


@dataclass(frozen=True)
class SpanResult:
    """One span's comparison."""

    key_range: KeyRange
    #: Keys compared: the keys etcd holds at R in the span, plus downstream rows for keys it does not hold.
    keys: int = 0
    #: Downstream rows ahead of R, verified at their own revision.
    ahead: int = 0
    #: Rows ahead of R whose revision etcd has compacted.
    unverifiable: int = 0
    differences: tuple[Difference, ...] = ()


def needs_point_read(row: Row, revision: int) -> bool:
    """The row is ahead of R: it is compared with etcd at its own revision."""
    return row.revision > revision


def _live_equal(row: Row, kv: KV) -> bool:
    return kv.mod_revision == row.revision and kv.value == (row.value or b"")


def compare(
    key_range: KeyRange,
    revision: int,
    rows: Iterable[Row],
    at_r: Iterable[KV],
    point_reads: Mapping[tuple[bytes, int], PointRead] = {},  # read only
) -> SpanResult:
    """The differences of one span (see the module docstring): ``rows`` the downstream rows of the span,
    ``at_r`` the keys etcd holds in it at ``revision``, ``point_reads`` what etcd held at ``(key,
    row.revision)`` for each row ahead of R (one not given counts as unverifiable). Keys outside
    ``key_range`` are ignored."""
    etcd = {kv.key: kv for kv in at_r if key_range.contains_key(kv.key)}
    diffs: list[Difference] = []
    seen: set[bytes] = set()
    ahead = unverifiable = extra_keys = 0
    for row in rows:
        if not key_range.contains_key(row.key):
            continue
        seen.add(row.key)
        kv = etcd.get(row.key)
        if kv is None and not row.deleted:
            extra_keys += 1
        if needs_point_read(row, revision):
            ahead += 1
            there = point_reads.get((row.key, row.revision), COMPACTED)
            if there is COMPACTED:
                unverifiable += 1
            elif row.deleted:
                if there is not None:
                    diffs.append(Difference(DiffKind.MISMATCH, row.key, row.revision, row, there))
            elif there is None:
                diffs.append(Difference(DiffKind.EXTRA, row.key, row.revision, row))
            elif not _live_equal(row, there):
                diffs.append(Difference(DiffKind.MISMATCH, row.key, row.revision, row, there))
            continue
        if row.deleted:
            if kv is not None:
                kind = DiffKind.MISSING if kv.mod_revision > row.revision else DiffKind.MISMATCH
                diffs.append(Difference(kind, row.key, revision, row, kv))
        elif kv is None:
            diffs.append(Difference(DiffKind.EXTRA, row.key, revision, row))
        elif not _live_equal(row, kv):
            diffs.append(Difference(DiffKind.MISMATCH, row.key, revision, row, kv))
    for key, kv in etcd.items():
        if key not in seen:
            diffs.append(Difference(DiffKind.MISSING, key, revision, None, kv))
    diffs.sort(key=lambda d: d.key)
    return SpanResult(key_range, len(etcd) + extra_keys, ahead, unverifiable, tuple(diffs))


# -- the I/O ---------------------------------------------------------------------------------------


class VerifyError(Exception):
    """Verification could not be done; ``refused`` when the request itself cannot be met (R compacted or
    in the future), otherwise a failure to read (a server unreachable, a compaction meanwhile)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def _is_compacted(exc: BaseException) -> bool:
    return "required revision has been compacted" in str(exc)


def _is_future(exc: BaseException) -> bool:
    return "required revision is a future revision" in str(exc)


class EtcdReader:
    """Reads at a revision through aetcd's KV stub (aetcd's own ``get_range`` takes no revision)."""

    def __init__(self, endpoints: Sequence[str], username: str | None = None, password: str | None = None,
                 timeout: float = 10.0, tls: etcd.Tls | None = None) -> None:  # fmt: skip
        problem = etcd.problem(endpoints, tls)
        if problem:
            raise VerifyError(problem, refused=True)
        self.endpoints = list(endpoints)
        self.username = username
        self.password = password
        self.tls = tls
        self.timeout = timeout
        self._client: Any = None

    async def __aenter__(self) -> EtcdReader:
        import aetcd.rpc

        client = None
        try:
            client = await etcd.Connection.open(
                self.endpoints[0],
                username=self.username,
                password=self.password,
                tls=self.tls,
                auth_timeout=self.timeout,
            )
            # A channel connects lazily: read once now, so that an unreachable etcd or a TLS handshake that fails
            # says so here, with the endpoint.
            probe = aetcd.rpc.RangeRequest(key=b"\0", limit=1)
            await client.kvstub.Range(probe, timeout=self.timeout, metadata=client.metadata)
        except BaseException as exc:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
            if not isinstance(exc, Exception):
                raise  # cancelled, interrupted: as it came, the channel closed
            raise VerifyError(f"cannot reach etcd at {self.endpoints[0]}: {_one_line(exc)}") from None
        self._client = client
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _range(self, key: bytes, range_end: bytes | None, revision: int, limit: int = 0) -> Any:
        import aetcd.rpc

        request = aetcd.rpc.RangeRequest(key=key, revision=revision, limit=limit)
        if range_end is not None:
            request.range_end = range_end
        try:
            return await self._client.kvstub.Range(request, timeout=self.timeout, metadata=self._client.metadata)
        except Exception as exc:
            if _is_compacted(exc):
                raise _CompactedRead from None
            if _is_future(exc):
                raise VerifyError(f"revision {revision} is ahead of etcd's current revision", refused=True) from None
            raise VerifyError(f"reading etcd at {self.endpoints[0]}: {_one_line(exc)}") from None

    async def current_revision(self) -> int:
        response = await self._range(b"\0", None, 0, limit=1)
        return int(response.header.revision)

    async def compacted_below(self, revision: int) -> bool:
        """Whether a read at ``revision`` is refused as compacted."""
        try:
            await self._range(b"\0", None, revision, limit=1)
        except _CompactedRead:
            return True
        return False

    async def range_at(self, key_range: KeyRange, revision: int, page: int = PAGE) -> AsyncIterator[KV]:
        """Every key of ``key_range`` at ``revision``, in key order, ``page`` keys per request."""
        start = key_range.start
        while True:
            try:
                response = await self._range(start, key_range.end, revision, limit=page)
            except _CompactedRead:
                raise VerifyError(
                    f"etcd compacted revision {revision} during the verification: choose a newer one"
                ) from None
            for kv in response.kvs:
                yield KV(bytes(kv.key), bytes(kv.value), int(kv.mod_revision))
            if not response.more or not response.kvs:
                return
            start = bytes(response.kvs[-1].key) + b"\0"

    async def point(self, key: bytes, revision: int) -> PointRead:
        try:
            response = await self._range(key, None, revision)
        except _CompactedRead:
            return COMPACTED
        if not response.kvs:
            return None
        kv = response.kvs[0]
        return KV(bytes(kv.key), bytes(kv.value), int(kv.mod_revision))

    async def points(
        self, wanted: Iterable[tuple[bytes, int]], parallel: int = POINT_READS
    ) -> dict[tuple[bytes, int], PointRead]:
        """What etcd held at each ``(key, revision)``, ``parallel`` reads at a time."""
        gate = asyncio.Semaphore(parallel)

        async def one(key: bytes, revision: int) -> tuple[tuple[bytes, int], PointRead]:
            async with gate:
                return (key, revision), await self.point(key, revision)

        return dict(await asyncio.gather(*(one(k, r) for k, r in wanted)))


class _CompactedRead(Exception):
    pass


def _one_line(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return " ".join(str(text or type(exc).__name__).split())


@dataclass(frozen=True)
class SpanToVerify:
    table_id: int
    mode: Mode
    key_range: KeyRange
    name: str = ""


@dataclass
class TableResult:
    table_id: int
    mode: Mode
    spans: list[SpanResult] = field(default_factory=list)
    #: The sink has no table for it (no dispatcher created it): every key etcd holds is missing.
    absent_downstream: bool = False
    #: The revision compared at (the one asked for, or raised to the highest horizon), and this table's horizon.
    revision: int = 0
    horizon: int = 0

    @property
    def keys(self) -> int:
        return sum(s.keys for s in self.spans)

    @property
    def differences(self) -> list[Difference]:
        return [d for s in self.spans for d in s.differences]

    @property
    def unverifiable(self) -> int:
        return sum(s.unverifiable for s in self.spans)

    @property
    def ahead(self) -> int:
        return sum(s.ahead for s in self.spans)


async def read_rows(
    sink: Sink, spans: Sequence[SpanToVerify]
) -> tuple[dict[SpanToVerify, list[Row]], set[tuple[int, Mode]], dict[tuple[int, Mode], int]]:
    """Every span's downstream rows, in one snapshot of the sink (``Sink.snapshot``: a REPEATABLE READ, read-only
    transaction); the (table, mode) pairs the sink has no table for; and the tombstone horizons of the sink's tables,
    read in the same snapshot."""
    out: dict[SpanToVerify, list[Row]] = {}
    absent: set[tuple[int, Mode]] = set()
    try:
        async with sink.snapshot() as snap:
            horizons = await snap.horizons()  # the snapshot's first read: rows and horizons in it
            for span in spans:
                table = (span.table_id, span.mode)
                found = None if table in absent else await snap.rows(table, span.key_range.start, span.key_range.end)
                if found is None:
                    absent.add(table)
                out[span] = found or []
    except sink.errors() as exc:
        # The DSN is never printed (it may hold a password): the sink's own words, scrubbed.
        words = sink.trouble(exc)[1].removeprefix("cannot write the sink: ")
        raise VerifyError(f"cannot read the sink ({sink.describe()}): {words}") from None
    return out, absent, horizons


async def verify(
    etcd: EtcdReader,
    sink: Sink,
    revision: int,
    spans: Sequence[SpanToVerify],
    *,
    raise_to_horizon: bool = False,
) -> list[TableResult]:
    """Compare every span at ``revision`` (etcd already entered); results per (table, mode), in order. A
    ``revision`` below a tombstone horizon of the spans' tables is refused, or with ``raise_to_horizon`` raised to
    the highest (each result's ``revision`` says which was compared)."""
    if await etcd.compacted_below(revision):
        raise VerifyError(f"revision {revision} is compacted in etcd: choose a newer one (--revision)", refused=True)
    rows, absent, horizons = await read_rows(sink, spans)
    tables = {(s.table_id, s.mode) for s in spans}
    top = max(((h, t) for t, h in horizons.items() if t in tables), default=(0, (0, Mode.DEFAULT)), key=lambda x: x[0])
    if top[0] > revision:
        if not raise_to_horizon:
            (table_id, mode) = top[1]
            raise VerifyError(
                f"revision {revision} is below the tombstone horizon {top[0]} of table {table_id} ({mode.value}): "
                f"the sink no longer holds the tombstones of its deletes at or below {top[0]}, so it cannot be "
                f"compared at {revision}: choose {top[0]} or above (--revision)",
                refused=True,
            )
        revision = top[0]
    results: dict[tuple[int, Mode], TableResult] = {}
    for span in sorted(spans, key=lambda s: (s.table_id, s.mode.value, s.key_range)):
        at_r = [kv async for kv in etcd.range_at(span.key_range, revision)]
        span_rows = rows[span]
        ahead = [(r.key, r.revision) for r in span_rows if needs_point_read(r, revision)]
        reads = await etcd.points(ahead)
        key = (span.table_id, span.mode)
        table = results.setdefault(key, TableResult(span.table_id, span.mode, revision=revision))
        table.horizon = horizons.get(key, 0)
        table.absent_downstream = (span.table_id, span.mode) in absent
        table.spans.append(compare(span.key_range, revision, span_rows, at_r, reads))
    return list(results.values())
