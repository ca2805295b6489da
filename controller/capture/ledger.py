"""The delivery ledger: what dispatchers delivered, written where a test can read it, and the no-gap check.

The simulator proves "no key and no timestamp is skipped" against its own ground truth. This module
lets real processes prove it too. The default dispatcher runtime (``LogicalClockRuntime``) delivers
nothing anywhere, so its "downstream" is this ledger: with ``--ledger-dir DIR`` (or ``CFM_LEDGER_DIR``)
every capture process appends, to ``DIR/<capture>.<incarnation>.jsonl``, one JSON line per dispatcher and
flush saying "dispatcher D (uid, span, table, mode, key range) has delivered every change in
(from-ts, to-ts]", where from-ts is the dispatcher's start ts.

Write cost is bounded: the runtime only notes the newest checkpoint per dispatcher in memory (coalesced),
and the agent flushes before it claims a checkpoint to anyone (a Working or Stopped status, the progress
report on its Lease) and when a dispatcher closes. So nothing is ever claimed that is not in the ledger,
while a process killed between flushes loses only deliveries nobody was told about: a checkpoint is "a
delivery the ledger has". With a ledger, lines per flush = dispatchers that advanced since the last one.

The checker (:func:`check`) takes the intervals of every file and, per changefeed, table and mode,
proves that for every key of the table the union of the delivered intervals covers (start, final
checkpoint]: overlaps (duplicates) are fine, a gap is reported with the keys and the timestamps missing.
Key ranges are compared as bytes, as everywhere else.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from controller.model.keys import KeyRange
from controller.model.records import Dispatcher
from controller.model.states import Mode

#: Environment variable naming the ledger directory (the capture's ``--ledger-dir`` overrides it).
LEDGER_ENV = "CFM_LEDGER_DIR"


@dataclass(frozen=True)
class Delivered:
    """One ledger line: ``dispatcher`` delivered every change of ``key_range`` in (from_ts, to_ts]."""

    changefeed: str
    table_id: int
    mode: Mode
    key_range: KeyRange
    from_ts: int
    to_ts: int
    dispatcher: str = ""
    uid: str = ""
    span: str = ""
    capture: str = ""
    incarnation: str = ""

    def line(self) -> str:
        start, end = self.key_range.hex()
        return json.dumps(
            {
                "changefeed": self.changefeed,
                "table": self.table_id,
                "mode": self.mode.value,
                "start": start,
                "end": end,
                "from": self.from_ts,
                "to": self.to_ts,
                "dispatcher": self.dispatcher,
                "uid": self.uid,
                "span": self.span,
                "capture": self.capture,
                "incarnation": self.incarnation,
            },
            separators=(",", ":"),
        )

    @classmethod
    def parse(cls, text: str) -> Delivered:
        o = json.loads(text)
        return cls(
            changefeed=o["changefeed"],
            table_id=int(o["table"]),
            mode=Mode(o["mode"]),
            key_range=KeyRange.from_hex(o["start"], o["end"]),
            from_ts=int(o["from"]),
            to_ts=int(o["to"]),
            dispatcher=o.get("dispatcher", ""),
            uid=o.get("uid", ""),
            span=o.get("span", ""),
            capture=o.get("capture", ""),
            incarnation=o.get("incarnation", ""),
        )


class Ledger:
    """The sink of one capture process: coalesces per dispatcher in memory, appends on :meth:`flush`."""

    def __init__(self, directory: str | Path, capture: str, incarnation: str) -> None:
        self.path = Path(directory) / f"{capture}.{incarnation}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.capture = capture
        self.incarnation = incarnation
        self._pending: dict[str, tuple[Dispatcher, int]] = {}
        self._flushed: dict[str, int] = {}
        self._file: IO[str] | None = None

    def delivered(self, d: Dispatcher, to_ts: int) -> None:
        """``d`` has delivered up to ``to_ts`` (from its start ts); kept in memory until the next flush."""
        if to_ts > max(d.start_ts, self._flushed.get(d.uid, d.start_ts)):
            self._pending[d.uid] = (d, to_ts)

    def flush(self) -> None:
        """Append what was delivered since the last flush (one line per dispatcher that advanced)."""
        if not self._pending:
            return
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        lines = []
        for uid, (d, to_ts) in self._pending.items():
            lines.append(self._record(d, to_ts).line() + "\n")
            self._flushed[uid] = to_ts
        self._pending.clear()
        self._file.write("".join(lines))
        self._file.flush()  # in the OS: survives a SIGKILL of this process

    def forget(self, uid: str) -> None:
        """After a dispatcher closed (and its last line was flushed)."""
        self._flushed.pop(uid, None)

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _record(self, d: Dispatcher, to_ts: int) -> Delivered:
        return Delivered(
            changefeed=d.changefeed,
            table_id=d.table_id,
            mode=d.mode,
            key_range=d.key_range,
            from_ts=d.start_ts,
            to_ts=to_ts,
            dispatcher=d.name,
            uid=d.uid,
            span=d.span,
            capture=self.capture,
            incarnation=self.incarnation,
        )


def read(directory: str | Path) -> list[Delivered]:
    """Every line of every ledger file in ``directory`` (a last line cut short by a kill is skipped)."""
    out: list[Delivered] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        text = path.read_text(encoding="utf-8")
        for line in text.splitlines(keepends=True):
            if line.endswith("\n") and line.strip():
                out.append(Delivered.parse(line))
    return out


@dataclass(frozen=True)
class Required:
    """Every key of ``table_id`` (``mode``) of ``changefeed`` must have been delivered over (from_ts, to_ts]."""

    changefeed: str
    table_id: int
    mode: Mode
    from_ts: int
    to_ts: int


def check(delivered: Iterable[Delivered], required: Iterable[Required]) -> list[str]:
    """Gaps: for each requirement, the keys and timestamps in (from_ts, to_ts] no interval covers."""
    by: defaultdict[tuple[str, int, Mode], list[Delivered]] = defaultdict(list)
    for d in delivered:
        by[(d.changefeed, d.table_id, d.mode)].append(d)
    problems: list[str] = []
    for req in required:
        if req.to_ts <= req.from_ts:
            continue
        table = KeyRange.of_table(req.table_id)
        got = [d for d in by.get((req.changefeed, req.table_id, req.mode), []) if d.key_range.overlaps(table)]
        inner = {k for d in got for k in (d.key_range.start, d.key_range.end) if table.start < k < table.end}
        for lo, hi in itertools.pairwise(sorted({table.start, table.end} | inner)):
            piece = KeyRange(lo, hi)
            covering = sorted((d.from_ts, d.to_ts) for d in got if d.key_range.contains_range(piece))
            missing = _missing(covering, req.from_ts, req.to_ts)
            if missing is not None:
                a, b = missing
                problems.append(
                    f"{req.changefeed} table {req.table_id} ({req.mode.value}) keys [{lo.hex()}, {hi.hex()}): "
                    f"nothing delivered in ({a}, {b}] (required ({req.from_ts}, {req.to_ts}]; "
                    f"delivered {_merged(covering) or 'nothing'})"
                )
    return problems


def _missing(intervals: list[tuple[int, int]], lo: int, hi: int) -> tuple[int, int] | None:
    """The first part of (lo, hi] that no (a, b] of ``intervals`` (sorted) covers, or None."""
    reached = lo
    for a, b in intervals:
        if a > reached:
            break
        reached = max(reached, b)
        if reached >= hi:
            return None
    if reached >= hi:
        return None
    nxt = next((a for a, _ in intervals if a > reached), hi)
    return reached, min(nxt, hi)


def _merged(intervals: list[tuple[int, int]]) -> str:
    out: list[list[int]] = []
    for a, b in intervals:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return ", ".join(f"({a}, {b}]" for a, b in out[:6]) + (" ..." if len(out) > 6 else "")


def directory_from_env() -> str:
    return os.environ.get(LEDGER_ENV, "")
