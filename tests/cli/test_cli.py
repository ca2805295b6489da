"""The kubectl plugin's pure parts: validation (every refusal), formatting, snapshot conversion, and the
error and exit-code plumbing (``main``, ``api_errors``, ``follow_operator`` on a fake session)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes import config as kconfig

from controller.cli import commands, kube, render, validate
from controller.cli.__main__ import DEBUG_ENV, main
from controller.cli.commands import COMMANDS
from controller.cli.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CliError,
    Failed,
    NotFound,
    Refused,
)
from controller.cli.kube import api_errors, follow_operator
from controller.cli.snapshot import Snapshot, snapshot_from, span_states
from controller.kube.client import ApiError, BadResponse, Config
from controller.model import resources as conv
from controller.model.keys import KeyRange, table_key
from controller.model.progress import Progress, ProgressEntry, checkpoint_lag
from controller.model.records import Capture, Changefeed, Condition, Span, SpanOperator, Table, Target
from controller.model.states import Mode, OpPhase, OpSource, OpType, SpanState, Stage
from controller.model.tso import physical_seconds

NOW = 1_700_000_000.0
CF = "cf"
T1 = KeyRange.of_table(1)
MID = table_key(1) + b"\x80"
LOW = KeyRange(T1.start, MID)
HIGH = KeyRange(MID, T1.end)


def tso(seconds: float) -> int:
    return int(seconds * 1000) << 18


def span(name: str, rng: KeyRange, capture: str = "c0", **kw: Any) -> Span:
    fields: dict[str, Any] = {
        "changefeed": CF,
        "table_id": 1,
        "key_range": rng,
        "state": SpanState.REPLICATING,
        "capture": capture,
        "dispatcher": f"{name}-d",
    }
    fields.update(kw)
    return Span(name=name, **fields)


def capture(name: str, alive: bool = True, draining: bool = False) -> Capture:
    return Capture(name=name, renew_time=NOW - 1 if alive else NOW - 100, lease_duration=10, draining=draining)


def operator(name: str, spans: tuple[str, ...], **kw: Any) -> SpanOperator:
    fields: dict[str, Any] = {"changefeed": CF, "type": OpType.MOVE, "target": "c1", "created": NOW - 5}
    fields.update(kw)
    return SpanOperator(name=name, spans=spans, **fields)


def snap(
    spans: list[Span] | None = None,
    captures: list[Capture] | None = None,
    operators: list[SpanOperator] | None = None,
    tables: list[Table] | None = None,
    changefeeds: list[Changefeed] | None = None,
    status: dict[str, Any] | None = None,
) -> Snapshot:
    spans = spans if spans is not None else [span("a", LOW, "c0"), span("b", HIGH, "c1")]
    captures = captures if captures is not None else [capture("c0"), capture("c1"), capture("c2")]
    tables = tables if tables is not None else [Table(name="t1", changefeed=CF, table_id=1)]
    changefeeds = changefeeds if changefeeds is not None else [Changefeed(name=CF)]
    return Snapshot(
        namespace="ns",
        now=NOW,
        changefeeds={c.name: c for c in changefeeds},
        changefeed_status={CF: status or {}},
        tables={t.name: t for t in tables},
        spans={s.name: s for s in spans},
        operators={o.name: o for o in operators or []},
        captures={c.name: c for c in captures},
    )


def refused(exc: pytest.ExceptionInfo[CliError], *words: str) -> None:
    assert exc.value.code == EXIT_USAGE
    assert "\n" not in exc.value.message
    for w in words:
        assert w in exc.value.message, exc.value.message


# ------------------------------------------------------------------------------------------------------
# Changefeed resolution and keys


def test_resolve_changefeed() -> None:
    exc: pytest.ExceptionInfo[CliError]
    assert validate.resolve_changefeed(["cf"], None, "ns") == "cf"
    assert validate.resolve_changefeed(["a", "b"], "b", "ns") == "b"
    with pytest.raises(NotFound) as exc:
        validate.resolve_changefeed([], None, "ns")
    refused(exc, "no Changefeed", "ns")
    with pytest.raises(Refused) as exc:
        validate.resolve_changefeed(["a", "b"], None, "ns")
    refused(exc, "2 changefeeds", "a, b", "-c")
    with pytest.raises(NotFound) as exc:
        validate.resolve_changefeed(["a"], "z", "ns")
    refused(exc, "'z' not found")


def test_parse_keys() -> None:
    assert validate.parse_keys(["7400", "0xAB", "ff"]) == (b"t\x00", b"\xab", b"\xff")
    for bad in ("zz", "abc", "0x", ""):
        with pytest.raises(Refused) as exc:
            validate.parse_keys([bad])
        refused(exc, "split key")


# ------------------------------------------------------------------------------------------------------
# move


def test_move_builds_a_user_operator_with_the_changefeed_label() -> None:
    op = validate.plan_move(snap(), CF, "a", "c2", "move-abc123")
    assert (op.name, op.type, op.spans, op.target, op.source) == (
        "move-abc123",
        OpType.MOVE,
        ("a",),
        "c2",
        OpSource.USER,
    )
    body = validate.operator_body(op)
    assert "status" not in body
    assert body["metadata"]["labels"] == {conv.CHANGEFEED_LABEL: CF}
    assert body["metadata"]["namespace"] == "ns"
    assert body["spec"] == {
        "changefeed": CF,
        "type": "Move",
        "spans": ["a"],
        "target": "c2",
        "source": "user",
        "reason": "kubectl changefeed",
    }
    assert conv.operator_from_resource(body) == op  # what is created reads back as planned


def test_move_refusals() -> None:
    exc: pytest.ExceptionInfo[CliError]
    with pytest.raises(NotFound) as exc:
        validate.plan_move(snap(), CF, "nope", "c2", "m")
    refused(exc, "span 'nope' not found")
    other = span("x", LOW, changefeed="other")
    with pytest.raises(Refused) as exc:
        validate.plan_move(snap([other]), CF, "x", "c2", "m")
    refused(exc, "belongs to changefeed 'other'")
    with pytest.raises(Refused) as exc:
        validate.plan_move(snap([span("a", LOW, deleting=True)]), CF, "a", "c2", "m")
    refused(exc, "being deleted")
    for state, word in ((SpanState.ABSENT, "Absent"), (SpanState.INVALID, "Invalid"), (None, "not yet accepted")):
        with pytest.raises(Refused) as exc:
            validate.plan_move(snap([span("a", LOW, "", state=state)]), CF, "a", "c2", "m")
        refused(exc, word, "not Replicating")
    with pytest.raises(NotFound) as exc:
        validate.plan_move(snap(), CF, "a", "c9", "m")
    refused(exc, "capture 'c9' not found")
    with pytest.raises(Refused) as exc:
        validate.plan_move(snap(captures=[capture("c0"), capture("c2", alive=False)]), CF, "a", "c2", "m")
    refused(exc, "'c2' is not alive", "capture-c2")
    with pytest.raises(Refused) as exc:
        validate.plan_move(snap(captures=[capture("c0"), capture("c2", draining=True)]), CF, "a", "c2", "m")
    refused(exc, "'c2' is draining")
    with pytest.raises(Refused) as exc:
        validate.plan_move(snap(), CF, "a", "c0", "m")
    refused(exc, "already on capture 'c0'")


def test_move_refuses_a_busy_span() -> None:
    """Busy: an in-flight operator names the span in its spec or as a target, whatever the span's state."""
    by_spec = operator("op1", ("a",), phase=OpPhase.PENDING)
    with pytest.raises(Refused) as exc:
        validate.plan_move(snap(operators=[by_spec]), CF, "a", "c2", "m")
    refused(exc, "busy", "'op1'", "Move", "Pending")
    by_target = operator(
        "op2", ("p",), type=OpType.SPLIT, phase=OpPhase.RUNNING, targets=(Target(span="a", key_range=LOW),)
    )
    with pytest.raises(Refused) as exc:
        validate.plan_move(snap(operators=[by_target]), CF, "a", "c2", "m")
    refused(exc, "busy", "'op2'")
    scheduling = span("a", LOW, state=SpanState.SCHEDULING, operator="gone")
    with pytest.raises(Refused) as exc:
        validate.plan_move(snap([scheduling]), CF, "a", "c2", "m")
    refused(exc, "Scheduling")
    finished = operator("op3", ("a",), phase=OpPhase.SUCCEEDED)
    assert validate.plan_move(snap(operators=[finished]), CF, "a", "c2", "m").spans == ("a",)


# ------------------------------------------------------------------------------------------------------
# split


def test_split_into_and_at() -> None:
    op, pieces = validate.plan_split(snap(), CF, "a", "split-1", into=3)
    assert (op.type, op.spans, op.split_into, op.split_keys) == (OpType.SPLIT, ("a",), 3, ())
    assert len(pieces) == 3
    assert pieces[0].start == LOW.start
    assert pieces[-1].end == LOW.end
    cut = (table_key(1) + b"\x20", table_key(1) + b"\x40")
    op, pieces = validate.plan_split(snap(), CF, "a", "split-2", keys=cut)
    assert (op.split_keys, op.split_into) == (cut, 0)
    assert pieces == (KeyRange(LOW.start, cut[0]), KeyRange(*cut), KeyRange(cut[1], LOW.end))
    assert validate.operator_body(op)["spec"]["splitKeys"] == [k.hex() for k in cut]


def test_split_key_refusals() -> None:
    inside = table_key(1) + b"\x20"
    for key in (LOW.start, LOW.end, table_key(0), table_key(2)):
        with pytest.raises(Refused) as exc:
            validate.plan_split(snap(), CF, "a", "s", keys=(key,))
        refused(exc, key.hex(), "not strictly inside", "'a'")
    for keys in ((inside, inside), (inside + b"\x01", inside)):
        with pytest.raises(Refused) as exc:
            validate.plan_split(snap(), CF, "a", "s", keys=keys)
        refused(exc, "strictly increasing")
    with pytest.raises(Refused) as exc:
        validate.plan_split(snap(), CF, "a", "s", keys=tuple(LOW.start + bytes([i]) for i in range(1, 130)))
    refused(exc, "at most 127")


def test_split_key_length_and_changefeed_label_refusals() -> None:
    """A split key may be 4096 bytes (8192 hex digits, the CRD's bound); a changefeed name must fit the
    value of the label cdc.maintainer.dev/changefeed every SpanOperator carries (63 characters)."""
    longest = LOW.start + b"\x01" * (validate.MAX_KEY_BYTES - len(LOW.start))
    assert validate.plan_split(snap(), CF, "a", "s", keys=(longest,))[0].split_keys == (longest,)
    with pytest.raises(Refused) as exc:
        validate.plan_split(snap(), CF, "a", "s", keys=(longest + b"\x01",))
    refused(exc, "4097 bytes", "at most 4096")
    long = "c" * 64
    world = snap(
        [span("a", LOW, changefeed=long), span("b", HIGH, "c1", changefeed=long)],
        tables=[Table(name="t1", changefeed=long, table_id=1)],
        changefeeds=[Changefeed(name=long)],
    )
    for plan in (
        lambda: validate.plan_move(world, long, "a", "c2", "m"),
        lambda: validate.plan_split(world, long, "a", "s", into=2),
        lambda: validate.plan_merge(world, long, ["a", "b"], "m"),
    ):
        with pytest.raises(Refused) as exc:
            plan()
        refused(exc, "64 characters", conv.CHANGEFEED_LABEL, "at most 63")
    with pytest.raises(Refused) as exc:
        validate.require_label_value("cf-")
    refused(exc, "not a valid value of the label")
    validate.require_label_value("c" * 63)


def test_split_into_refusals() -> None:
    for n in (1, 0, -2, 129):
        with pytest.raises(Refused) as exc:
            validate.plan_split(snap(), CF, "a", "s", into=n) if n else validate.plan_split(snap(), CF, "a", "s")
        refused(exc)
    with pytest.raises(Refused) as exc:
        validate.plan_split(snap(), CF, "a", "s", into=1)
    refused(exc, "--into must be between 2 and 128")
    with pytest.raises(Refused) as exc:
        validate.plan_split(snap(), CF, "a", "s", into=2, keys=(MID,))
    refused(exc, "exactly one of --into")
    narrow = span("n", KeyRange(b"t\x00", b"t\x00\x00"))
    with pytest.raises(Refused) as exc:
        validate.plan_split(snap([narrow]), CF, "n", "s", into=5)
    refused(exc, "too narrow")


def test_split_refusals_of_span_and_table() -> None:
    exc: pytest.ExceptionInfo[CliError]
    with pytest.raises(NotFound) as exc:
        validate.plan_split(snap(), CF, "nope", "s", into=2)
    refused(exc, "not found")
    with pytest.raises(Refused) as exc:
        validate.plan_split(snap([span("a", LOW, state=SpanState.ABSENT)]), CF, "a", "s", into=2)
    refused(exc, "not Replicating")
    with pytest.raises(Refused) as exc:
        validate.plan_split(snap(operators=[operator("op", ("a",))]), CF, "a", "s", into=2)
    refused(exc, "busy")
    locked = Table(name="t1", changefeed=CF, table_id=1, splittable=False)
    with pytest.raises(Refused) as exc:
        validate.plan_split(snap(tables=[locked]), CF, "a", "s", into=2)
    refused(exc, "'t1'", "not splittable")
    with pytest.raises(Refused) as exc:
        validate.plan_split(snap(tables=[]), CF, "a", "s", into=2)
    refused(exc, "table 1", "does not exist")


# ------------------------------------------------------------------------------------------------------
# merge


def test_merge_orders_spans_by_key() -> None:
    op, merged = validate.plan_merge(snap(), CF, ["b", "a"], "merge-1")
    assert (op.type, op.spans, op.target) == (OpType.MERGE, ("a", "b"), "")
    assert merged == T1


def test_merge_refusals() -> None:
    exc: pytest.ExceptionInfo[CliError]
    with pytest.raises(Refused) as exc:
        validate.plan_merge(snap(), CF, ["a"], "m")
    refused(exc, "at least two spans, got 1")
    with pytest.raises(Refused) as exc:
        validate.plan_merge(snap(), CF, ["a", "b", "a"], "m")
    refused(exc, "'a' more than once")
    with pytest.raises(NotFound) as exc:
        validate.plan_merge(snap(), CF, ["a", "zz"], "m")
    refused(exc, "'zz' not found")
    other_table = span("b", KeyRange.of_table(2), table_id=2)
    with pytest.raises(Refused) as exc:
        validate.plan_merge(snap([span("a", LOW), other_table]), CF, ["a", "b"], "m")
    refused(exc, "one table and mode", "table 2")
    redo = span("b", HIGH, mode=Mode.REDO)
    with pytest.raises(Refused) as exc:
        validate.plan_merge(snap([span("a", LOW), redo]), CF, ["a", "b"], "m")
    refused(exc, "one table and mode", "1/redo")
    gap = span("b", KeyRange(MID + b"\x01", T1.end))
    with pytest.raises(Refused) as exc:
        validate.plan_merge(snap([span("a", LOW), gap]), CF, ["a", "b"], "m")
    refused(exc, "not adjacent")
    three = [span("a", LOW), span("b", KeyRange(MID, MID + b"\x10")), span("c", KeyRange(MID + b"\x10", T1.end))]
    with pytest.raises(Refused) as exc:
        validate.plan_merge(snap(three), CF, ["a", "c"], "m")
    refused(exc, "'a'", "'c'", "not adjacent")
    assert validate.plan_merge(snap(three), CF, ["c", "a", "b"], "m")[1] == T1
    with pytest.raises(Refused) as exc:
        validate.plan_merge(snap(operators=[operator("op", ("b",))]), CF, ["a", "b"], "m")
    refused(exc, "'b' is busy")
    with pytest.raises(Refused) as exc:
        validate.plan_merge(snap([span("a", LOW), span("b", HIGH, "", state=SpanState.ABSENT)]), CF, ["a", "b"], "m")
    refused(exc, "'b' is Absent")


# ------------------------------------------------------------------------------------------------------
# Snapshot


def _raw(kind: str, name: str, spec: dict[str, Any], status: dict[str, Any] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "cdc.maintainer.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": name, "namespace": "ns"},
        "spec": spec,
    }
    if status is not None:
        obj["status"] = status
    return obj


def _lease(capture: str, renewed: float) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": f"capture-{capture}"},
        "spec": {
            "holderIdentity": capture,
            "renewTime": conv.format_time(renewed, micro=True),
            "leaseDurationSeconds": 10,
        },
    }


def test_snapshot_from_folds_leases_into_captures_and_skips_invalid_objects() -> None:
    start, end = LOW.hex()
    raw = {
        "changefeeds": [_raw("Changefeed", CF, {}, {"epoch": 2, "scheduler": {"state": "Active"}})],
        "spans": [
            _raw("Span", "a", {"changefeed": CF, "tableID": 1, "startKey": start, "endKey": end}, {"state": "Absent"}),
            _raw("Span", "bad", {"changefeed": CF, "tableID": 1, "startKey": "XYZ", "endKey": end}),
        ],
        "captures": [_raw("Capture", "c0", {}), _raw("Capture", "c1", {"draining": True}), _raw("Capture", "c2", {})],
        "leases": [_lease("c0", NOW - 2), _lease("c1", NOW - 60)],
    }
    s = snapshot_from("ns", NOW, raw)
    assert list(s.spans) == ["a"]
    assert len(s.warnings) == 1
    assert "Span bad" in s.warnings[0]
    assert s.changefeeds[CF].epoch == 2
    assert s.changefeed_status[CF]["scheduler"] == {"state": "Active"}
    assert [s.capture_state(s.captures[c]) for c in ("c0", "c1", "c2")] == ["alive", "lost, draining", "lost"]
    assert s.alive("c0")
    assert not s.alive("c2")
    assert not s.alive("nope")


def test_remaining_on_counts_spans_and_operators_targeting_the_capture() -> None:
    ops = [
        operator("m1", ("x",), target="c1", phase=OpPhase.RUNNING),
        operator("s1", ("y",), type=OpType.SPLIT, target="", targets=(Target(span="z", key_range=LOW, capture="c1"),)),
        operator("done", ("a",), target="c1", phase=OpPhase.SUCCEEDED),
        operator("elsewhere", ("b",), target="c2"),
    ]
    held, busy = snap(operators=ops).remaining_on("c1", [CF])
    assert [s.name for s in held] == ["b"]
    assert sorted(o.name for o in busy) == ["m1", "s1"]


def test_span_states_counts_new_spans() -> None:
    spans = [span("a", LOW), span("b", HIGH, state=None), span("c", HIGH, state=SpanState.ABSENT)]
    assert span_states(spans) == {"Absent": 1, "Replicating": 1, "New": 1}


# ------------------------------------------------------------------------------------------------------
# Rendering


def test_small_formats() -> None:
    assert [render.age(s) for s in (-1, 5, 65, 3700, 90000)] == ["0s", "5s", "1m05s", "1h01m", "1d01h"]
    assert render.elapsed(1.25) == "1.2s"
    assert physical_seconds(tso(NOW)) == NOW
    assert render.checkpoint(0, NOW) == "-"
    assert checkpoint_lag(0, NOW) is None
    assert checkpoint_lag(tso(NOW - 2.5), NOW) == pytest.approx(2.5)
    text = render.checkpoint(tso(NOW - 2.5), NOW)
    assert text.startswith(str(tso(NOW - 2.5)))
    assert "lag 2.5s" in text
    assert conv.format_time(NOW - 2.5) in text
    assert render.table(["A", "BB"], [["xxx", 1]]) == "A    BB\nxxx  1"


def test_status_shows_everything() -> None:
    cf = Changefeed(
        name=CF,
        paused=True,
        epoch=4,
        holder="m2",
        checkpoint_ts=tso(NOW - 3),
        conditions=(Condition(type="Bootstrapped", status="True", reason="Restored", message="at epoch 4"),),
    )
    spans = [
        span("a", LOW, "c0"),
        span("a-redo", LOW, "c1", mode=Mode.REDO),
        span("b", HIGH, "", state=SpanState.ABSENT),
        span("x", HIGH, "ghost"),
    ]
    captures = [capture("c0"), capture("c1", draining=True), capture("c2", alive=False)]
    running = operator(
        "move-1", ("a",), target="c2", phase=OpPhase.RUNNING, stage=Stage.REMOVE_ORIGIN, created=NOW - 75
    )
    done = operator("move-0", ("a",), phase=OpPhase.SUCCEEDED)
    status = {
        "scheduler": {"state": "CoolingDown", "message": "drain done", "balanceResumesAt": conv.format_time(NOW + 30)}
    }
    s = snap(spans, captures, [running, done], changefeeds=[cf], status=status)
    text = render.render_status(s, CF)
    assert "epoch 4, holder m2" in text
    assert "True (Restored: at epoch 4)" in text
    assert "Paused:       replication (spec.paused)" in text
    resumes = conv.format_time(NOW + 30)
    assert f"Scheduler:    CoolingDown: drain done (balancing resumes at {resumes}, in 30s)" in text
    assert "lag 3.0s" in text
    assert "Spans:        4: Absent 1, Replicating 3" in text
    assert "2 alive, 1 lost (c2), 1 draining (c1)" in text
    lines = text.splitlines()
    header = next(line for line in lines if "CAPTURE" in line)
    assert header.split() == ["CAPTURE", "STATE", "DEFAULT", "REDO"]
    assert next(line for line in lines if line.strip().startswith("c0")).split() == ["c0", "alive", "1", "0"]
    assert next(line for line in lines if line.strip().startswith("c1")).split() == [
        "c1",
        "alive,",
        "draining",
        "0",
        "1",
    ]
    assert next(line for line in lines if line.strip().startswith("ghost")).split() == ["ghost", "unknown", "1", "0"]
    assert next(line for line in lines if line.strip().startswith("(none)")).split() == ["(none)", "-", "1", "0"]
    assert "Operators in flight (1):" in text
    row = next(line for line in lines if "move-1" in line).split()
    assert row == ["move-1", "Move", "user", "Running/RemoveOrigin", "a", "c2", "1m15s"]
    assert "move-0" not in text


def test_status_shows_the_captures_progress_reports() -> None:
    def reported(name: str, *entries: ProgressEntry) -> Capture:
        return replace(capture(name), progress=Progress(incarnation="i1", at=NOW - 2, entries=entries))

    slow = ProgressEntry(changefeed=CF, mode=Mode.DEFAULT, checkpoint_ts=tso(NOW - 4), dispatchers=1, digest="d",
                         slowest="a-d")  # fmt: skip
    other = ProgressEntry(changefeed="elsewhere", mode=Mode.DEFAULT, checkpoint_ts=1, dispatchers=9, digest="e")
    text = render.render_status(snap(captures=[reported("c0", slow, other), capture("c1")]), CF)
    assert "Progress reported by the captures" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("c0") and "default" in line)
    assert row.split() == ["c0", "default", "1", "4.0s", "a", "2s", "ago"]  # span a runs dispatcher a-d
    assert "elsewhere" not in text
    assert "none" in render.render_status(snap(), CF).split("Progress reported by the captures")[1].splitlines()[1]


def test_status_shows_a_source_changefeeds_checkpoint_as_a_revision_with_the_lag_its_reports_carry() -> None:
    def reported(name: str, behind: float) -> Capture:
        entry = ProgressEntry(changefeed=CF, mode=Mode.DEFAULT, checkpoint_ts=900, dispatchers=1, digest="d",
                              slowest="a-d", checkpoint_time=NOW - behind)  # fmt: skip
        return replace(capture(name), progress=Progress(incarnation="i1", at=NOW - 1, entries=(entry,)))

    fed = Changefeed(name=CF, source_secret="src", sink_secret="dst", checkpoint_ts=900)
    text = render.render_status(snap(captures=[reported("c0", 2.0), reported("c1", 0.5)], changefeeds=[fed]), CF)
    assert "Checkpoint:   900 (revision, lag 2.0s)" in text
    assert "1970" not in text
    assert "not a TSO" not in text
    row = next(line for line in text.splitlines() if line.strip().startswith("c1") and "default" in line)
    assert row.split()[3] == "0.5s"
    waiting = render.render_status(snap(changefeeds=[fed]), CF)
    assert "Checkpoint:   900 (revision)" in waiting  # no report yet: no lag to show


def test_status_tolerates_a_maintainer_without_scheduler_status() -> None:
    text = render.render_status(snap(), CF)
    assert "Scheduler:" not in text
    assert "Unknown (no condition yet)" in text
    assert "none has published an epoch" in text
    assert "Checkpoint:   -" in text
    assert render.scheduler_line({"scheduler": {"state": "Active"}}, NOW) == "Active"
    assert render.scheduler_line({"scheduler": {}}, NOW) is None
    assert render.scheduler_line({"scheduler": {"state": "Paused", "balanceResumesAt": "soon"}}, NOW) == (
        "Paused (balancing resumes at soon)"
    )
    at = conv.format_time(NOW + 90)
    cooling = {"state": "CoolingDown", "message": f"drain finished; balancing resumes at {at}", "balanceResumesAt": at}
    assert render.scheduler_line({"scheduler": cooling}, NOW) == (
        f"CoolingDown: drain finished; balancing resumes at {at} (in 1m30s)"
    )


def test_spans_table_filters_by_table_and_mode() -> None:
    spans = [span("a", LOW), span("a-redo", LOW, mode=Mode.REDO), span("t2", KeyRange.of_table(2), table_id=2)]
    s = snap(spans)
    text = render.render_spans(s, CF)
    assert text.splitlines()[0].split() == [
        "NAME",
        "TABLE",
        "MODE",
        "START",
        "END",
        "STATE",
        "CAPTURE",
        "DISPATCHER",
        "CHECKPOINT",
        "OPERATOR",
    ]
    assert [line.split()[0] for line in text.splitlines()[1:]] == ["a", "a-redo", "t2"]
    assert render.render_spans(s, CF, table_id=1, mode="redo").splitlines()[1].split()[:5] == [
        "a-redo",
        "1",
        "redo",
        *LOW.hex(),
    ]
    assert render.render_spans(s, CF, table_id=9) == "No spans."


def test_operators_recent_and_all() -> None:
    ops = [
        operator("run", ("a",), phase=OpPhase.RUNNING, stage=Stage.ADD_DEST),
        operator(
            "recent",
            ("a",),
            phase=OpPhase.FAILED,
            status_reason="DestinationLost",
            message="gone",
            started_at=NOW - 20,
            finished_at=NOW - 10,
        ),
        operator("old", ("a",), phase=OpPhase.SUCCEEDED, created=NOW - 4000, finished_at=NOW - 3000),
    ]
    s = snap(operators=ops)
    text = render.render_operators(s, CF, show_all=False)
    assert "In flight (1):" in text
    assert "Running/AddDest" in text
    assert "Finished in the last 10 minutes (1):" in text
    row = next(line for line in text.splitlines() if "recent" in line).split()
    assert row == ["recent", "Move", "user", "Failed", "DestinationLost", "10s", "10.0s", "gone"]
    assert "old" not in text
    assert "old" in render.render_operators(s, CF, show_all=True)


def test_progress_and_outcome() -> None:
    op = operator("split-1", ("p",), type=OpType.SPLIT, phase=OpPhase.RUNNING, stage=Stage.ADD_SPANS)
    assert render.progress(op, 1.25) == "   1.2s  split-1  Running/AddSpans"
    ok = replace(op, phase=OpPhase.SUCCEEDED, targets=(Target(span="c1", key_range=LOW, capture="c0"),))
    assert render.outcome(ok) == ["Split split-1 succeeded", f"  span c1 [{LOW.hex()[0]}, {LOW.hex()[1]}) on c0"]
    lost = Target(
        span="c2",
        key_range=HIGH,
        capture="c1",
        lost=True,
        lost_reason="DestinationLost",
        lost_message="destination capture c1 lost; left Absent for the basic scheduler",
    )
    partial = replace(ok, status_reason="PartiallyPlaced", targets=(*ok.targets, lost))
    assert render.outcome(partial) == [
        "Split split-1 succeeded (PartiallyPlaced)",
        f"  span c1 [{LOW.hex()[0]}, {LOW.hex()[1]}) on c0",
        f"  span c2 [{HIGH.hex()[0]}, {HIGH.hex()[1]}) not placed (DestinationLost): "
        "destination capture c1 lost; left Absent for the basic scheduler",
    ]
    legacy = replace(partial, targets=(*ok.targets, Target(span="c2", key_range=HIGH, lost=True)))
    assert render.outcome(legacy)[-1].endswith(") not placed: left Absent for the basic scheduler")
    bad = replace(op, phase=OpPhase.CANCELED, status_reason="Conflict", message="owned by another")
    assert render.outcome(bad) == ["Split split-1 Canceled: Conflict: owned by another"]
    assert render.op_state(bad) == "Canceled (Conflict)"


def test_dry_run_yaml_has_the_comment_and_the_body() -> None:
    op = validate.plan_move(snap(), CF, "a", "c2", "move-1")
    text = render.to_yaml(validate.operator_body(op), ["move span a"])
    assert text.startswith("# move span a\napiVersion: cdc.maintainer.dev/v1alpha1\nkind: SpanOperator\n")
    assert "target: c2" in text


# ------------------------------------------------------------------------------------------------------
# Errors, exit codes, following an operator


def test_api_errors_become_one_line_cli_errors() -> None:
    def raised(exc: BaseException) -> CliError:
        with pytest.raises(CliError) as info, api_errors("getting X", "http://api"):
            raise exc
        assert "\n" not in info.value.message
        return info.value

    e = raised(ApiError(404, "NotFound", 'spans "x" not found'))
    assert isinstance(e, NotFound)
    assert e.code == EXIT_USAGE
    assert e.message == 'getting X: not found (spans "x" not found)'
    e = raised(ApiError(403, "Forbidden", "user cannot\npatch"))
    assert (type(e), e.code, e.message) == (Failed, EXIT_FAILED, "getting X: 403 Forbidden: user cannot patch")
    e = raised(ApiError(500, "InternalError", "boom"))
    assert e.message == "getting X: API error 500 InternalError: boom"
    e = raised(aiohttp.ClientConnectionError("Connect call failed"))
    assert e.code == EXIT_FAILED
    assert "cannot reach the API server at http://api" in e.message
    e = raised(TimeoutError())
    assert "did not answer in time" in e.message


def test_api_refusals_and_odd_answers() -> None:
    """422 Invalid: the API refused the object, nothing written: exit 2 with its message. A 2xx body that
    is not JSON (a proxy's page): exit 1, one line."""
    with pytest.raises(CliError) as info, api_errors("creating SpanOperator m", "http://api"):
        raise ApiError(422, "Invalid", 'SpanOperator "m" is invalid:\nspec.target: Required value')
    assert (type(info.value), info.value.code) == (Refused, EXIT_USAGE)
    assert info.value.message == (
        "creating SpanOperator m: refused by the API (Invalid): "
        'SpanOperator "m" is invalid: spec.target: Required value'
    )
    with pytest.raises(CliError) as info, api_errors("listing spans", "http://api"):
        raise BadResponse("GET /apis: HTTP 200 with a body that is not JSON: '<html>'")
    assert (type(info.value), info.value.code) == (Failed, EXIT_FAILED)
    assert "http://api did not answer like a Kubernetes API server" in info.value.message


class FakeSession:
    """Yields the given versions of an operator, then blocks (as a quiet watch does)."""

    def __init__(self, versions: list[SpanOperator]) -> None:
        self.versions = versions

    async def operator_updates(self, name: str, obj: dict[str, Any], selector: str) -> AsyncGenerator[dict[str, Any]]:
        for v in self.versions:
            yield conv.to_resource(v)
        await asyncio.sleep(3600)


def _follow(versions: list[SpanOperator], budget: float = 5.0) -> tuple[SpanOperator, list[str]]:
    lines: list[str] = []
    start = operator("move-1", ("a",))
    session: Any = FakeSession(versions)
    final = asyncio.run(follow_operator(session, conv.to_resource(start), budget, lines.append))
    return final, lines


def test_follow_prints_each_transition_once() -> None:
    base = operator("move-1", ("a",))
    versions = [
        replace(base, phase=OpPhase.RUNNING, stage=Stage.REMOVE_ORIGIN),
        replace(base, phase=OpPhase.RUNNING, stage=Stage.REMOVE_ORIGIN, epoch=2),
        replace(base, phase=OpPhase.RUNNING, stage=Stage.ADD_DEST),
        replace(base, phase=OpPhase.FAILED, status_reason="DestinationLost"),
    ]
    final, lines = _follow(versions)
    assert final.phase is OpPhase.FAILED
    assert [line.split()[-1] for line in lines] == [
        "Pending",
        "Running/RemoveOrigin",
        "Running/AddDest",
        "(DestinationLost)",
    ]


def test_follow_times_out() -> None:
    base = operator("move-1", ("a",))
    with pytest.raises(Failed) as exc:
        _follow([replace(base, phase=OpPhase.RUNNING, stage=Stage.ADD_DEST)], budget=0.2)
    assert "timed out after 0.2s" in exc.value.message
    assert "Running/AddDest" in exc.value.message
    assert "SpanOperator move-1 was created and keeps running" in exc.value.message
    assert "kubectl get spanoperators move-1 -n default -w" in exc.value.message


def test_main_usage_errors_and_help(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "exit codes:" in out
    assert "kubectl changefeed" in out
    assert main(["move", "span-a"]) == EXIT_USAGE  # --to is required
    assert "--to" in capsys.readouterr().err
    assert main(["split", "span-a", "--into", "2", "--at", "7400"]) == EXIT_USAGE
    assert "not allowed with" in capsys.readouterr().err
    assert main(["nonsense"]) == EXIT_USAGE
    capsys.readouterr()
    assert main(["--kubeconfig", str(tmp_path / "missing"), "status"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot load kubeconfig {tmp_path / 'missing'}: ")
    assert err.count("\n") == 1


def test_main_connection_refused_is_exit_1(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
        "clusters: [{name: x, cluster: {server: 'http://127.0.0.1:1'}}]\n"
        "users: [{name: x, user: {token: t}}]\n"
        "contexts: [{name: x, context: {cluster: x, user: x, namespace: team}}]\n"
    )
    assert main(["--kubeconfig", str(kubeconfig), "status"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert err.startswith("error: listing ")
    assert "namespace 'team'" in err  # the context's namespace is the default
    assert "cannot reach the API server at http://127.0.0.1:1" in err
    assert err.count("\n") == 1


# ------------------------------------------------------------------------------------------------------
# main against a fake API client (kube.connect replaced): exit codes, what is listed, retries, Ctrl-C


class FakeClient:
    """The verbs Session uses, on in-memory objects. ``create_errors`` are raised by the first creates;
    ``watches`` scripts the successive watches (events to yield, or callables to call), after which a
    watch stays quiet; ``on_list`` is called (awaited) before each listing."""

    def __init__(
        self,
        objects: dict[str, list[dict[str, Any]]],
        *,
        create_errors: tuple[Exception, ...] = (),
        watches: list[list[Any]] | None = None,
        on_list: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.config = Config(url="http://fake:1")
        self.objects = objects
        self.create_errors = list(create_errors)
        self.watches = list(watches or [])
        self.on_list = on_list
        self.listed: list[str] = []
        self.attempted: list[str] = []
        self.patched: list[tuple[str, str, dict[str, Any]]] = []

    async def __aenter__(self) -> FakeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def list(
        self, res: Any, namespace: str, label_selector: str = "", field_selector: str = ""
    ) -> tuple[list[dict[str, Any]], str]:
        self.listed.append(res.plural)
        if self.on_list is not None:
            await self.on_list(res.plural)
        items = [dict(o) for o in self.objects.get(res.plural, [])]
        if field_selector.startswith("metadata.name="):
            items = [o for o in items if o["metadata"]["name"] == field_selector.split("=", 1)[1]]
        return items, "1"

    async def create(self, res: Any, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.attempted.append(body["metadata"]["name"])
        if self.create_errors:
            raise self.create_errors.pop(0)
        obj = {**body, "metadata": {**body["metadata"], "resourceVersion": "5"}}
        self.objects.setdefault(res.plural, []).append(obj)
        return obj

    async def get(self, res: Any, namespace: str, name: str) -> dict[str, Any]:
        return next(o for o in self.objects.get(res.plural, []) if o["metadata"]["name"] == name)

    async def patch(self, res: Any, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.patched.append((res.plural, name, patch))
        return {"metadata": {"name": name}, **patch}

    async def watch(self, res: Any, namespace: str, rv: str, **kw: Any) -> AsyncGenerator[dict[str, Any]]:
        if self.watches:
            for ev in self.watches.pop(0):
                if callable(ev):
                    ev()
                else:
                    yield ev
            return
        await asyncio.sleep(3600)
        yield {}  # pragma: no cover


def world() -> dict[str, list[dict[str, Any]]]:
    """A changefeed, its table, two Replicating spans (a on c0, b on c1), three live captures."""
    now = time.time()
    caps = [Capture(name=c, namespace="ns", renew_time=now, lease_duration=3600) for c in ("c0", "c1", "c2")]
    return {
        "changefeeds": [conv.to_resource(Changefeed(name=CF, namespace="ns"))],
        "tables": [conv.to_resource(Table(name="t1", namespace="ns", changefeed=CF, table_id=1))],
        "spans": [conv.to_resource(span("a", LOW, "c0", namespace="ns")), conv.to_resource(span("b", HIGH, "c1"))],
        "captures": [conv.to_resource(c) for c in caps],
        "leases": [conv.lease_resource(c) for c in caps],
    }


def write_kubeconfig(path: Path, server: str = "http://127.0.0.1:1", extra_cluster: str = "", user: str = "") -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
        f"clusters: [{{name: x, cluster: {{server: '{server}'{extra_cluster}}}}}]\n"
        f"users: [{{name: x, user: {{{user or 'token: t'}}}}}]\n"
        "contexts: [{name: x, context: {cluster: x, user: x, namespace: ns}}]\n"
    )
    return path


class Plugin:
    """``main`` with ``--kubeconfig`` of a valid file and the API client replaced by ``client``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        self.monkeypatch = monkeypatch
        self.capsys = capsys
        self.kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig"))

    def __call__(self, client: FakeClient, *args: str) -> tuple[int, str, str]:
        self.monkeypatch.setattr(kube, "connect", lambda config: client)
        self.capsys.readouterr()
        rc = main(["--kubeconfig", self.kubeconfig, *args])
        out, err = self.capsys.readouterr()
        return rc, out, err


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> Plugin:
    return Plugin(monkeypatch, capsys, tmp_path)


CA_GARBAGE = "garbage, not PEM\n"
BROKEN_KUBECONFIGS = {
    "invalid YAML": lambda d: _text(d / "k", "apiVersion: v1\nclusters: [{name: x\n  bad: [\n"),
    "CA file with garbage": lambda d: write_kubeconfig(
        d / "k", "https://127.0.0.1:1", f", certificate-authority: {_text(d / 'ca.pem', CA_GARBAGE)}"
    ),
    "client certificate garbage": lambda d: write_kubeconfig(
        d / "k", "https://127.0.0.1:1", user="client-certificate-data: Z2FyYmFnZQo=, client-key-data: Z2FyYmFnZQo="
    ),
    "client certificate not base64": lambda d: write_kubeconfig(
        d / "k", "https://127.0.0.1:1", user="client-certificate-data: '!!!x', client-key-data: Z2FyYmFnZQo="
    ),
    "server without a scheme": lambda d: write_kubeconfig(d / "k", "127.0.0.1:6443"),
    "server with an odd scheme": lambda d: write_kubeconfig(d / "k", "localhost:6443"),
}


def _text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", sorted(BROKEN_KUBECONFIGS))
def test_a_broken_kubeconfig_is_one_usage_error(case: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = BROKEN_KUBECONFIGS[case](tmp_path)
    assert main(["--kubeconfig", str(path), "status"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert str(path) in err
    assert err.count("\n") == 1, err


def test_a_server_url_without_scheme_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path / "k", "127.0.0.1:6443")
    assert main(["--kubeconfig", str(path), "status"]) == EXIT_USAGE
    assert capsys.readouterr().err == (
        f"error: kubeconfig {path}: server '127.0.0.1:6443' is not an http(s) URL (e.g. https://127.0.0.1:6443)\n"
    )


def test_kubeconfig_path_falls_back_to_in_cluster_only_without_a_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    assert kube.kubeconfig_path(None) is None
    assert kube.kubeconfig_path("explicit") == "explicit"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text("x")
    assert kube.kubeconfig_path(None) == str(home / ".kube" / "config")
    some = _text(tmp_path / "some", "x")
    listed = os.pathsep.join([str(tmp_path / "missing"), str(some)])
    monkeypatch.setenv("KUBECONFIG", listed)
    assert kube.kubeconfig_path(None) == listed
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))  # kubectl ignores ~/.kube/config then
    assert kube.kubeconfig_path(None) is None


def test_a_kubeconfig_error_is_not_hidden_by_the_in_cluster_fallback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Without --kubeconfig: $KUBECONFIG's own error (no current-context, a context typo), not the
    in-cluster loader's; in-cluster is tried only when there is no kubeconfig file at all."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kconfig.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", "~/.kube/config")
    path = write_kubeconfig(tmp_path / "kubeconfig")
    path.write_text(path.read_text().replace("current-context: x\n", ""))
    monkeypatch.setenv("KUBECONFIG", str(path))
    assert main(["status"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot load kubeconfig {path}: ")
    assert "current-context" in err
    write_kubeconfig(path)
    assert main(["--context", "typo", "status"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot load kubeconfig {path}: ")
    assert "typo" in err
    monkeypatch.delenv("KUBECONFIG")
    assert main(["status"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: cannot load a kubeconfig: no $KUBECONFIG, no ~/.kube/config, and not in a pod: ")
    assert err.count("\n") == 1


def test_an_unexpected_exception_is_one_line(
    plugin: Plugin, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def boom(session: Any, args: Any) -> int:
        raise RuntimeError("something\nunforeseen")

    monkeypatch.setitem(COMMANDS, "status", boom)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert plugin(FakeClient(world()), "status") == (EXIT_FAILED, "", "error: RuntimeError: something unforeseen\n")
    monkeypatch.setenv(DEBUG_ENV, "1")
    rc, _, err = plugin(FakeClient(world()), "status")
    assert rc == EXIT_FAILED
    assert err.startswith("Traceback (most recent call last):")
    assert err.endswith("error: RuntimeError: something unforeseen\n")


def test_a_closed_stdout_ends_quietly_with_141(plugin: Plugin, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kubectl changefeed spans | head -1``: no BrokenPipeError traceback; stdout then points at /dev/null,
    so that the interpreter's final flush does not fail again."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        rc, _, err = plugin(FakeClient(world()), "spans")
        assert (rc, err) == (EXIT_BROKEN_PIPE, "")
        closed.write("x" * 100_000)
        closed.flush()  # /dev/null now: no EPIPE


def test_each_command_lists_only_what_it_reads(plugin: Plugin) -> None:
    """Captures and Leases only where a capture's liveness matters (docs/kubectl-plugin.md, RBAC)."""
    liveness = {"captures", "leases"}
    expected = {
        ("status",): {"changefeeds", "spans", "spanoperators", *liveness},
        ("spans",): {"changefeeds", "spans"},
        ("operators",): {"changefeeds", "spanoperators"},
        ("move", "a", "--to", "c2", "--dry-run"): {"changefeeds", "spans", "spanoperators", *liveness},
        ("split", "a", "--into", "2", "--dry-run"): {"changefeeds", "tables", "spans", "spanoperators"},
        ("merge", "a", "b", "--dry-run"): {"changefeeds", "spans", "spanoperators"},
        ("drain", "c2"): {"changefeeds", *liveness},
        ("undrain", "c2"): set(),
        ("pause",): {"changefeeds"},
    }
    for args, lists in expected.items():
        client = FakeClient(world())
        rc, out, err = plugin(client, *args)
        assert (rc, err) == (0, ""), (args, out, err)
        assert set(client.listed) == lists, args
    client = FakeClient(world())
    assert plugin(client, "drain", "c2", "--wait")[0] == 0
    assert client.listed[3:] == ["spans", "spanoperators"]


def test_a_create_the_api_refuses_is_exit_2(plugin: Plugin) -> None:
    invalid = ApiError(422, "Invalid", 'SpanOperator.cdc.maintainer.dev "move-1" is invalid: spec.target: Required')
    client = FakeClient(world(), create_errors=(invalid,))
    rc, out, err = plugin(client, "move", "a", "--to", "c2")
    assert (rc, out) == (EXIT_USAGE, "")
    assert err.startswith(f"error: creating SpanOperator {client.attempted[0]}: refused by the API (Invalid): ")
    assert err.endswith('"move-1" is invalid: spec.target: Required\n')


def test_a_taken_operator_name_is_drawn_again(plugin: Plugin) -> None:
    taken = ApiError(409, "AlreadyExists", "spanoperators already exists")
    client = FakeClient(world(), create_errors=(taken, taken))
    rc, out, err = plugin(client, "split", "a", "--into", "2")
    assert (rc, err) == (0, "")
    assert len(client.attempted) == len(set(client.attempted)) == 3
    assert out == f"{client.attempted[-1]}\n"
    assert [o["metadata"]["name"] for o in client.objects["spanoperators"]] == [client.attempted[-1]]
    client = FakeClient(world(), create_errors=(taken,) * 4)
    rc, out, err = plugin(client, "split", "a", "--into", "2")
    assert (rc, out) == (EXIT_FAILED, "")
    assert err == f"error: creating SpanOperator {client.attempted[-1]}: {client.attempted[-1]!r} already exists\n"
    assert len(set(client.attempted)) == 4
    conflict = ApiError(409, "Conflict", "the object has been modified")  # not a name collision: no retry
    client = FakeClient(world(), create_errors=(conflict,))
    assert plugin(client, "split", "a", "--into", "2")[0] == EXIT_FAILED
    assert len(client.attempted) == 1


def _sigint() -> None:
    signal.raise_signal(signal.SIGINT)


async def _sigint_on(plural: str, wanted: str) -> None:
    if plural == wanted:
        _sigint()
        await asyncio.sleep(3600)


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (asyncio.run turns it into a cancel). A process started in the background
    by a shell without job control inherits SIGINT ignored, and the plugin would never see the Ctrl-C."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_is_exit_130_and_says_what_keeps_running(plugin: Plugin, default_sigint: None) -> None:
    client = FakeClient(world(), watches=[[_sigint]])
    rc, out, err = plugin(client, "move", "a", "--to", "c2", "--wait")
    (name,) = client.attempted
    assert rc == EXIT_INTERRUPTED
    assert out.splitlines()[0] == name
    assert err == (
        f"error: interrupted; SpanOperator {name} was created and keeps running (the maintainer carries it out); "
        f"follow it with: kubectl get spanoperators {name} -n ns -w\n"
    )
    client = FakeClient(world(), on_list=lambda plural: _sigint_on(plural, "spans"))
    rc, out, err = plugin(client, "drain", "c2", "--wait")
    assert (rc, out) == (EXIT_INTERRUPTED, "capture c2 draining\n")
    assert "capture c2 stays draining" in err
    assert "kubectl changefeed undrain c2 -n ns" in err
    client = FakeClient(world(), on_list=lambda plural: _sigint_on(plural, "changefeeds"))
    assert plugin(client, "move", "a", "--to", "c2") == (EXIT_INTERRUPTED, "", "error: interrupted\n")
    assert client.attempted == []


def test_split_into_must_be_an_integer_from_2(capsys: pytest.CaptureFixture[str]) -> None:
    for bad, why in (("0", "got 0"), ("1", "got 1"), ("-3", "got -3"), ("129", "got 129"), ("x", "integer")):
        assert main(["split", "a", "--into", bad]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert "argument --into: must be" in err, err
        assert why in err
    assert main(["split", "a"]) == EXIT_USAGE
    assert "one of the arguments --into --at is required" in capsys.readouterr().err


def test_drain_wait_timeout_bounds_a_slow_listing() -> None:
    class Slow:
        namespace = "ns"

        async def snapshot(self, kinds: Any = ()) -> Snapshot:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

    async def wait() -> int:
        session: Any = Slow()
        return await asyncio.wait_for(commands._wait_drained(session, "c0", [CF], 0.2, 0.05), 10)

    with pytest.raises(Failed) as exc:
        asyncio.run(wait())
    assert exc.value.message == (
        "timed out after 0.2s draining capture 'c0': no listing answered in time; it stays draining"
    )


def test_the_operator_watch_backs_off_on_errors_other_than_410(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []

    async def pause(seconds: float) -> None:
        sleeps.append(seconds)

    monkeypatch.setattr(kube, "pause", pause)
    op = operator("move-1", ("a",), namespace="ns")
    created = conv.to_resource(op)
    done = conv.to_resource(replace(op, phase=OpPhase.SUCCEEDED))

    def error(code: int) -> dict[str, Any]:
        return {"type": "ERROR", "object": {"kind": "Status", "status": "Failure", "code": code}}

    watches = [[error(500)]] * 6 + [[error(410)], [{"type": "MODIFIED", "object": done}]]
    client = FakeClient({"spanoperators": [created]}, watches=watches)
    session: Any = kube.Session(client, "ns")  # type: ignore[arg-type]
    final = asyncio.run(follow_operator(session, created, 5.0, lambda line: None))
    assert final.phase is OpPhase.SUCCEEDED
    assert sleeps == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]  # none after the 410: an expiry, resumed at once


class FinishingClient(FakeClient):
    """The operator watch reports the SpanOperator just created as the maintainer finished it: ``finish(op)``."""

    def __init__(self, objects: dict[str, list[dict[str, Any]]], finish: Callable[[SpanOperator], SpanOperator]):
        super().__init__(objects)
        self.finish = finish

    async def watch(self, res: Any, namespace: str, rv: str, **kw: Any) -> AsyncGenerator[dict[str, Any]]:
        created = conv.operator_from_resource(self.objects["spanoperators"][-1])
        yield {"type": "MODIFIED", "object": conv.to_resource(replace(self.finish(created), resource_version="6"))}
        await asyncio.sleep(3600)


def _partially_placed(reason: str, message: str, capture: str = "") -> Callable[[SpanOperator], SpanOperator]:
    """The maintainer's outcome when none of the new spans could be placed (every destination lost)."""

    def finish(op: SpanOperator) -> SpanOperator:
        spans = [f"{op.name}-new{i}" for i in range(max(op.split_into, 1))]
        ranges = LOW.split_at(LOW.even_split_keys(len(spans))) if len(spans) > 1 else (T1,)
        targets = tuple(
            Target(span=s, key_range=r, capture=capture, done=True, lost=True, lost_reason=reason, lost_message=message)
            for s, r in zip(spans, ranges, strict=True)
        )
        return replace(
            op,
            phase=OpPhase.SUCCEEDED,
            stage=Stage.ADD_SPANS,
            status_reason="PartiallyPlaced",
            message=f"{len(targets)} of {len(targets)} new spans not placed: ...",
            targets=targets,
        )

    return finish


def test_split_and_merge_wait_exit_0_and_print_partially_placed_when_no_new_span_was_placed(plugin: Plugin) -> None:
    """A Split or Merge whose new spans exist but were all left Absent (destinations lost) did what was asked:
    ``--wait`` exits 0, prints PartiallyPlaced and, per new span, why it was not placed."""
    lost = "destination capture c1 lost; left Absent for the basic scheduler"
    client = FinishingClient(world(), _partially_placed("DestinationLost", lost, "c1"))
    rc, out, err = plugin(client, "split", "a", "--into", "2", "--wait")
    (name,) = client.attempted
    assert (rc, err) == (0, ""), out + err
    lines = out.splitlines()
    assert lines[-3:] == [
        f"Split {name} succeeded (PartiallyPlaced)",
        *(
            f"  span {name}-new{i} [{r.hex()[0]}, {r.hex()[1]}) not placed (DestinationLost): {lost}"
            for i, r in enumerate(LOW.split_at(LOW.even_split_keys(2)))
        ),
    ]
    assert any(line.endswith(f"{name}  Succeeded (PartiallyPlaced)") for line in lines)
    none = "no live, non-draining capture (c0, c1, c2 lost); left Absent for the basic scheduler, which places ..."
    client = FinishingClient(world(), _partially_placed("NoCapture", none))
    rc, out, err = plugin(client, "merge", "a", "b", "--wait")
    (name,) = client.attempted
    assert (rc, err) == (0, ""), out + err
    assert out.splitlines()[-2:] == [
        f"Merge {name} succeeded (PartiallyPlaced)",
        f"  span {name}-new0 [{T1.hex()[0]}, {T1.hex()[1]}) not placed (NoCapture): {none}",
    ]


# ------------------------------------------------------------------------------------------------------
# teardown --wait in a namespace being deleted (issue 36)


class NamespaceClient(FakeClient):
    """A FakeClient whose namespace is Terminating (or not), whose namespace controller marks every Changefeed
    for deletion at the ``mark_at``-th listing of changefeeds (0: never), and which removes what loses its
    last finalizer."""

    def __init__(self, objects: dict[str, list[dict[str, Any]]], *, terminating: bool, mark_at: int) -> None:
        super().__init__(objects, on_list=self._namespace_controller)
        self.terminating = terminating
        self.mark_at = mark_at
        self.changefeed_lists = 0
        self.namespace_reads = 0

    async def _namespace_controller(self, plural: str) -> None:
        if plural != "changefeeds":
            return
        self.changefeed_lists += 1
        if self.changefeed_lists == self.mark_at:
            for cf in self.objects["changefeeds"]:
                cf["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"

    async def request(self, verb: str, method: str, path: str, **kw: Any) -> dict[str, Any]:
        assert (verb, method, path) == ("get", "GET", "/api/v1/namespaces/ns"), (verb, method, path)
        self.namespace_reads += 1
        meta: dict[str, Any] = {"name": "ns"}
        if self.terminating:
            meta["deletionTimestamp"] = "2026-12-04T00:00:00Z"
        return {"kind": "Namespace", "metadata": meta}

    async def patch(self, res: Any, namespace: str, name: str, patch: dict[str, Any], sub: str = "") -> dict[str, Any]:
        out = await super().patch(res, namespace, name, patch)
        if res.plural == "changefeeds" and (patch.get("metadata") or {}).get("finalizers") == []:
            self.objects["changefeeds"] = [o for o in self.objects["changefeeds"] if o["metadata"]["name"] != name]
        return out


def _teardown_world() -> dict[str, list[dict[str, Any]]]:
    cf = conv.to_resource(Changefeed(name=CF, namespace="ns"))
    cf["metadata"].update(finalizers=["cdc.maintainer.dev/teardown"], resourceVersion="4")
    return {"changefeeds": [cf], "dispatchers": [], "tables": [], "leases": []}


def test_teardown_wait_in_a_terminating_namespace_waits_for_the_changefeed_to_be_marked(plugin: Plugin) -> None:
    """Issue 36: right after ``kubectl delete namespace`` the Changefeed is not yet marked (a real namespace
    controller comes about 5 s later): ``--wait`` waits for the mark, says so once, then tears down."""
    client = NamespaceClient(_teardown_world(), terminating=True, mark_at=3)
    rc, out, err = plugin(client, "-n", "ns", "teardown", "--wait", "--timeout", "30", "--interval", "0.01")
    assert (rc, err) == (0, ""), out + err
    lines = out.splitlines()
    assert lines[0] == (
        f"waiting: namespace ns is being deleted; its namespace controller has not yet marked changefeed {CF} "
        "for deletion"
    )
    assert lines.count(lines[0]) == 1
    assert lines[-1] == f"changefeed {CF} released: the garbage collector removes what it owned"
    assert client.changefeed_lists == 3
    assert ("changefeeds", CF, {"metadata": {"finalizers": [], "resourceVersion": "4"}}) in client.patched


def test_teardown_wait_names_the_changefeed_it_waits_for(plugin: Plugin) -> None:
    client = NamespaceClient(_teardown_world(), terminating=True, mark_at=2)
    rc, out, err = plugin(client, "-n", "ns", "teardown", "-c", CF, "--wait", "--interval", "0.01")
    assert (rc, err) == (0, ""), out + err
    assert out.startswith("waiting: namespace ns is being deleted")
    assert f"changefeed {CF} released" in out


def test_teardown_wait_for_a_mark_is_bounded_by_its_timeout(plugin: Plugin) -> None:
    client = NamespaceClient(_teardown_world(), terminating=True, mark_at=0)
    rc, out, err = plugin(client, "-n", "ns", "teardown", "--wait", "--timeout", "0.2", "--interval", "0.01")
    assert rc == EXIT_FAILED, out + err
    assert err.startswith("error: timed out after 0.2s: namespace ns is being deleted; its namespace controller ")
    assert err.count("\n") == 1
    assert client.patched == []


def test_teardown_outside_a_terminating_namespace_still_refuses_at_once(plugin: Plugin) -> None:
    """A namespace that is not being deleted marks nothing: waiting would be for ever, so exit 2 as before,
    with or without --wait; without --wait the Namespace is not even read."""
    for args in (("--wait", "--timeout", "30", "--interval", "0.01"), ()):
        client = NamespaceClient(_teardown_world(), terminating=False, mark_at=0)
        rc, out, err = plugin(client, "-n", "ns", "teardown", *args)
        assert (rc, out) == (EXIT_USAGE, "")
        assert err == "error: no Changefeed is being deleted in namespace 'ns'\n"
        assert client.namespace_reads == (1 if args else 0)
        rc, _, err = plugin(client, "-n", "ns", "teardown", "-c", CF, *args)
        assert rc == EXIT_USAGE
        assert f"changefeed {CF} is not being deleted" in err
    client = NamespaceClient(_teardown_world(), terminating=True, mark_at=0)
    rc, _, err = plugin(client, "-n", "ns", "teardown")
    assert (rc, client.namespace_reads) == (EXIT_USAGE, 0), "without --wait nothing is waited for"
    assert "no Changefeed is being deleted" in err
