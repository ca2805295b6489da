"""Text output of the commands. Pure: every function takes the time it formats against.

Checkpoint ts are TiDB TSOs: physical milliseconds since the epoch shifted left by 18 logical bits (as
``controller.capture.runtime`` makes them); the lag is the local clock minus the physical part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from controller.cli.snapshot import Snapshot, span_states
from controller.engine.maintainer import SINK_UNAVAILABLE, SOURCE_UNAVAILABLE
from controller.model import resources as conv
from controller.model.progress import entry_lag, source_checkpoint_time
from controller.model.records import Condition, SpanOperator
from controller.model.states import Mode, OpPhase
from controller.model.tso import physical_seconds

JSON = dict[str, Any]


# -- small formats ---------------------------------------------------------------------------------


def age(seconds: float) -> str:
    """kubectl-like: 45s, 3m12s, 2h5m, 4d3h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def elapsed(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else age(seconds)


def checkpoint(ts: int, now: float) -> str:
    """``<ts> (<time>, lag <n>s)``; ``-`` for 0 (not known yet)."""
    if ts <= 0:
        return "-"
    wall = physical_seconds(ts)
    try:
        stamp = conv.format_time(round(wall, 3))
    except ValueError:
        return f"{ts} (not a TSO)"
    return f"{ts} ({stamp}, lag {max(0.0, now - wall):.1f}s)"


def revision_checkpoint(ts: int, wall: float | None, now: float) -> str:
    """``<ts> (revision, lag <n>s)`` for a changefeed counted in its source's revisions; ``-`` for 0."""
    if ts <= 0:
        return "-"
    return f"{ts} (revision" + ("" if wall is None else f", lag {max(0.0, now - wall):.1f}s") + ")"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell, two spaces apart, as kubectl prints them."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def to_yaml(body: Mapping[str, Any], comments: Sequence[str] = ()) -> str:
    head = "".join(f"# {c}\n" for c in comments)
    return head + yaml.safe_dump(dict(body), sort_keys=False)


# -- operators ---------------------------------------------------------------------------------------


def op_state(op: SpanOperator) -> str:
    """``Pending``, ``Running/RemoveOrigin``, ``Failed (SpanBusy)``..."""
    if op.phase is OpPhase.RUNNING and op.stage.value:
        return f"{op.phase}/{op.stage}"
    if op.phase.terminal and op.status_reason:
        return f"{op.phase} ({op.status_reason})"
    return op.phase.value


def op_targets(op: SpanOperator) -> str:
    captures = sorted({t.capture for t in op.targets if t.capture})
    if op.target and op.target not in captures:
        captures.insert(0, op.target)
    return ",".join(captures) or "-"


def op_duration(op: SpanOperator) -> float:
    start = op.started_at or op.created
    return max(0.0, op.finished_at - start) if op.finished_at else 0.0


def operators_table(ops: Sequence[SpanOperator], now: float, finished: bool = False) -> str:
    if not finished:
        rows = [
            [o.name, o.type, o.source, op_state(o), ",".join(o.spans), op_targets(o), age(now - o.created)] for o in ops
        ]
        return table(["NAME", "TYPE", "SOURCE", "STATE", "SPANS", "TARGET", "AGE"], rows)
    rows = [
        [
            o.name,
            o.type,
            o.source,
            o.phase,
            o.status_reason or "-",
            age(now - (o.finished_at or o.created)),
            elapsed(op_duration(o)),
            o.message or "",
        ]
        for o in ops
    ]
    return table(["NAME", "TYPE", "SOURCE", "PHASE", "REASON", "AGE", "DURATION", "MESSAGE"], rows)


def render_operators(snap: Snapshot, changefeed: str, show_all: bool, recent: float = 600.0) -> str:
    """In-flight operators, then finished ones: those of the last ``recent`` seconds, or all with ``show_all``."""
    ops = snap.operators_of(changefeed)
    running = [o for o in ops if o.in_flight]
    done = [o for o in ops if not o.in_flight and (show_all or snap.now - (o.finished_at or o.created) <= recent)]
    done.sort(key=lambda o: (o.finished_at or o.created, o.name))
    out = [f"In flight ({len(running)}):"]
    out.append(_indent(operators_table(running, snap.now)) if running else "  none")
    label = "Finished" if show_all else f"Finished in the last {recent / 60:g} minutes"
    out.append(f"{label} ({len(done)}):")
    out.append(_indent(operators_table(done, snap.now, finished=True)) if done else "  none")
    return "\n".join(out)


def progress(op: SpanOperator, seconds: float) -> str:
    """One line of ``--wait``: elapsed time and the operator's phase/stage."""
    return f"{elapsed(seconds):>7}  {op.name}  {op_state(op)}"


def still_running(name: str, namespace: str) -> str:
    """What to tell when the plugin stops following an operator it created (timeout, Ctrl-C)."""
    ns = f" -n {namespace}" if namespace else ""
    return (
        f"SpanOperator {name} was created and keeps running (the maintainer carries it out); "
        f"follow it with: kubectl get spanoperators {name}{ns} -w"
    )


def outcome(op: SpanOperator) -> list[str]:
    """What a finished operator did (Succeeded), or why not.

    A Split or Merge succeeds once its new spans exist ("PartiallyPlaced" if some could not be placed):
    each span it did not place is listed with the reason and message the maintainer recorded for it.
    """
    if op.phase is OpPhase.SUCCEEDED:
        lines = [f"{op.type} {op.name} succeeded" + (f" ({op.status_reason})" if op.status_reason else "")]
        for t in op.targets:
            start, end = t.key_range.hex()
            if not t.lost:
                where = f"on {t.capture or '?'}"
            elif t.lost_reason:
                where = f"not placed ({t.lost_reason}): {t.lost_message}"
            else:  # recorded by a maintainer from before reasons were recorded
                where = "not placed: left Absent for the basic scheduler"
            lines.append(f"  span {t.span} [{start}, {end}) {where}")
        return lines
    return [f"{op.type} {op.name} {op.phase}: {op.status_reason or 'no reason'}: {op.message or 'no message'}"]


# -- spans -------------------------------------------------------------------------------------------


def render_spans(snap: Snapshot, changefeed: str, table_id: int | None = None, mode: str | None = None) -> str:
    spans = [
        s
        for s in snap.spans_of(changefeed)
        if (table_id is None or s.table_id == table_id) and (mode is None or s.mode.value == mode)
    ]
    if not spans:
        return "No spans."
    rows = []
    for s in spans:
        start, end = s.key_range.hex()
        rows.append(
            [
                s.name,
                s.table_id,
                s.mode,
                start,
                end,
                s.state.value if s.state is not None else "New",
                s.capture or "-",
                s.dispatcher or "-",
                s.checkpoint_ts or "-",
                s.operator or "-",
            ]
        )
    headers = ["NAME", "TABLE", "MODE", "START", "END", "STATE", "CAPTURE", "DISPATCHER", "CHECKPOINT", "OPERATOR"]
    return table(headers, rows)


# -- status ------------------------------------------------------------------------------------------


def scheduler_line(status: Mapping[str, Any], now: float) -> str | None:
    """``status.scheduler`` (state, message, balanceResumesAt), or None when the maintainer does not
    publish it."""
    sched = status.get("scheduler")
    if not isinstance(sched, Mapping) or not sched:
        return None
    text = str(sched.get("state") or "?")
    if sched.get("message"):
        text += f": {sched['message']}"
    resumes = str(sched.get("balanceResumesAt") or "")
    if resumes:
        extra = [] if resumes in text else [f"balancing resumes at {resumes}"]
        try:
            left = conv.parse_time(resumes) - now
        except ValueError:
            left = 0.0
        if left > 0:
            extra.append(f"in {age(left)}")
        if extra:
            text += f" ({', '.join(extra)})"
    return text


def data_path_line(cond: Condition | None, now: float) -> str:
    """One side of a changefeed's data path as its condition says: in use, or why not, since when and whether a
    person must act (the reason)."""
    if cond is None or cond.status != "True":
        return "in use" if cond is not None else "in use (no capture reported a trouble)"
    since = f" for {age(now - cond.last_transition)}" if cond.last_transition else ""
    return f"UNAVAILABLE{since} ({cond.reason}): {cond.message}"


def _indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line if line else line for line in text.splitlines())


def render_status(snap: Snapshot, changefeed: str) -> str:
    cf = snap.changefeeds[changefeed]
    spans = snap.spans_of(changefeed)
    out = [f"Changefeed {cf.name} (namespace {snap.namespace})"]

    def field(label: str, value: object) -> None:
        out.append(f"  {label + ':':<14}{value}")

    field("Maintainer", f"epoch {cf.epoch}, holder {cf.holder}" if cf.holder else "none has published an epoch")
    boot = cf.condition("Bootstrapped")
    field("Bootstrapped", f"{boot.status} ({boot.reason}: {boot.message})" if boot else "Unknown (no condition yet)")
    paused = "replication (spec.paused)" if cf.paused else "no"
    if cf.scheduler.paused and not cf.paused:
        paused = "the schedulers only (spec.scheduler.paused)"
    field("Paused", paused)
    sched = scheduler_line(snap.changefeed_status.get(changefeed, {}), snap.now)
    if sched is not None:
        field("Scheduler", sched)
    if cf.source_secret:
        wall = source_checkpoint_time(
            cf.checkpoint_ts,
            (e for c in snap.captures.values() if c.progress is not None for e in c.progress.entries
             if e.changefeed == changefeed),
        )  # fmt: skip
        field("Checkpoint", revision_checkpoint(cf.checkpoint_ts, wall, snap.now))
        for label, kind in (("Source", SOURCE_UNAVAILABLE), ("Sink", SINK_UNAVAILABLE)):
            field(label, data_path_line(cf.condition(kind), snap.now))
    else:
        field("Checkpoint", checkpoint(cf.checkpoint_ts, snap.now))
    states = span_states(spans)
    field("Spans", f"{len(spans)}" + (": " + ", ".join(f"{k} {v}" for k, v in states.items()) if states else ""))
    caps = sorted(snap.captures.values(), key=lambda c: c.name)
    alive = [c.name for c in caps if c.alive(snap.now)]
    lost = [c.name for c in caps if not c.alive(snap.now)]
    draining = [c.name for c in caps if c.draining]
    field(
        "Captures",
        f"{len(alive)} alive, {len(lost)} lost{' (' + ', '.join(lost) + ')' if lost else ''}, "
        f"{len(draining)} draining{' (' + ', '.join(draining) + ')' if draining else ''}",
    )

    modes = [m.value for m in cf.modes]
    modes += sorted({s.mode.value for s in spans} - set(modes))
    per: dict[str, dict[str, int]] = {}
    for s in spans:
        per.setdefault(s.capture, {}).setdefault(s.mode.value, 0)
        per[s.capture][s.mode.value] += 1
    rows: list[list[object]] = []
    for c in caps:
        rows.append([c.name, snap.capture_state(c), *(per.get(c.name, {}).get(m, 0) for m in modes)])
    for name in sorted(n for n in per if n and n not in snap.captures):
        rows.append([name, "unknown", *(per[name].get(m, 0) for m in modes)])
    if "" in per:
        rows.append(["(none)", "-", *(per[""].get(m, 0) for m in modes)])
    out.append("")
    out.append("Spans per capture:")
    out.append(_indent(table(["CAPTURE", "STATE", *(m.upper() for m in modes)], rows)) if rows else "  none")

    reports = progress_rows(snap, changefeed)
    out.append("")
    out.append("Progress reported by the captures (with their Lease renewals):")
    headers = ["CAPTURE", "MODE", "DISPATCHERS", "LAG", "SLOWEST", "REPORTED"]
    out.append(_indent(table(headers, reports)) if reports else "  none")

    running = snap.in_flight(changefeed)
    out.append("")
    out.append(f"Operators in flight ({len(running)}):")
    out.append(_indent(operators_table(running, snap.now)) if running else "  none")
    return "\n".join(out)


def progress_rows(snap: Snapshot, changefeed: str) -> list[list[object]]:
    """Per capture and mode: what its latest report says (dispatchers, lag of the slowest, which span)."""
    span_of = {s.dispatcher: s.name for s in snap.spans_of(changefeed) if s.dispatcher}
    rows: list[list[object]] = []
    for c in sorted(snap.captures.values(), key=lambda c: c.name):
        if c.progress is None:
            continue
        for e in c.progress.entries:
            if e.changefeed != changefeed:
                continue
            lag = entry_lag(e, snap.now) if e.dispatchers else None
            slowest = span_of.get(e.slowest, e.slowest) if e.dispatchers else ""
            shown = "-" if lag is None else f"{lag:.1f}s"
            when = f"{age(snap.now - c.progress.at)} ago"
            rows.append([c.name, e.mode.value, e.dispatchers, shown, slowest or "-", when])
    return rows


def mode_names() -> list[str]:
    return [m.value for m in Mode]
