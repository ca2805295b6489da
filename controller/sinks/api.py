"""What a sink is to the data plane: the interface every sink implements, and the rules every sink applies alike.

A sink kind (``controller.sinks.postgres``, ``controller.sinks.mysql``) provides a :class:`Sink`: where one
changefeed writes, made from the Secret the Changefeed names (``from_secret``), which opens :class:`Session` s (one
connection each) and reads :class:`Snapshot` s for verify. The capture's group-commit writer
(``controller.capture.batcher``) and its tombstone collector (``controller.capture.collector``) drive a session;
neither knows which kind it is. docs/architecture.md, "Sinks: the seam", says what a new kind must implement and
prove.

The layout every sink keeps per changefeed (a PostgreSQL schema or a MySQL database named :func:`namespace_of`):
per Table and mode a table of rows (key, value, revision, deleted), one per upstream key, a delete kept as a
tombstone; ``checkpoints``, per dispatcher the revision up to which its span is committed, written in the same
transaction as the rows it covers; ``horizons``, per table and mode the tombstone collection horizon; ``identity``,
one random id naming the sink (a changed DSN must reach the same database).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from controller.model.keys import KeyRange
from controller.model.states import Mode

#: Tombstones a collection deletes per transaction, and transactions per collection (the rest waits for the next).
DELETE_BATCH = 5_000
DELETE_BATCHES = 10
#: One change: key, value (None for a delete), revision, deleted.
Row = tuple[bytes, bytes | None, int, bool]
#: A table of the sink: (table id, mode).
Table = tuple[int, Mode]


def namespace_of(changefeed: str) -> str:
    """The schema (PostgreSQL) or database (MySQL) holding ``changefeed``'s tables: ``cfm_<changefeed>``, every
    character other than a lowercase letter, a digit or ``_`` made ``_``."""
    return "cfm_" + re.sub(r"[^a-z0-9_]", "_", changefeed.lower())


def table_name(table_id: int, mode: Mode = Mode.DEFAULT) -> str:
    return f"t{table_id}" if mode is Mode.DEFAULT else f"t{table_id}_redo"


@dataclass(frozen=True)
class Sweep:
    """An initial scan's deletes, committed with the scan's rows: every live row of ``[lo, hi)`` older than ``at``
    whose key the scan did not find (``keys``) becomes a tombstone at ``at``. A scan reads only what is there, so
    without it a key that a predecessor wrote downstream and that etcd deleted before the scan would stay live while
    the checkpoint says its delete was applied. Rows at or after ``at`` are newer than the scan: untouched."""

    table: Table
    lo: bytes
    hi: bytes
    at: int
    keys: Sequence[bytes]


@dataclass(frozen=True)
class Checkpoint:
    """A dispatcher's checkpoint row: every change of ``[start, end)`` of the table up to ``revision`` is committed.
    Saved never backwards; the row's span moves with its revision."""

    dispatcher: str
    table_id: int
    mode: Mode
    start: bytes
    end: bytes
    revision: int


@dataclass
class Batch:
    """One transaction of the writer: per table, the newest change of each key (the keys of a table distinct); the
    initial scans' sweeps; the checkpoints the batch completes. ``superseded``, asked last inside the transaction,
    says whether a scan of it belongs to a dispatcher closed meanwhile: then nothing of the batch is committed
    (:class:`Superseded`)."""

    rows: dict[Table, dict[bytes, Row]]
    sweeps: list[Sweep]
    checkpoints: list[Checkpoint]
    superseded: Callable[[], bool]


class Superseded(Exception):
    """A batch rolled back: a scan in it belongs to a dispatcher closed while the transaction ran."""


@dataclass(frozen=True)
class Written:
    """What a committed batch did: changes applied (offered to the merge), and changes the fence dropped at or
    below a horizon."""

    applied: int
    dropped: int


@dataclass(frozen=True)
class Collected:
    """One collection of a table: its horizon after it, the tombstones it deleted, and whether some at or below the
    horizon are left for the next one."""

    table_id: int
    mode: Mode
    horizon: int
    deleted: int
    more: bool = False
    #: The horizon this collection computed: min(checkpoint, frontier).
    target: int = 0


@dataclass(frozen=True)
class Figures:
    """A table's size after a collection: tombstones held (exact) and live rows (exact for a small table, else the
    server's estimate less the tombstones; None when the server has none)."""

    tombstones: int
    live_rows: int | None
    live_rows_exact: bool


@dataclass(frozen=True, slots=True)
class StoredRow:
    """A row of a sink table as verify reads it."""

    key: bytes
    value: bytes | None
    revision: int
    deleted: bool


class Session(Protocol):
    """One connection to a sink, used by one task at a time (the writer, then its collector between transactions)."""

    @property
    def usable(self) -> bool:
        """Not closed, not broken: worth another transaction."""
        ...

    async def ensure(self, table: Table) -> str:
        """The changefeed's layout and this table (with its horizon row at 0 if new, and its tombstone index), made if
        missing, in a transaction of its own that tolerates another capture making them at the same moment; returns
        the sink's identity."""
        ...

    async def identity(self) -> str:
        """The sink's identity row, "" when the layout does not exist yet (a round trip either way)."""
        ...

    async def write(self, batch: Batch) -> Written:
        """One transaction, atomic: read the horizons of the batch's tables under a share lock (the fence); apply each
        sweep whose ``at`` is above its table's horizon, then each change above its table's horizon (:func:`above`)
        only if newer than the row (deletes as tombstones); save the checkpoints (never backwards); last, roll
        everything back with :class:`Superseded` if ``batch.superseded()``. Replaying a batch changes nothing."""
        ...

    async def save_checkpoints(self, checkpoints: Sequence[Checkpoint]) -> None:
        """Checkpoints alone, in a transaction of their own (never backwards)."""
        ...

    async def checkpoint_spans(self, tables: Iterable[Table]) -> dict[Table, list[tuple[bytes, bytes, int]]]:
        """Every checkpoint row of ``tables``: (span start, span end, revision)."""
        ...

    async def collect(self, table: Table, target: int, *, batch: int, batches: int) -> Collected:
        """Raise the table's horizon to ``target`` (never lower it), commit, then delete the tombstones at or below the
        horizon read back, ``batch`` per transaction, at most ``batches`` transactions; one capture at a time per
        table, and never waiting long for a lock (a stopped capture's transaction must not hold this one)."""
        ...

    async def figures(self, table: Table) -> Figures: ...

    async def close(self) -> None: ...


class Snapshot(Protocol):
    """One consistent read of a sink (verify): every read sees the same committed state."""

    async def horizons(self) -> dict[Table, int]:
        """Every horizon of the changefeed (empty if it has none)."""
        ...

    async def rows(self, table: Table, lo: bytes, hi: bytes) -> list[StoredRow] | None:
        """Every row (tombstones included) with ``lo <= key < hi``, in key order (bytewise); None if the sink has no
        such table."""
        ...


class Sink(Protocol):
    """Where one changefeed writes: a kind and the values of its Secret. Compared by value (a changed Secret makes an
    unequal one); never shows a credential (``repr`` and ``describe``)."""

    @property
    def kind(self) -> str:
        """``postgres`` or ``mysql``: the Changefeed's ``spec.sink.<kind>``."""
        ...

    @property
    def changefeed(self) -> str: ...

    def describe(self) -> str:
        """Where it writes, for messages: host, port, database and user, nothing else."""
        ...

    def errors(self) -> tuple[type[BaseException], ...]:
        """The exceptions a failed call to this sink raises (what the writer retries)."""
        ...

    def trouble(self, exc: BaseException) -> tuple[bool, str]:
        """(transient, message) of a failure: transient while retrying may succeed unaided (a server restarting,
        a connection reset); False when a person must act (a password, a grant, a missing database). The message
        says what and where and quotes no credential."""
        ...

    async def connect(self) -> Session:
        """A new session (raises one of :meth:`errors` when the sink cannot be reached)."""
        ...

    def snapshot(self) -> Any:
        """An async context manager yielding a :class:`Snapshot`."""
        ...


def above(rows: Iterable[Row], horizon: int) -> list[Row]:
    """The changes with revision above ``horizon``: those at or below it are committed already or superseded, and
    one older than a collected tombstone would resurrect its key."""
    return [row for row in rows if row[2] > horizon]


def frontier(key_range: KeyRange, spans: Iterable[tuple[bytes, bytes, int]]) -> int:
    """The sink's committed frontier of ``key_range`` from checkpoint rows (span start, span end, revision), each
    saying "every change of [start, end) up to revision is committed": for every point of the range the highest
    revision of the rows covering it, and the lowest of those over the range. 0 if any part of the range is covered
    by no row."""
    lo, hi = key_range.start, key_range.end
    clipped = sorted((max(s, lo), min(e, hi), r) for s, e, r in spans if s < hi and e > lo and s < e)
    points = sorted({lo, hi, *(s for s, _, _ in clipped), *(e for _, e, _ in clipped)})
    covering: list[tuple[int, bytes]] = []  # (-revision, end): the highest revision on top
    low: int | None = None
    i = 0
    for point in points[:-1]:  # each elementary piece [point, next point)
        while i < len(clipped) and clipped[i][0] <= point:
            heapq.heappush(covering, (-clipped[i][2], clipped[i][1]))
            i += 1
        while covering and covering[0][1] <= point:
            heapq.heappop(covering)  # the highest ends before this piece; the next highest may cover it
        if not covering:
            return 0
        best = -covering[0][0]
        low = best if low is None else min(low, best)
    return max(low or 0, 0)


class Unusable(ValueError):
    """A sink Secret's values cannot be used (a key missing, a DSN malformed): the message says which, quoting no
    value."""
