"""The kubectl plugin against the embedded API (over HTTPS) with a real maintainer and three captures.

Everything goes through ``controller.cli.__main__.main`` in-process (``--kubeconfig`` of the API under
test, ``-n`` the test's namespace), as ``kubectl changefeed ...`` would run it: status, spans and
operators output; move, split (--into and --at) and merge with --wait; the refusals (exit 2, nothing
created); --dry-run; drain --wait; and a Move that fails at the maintainer (its destination killed), which
``--wait`` reports with its reason and exit status 1. Balancing is off
(``spec.scheduler.balanceIntervalSeconds: 0``) so that only the plugin's operators move spans.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import yaml

from controller.cli.__main__ import main
from controller.model.keys import KeyRange
from controller.model.records import SpanOperator
from controller.model.states import OpPhase, OpSource, SpanState
from tests.integration.harness import CHANGEFEED, GROUP, Api, Snap, System, Watch, all_settled, no_gap, set_hooks

#: Over HTTPS, as a real cluster serves: each --wait that watched an operator left its TLS transport unclosed
#: (a ResourceWarning, an error under filterwarnings = error), which plain HTTP never shows (issue 36).
EMBEDDED_TLS = True
CAPTURES = ["c0", "c1", "c2"]
SETTLE = 60.0
WAIT = "60"


class Cli:
    def __init__(self, api: Api, capsys: pytest.CaptureFixture[str]) -> None:
        self.api = api
        self.capsys = capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        rc = main(["--kubeconfig", str(self.api.kubeconfig), "-n", self.api.namespace, *args])
        out, err = self.capsys.readouterr()
        return rc, out, err


def boot(api: Api, system: System, tables: dict[int, int]) -> tuple[Watch, Snap]:
    """Captures alive, the changefeed (balancing off) and its tables, a maintainer, everything placed."""
    watch = Watch(api, system)
    for c in CAPTURES:
        system.capture(c)
    watch.until(lambda s: all(s.alive(c) for c in CAPTURES), "captures registered", 30)
    api.create("changefeeds", "Changefeed", CHANGEFEED, {"scheduler": {"balanceIntervalSeconds": 0}})
    for table_id, pre_split in tables.items():
        api.table(table_id, pre_split)
    system.maintainer("m1")
    expected = sum(max(1, n) for n in tables.values())

    def placed(s: Snap) -> object:
        if len(s.spans) != expected:
            return f"{len(s.spans)} spans, want {expected}"
        return all_settled(s)

    return watch, watch.until(placed, "initial placement", SETTLE)


def settled(s: Snap) -> object:
    return all_settled(s)


def user_operators(snap: Snap) -> list[str]:
    return sorted(o.name for o in snap.operators.values() if o.source is OpSource.USER)


def test_plugin_moves_splits_and_merges(api: Api, system: System, capsys: pytest.CaptureFixture[str]) -> None:
    cli = Cli(api, capsys)
    watch, snap = boot(api, system, {1: 3, 2: 0})
    a, b, c = snap.spans_of(1)
    (t2,) = snap.spans_of(2)

    # -- reading ------------------------------------------------------------------------------------
    rc, out, err = cli("status")
    assert (rc, err) == (0, ""), err
    assert f"Changefeed {CHANGEFEED} (namespace {api.namespace})" in out
    assert f"epoch {snap.epoch}, holder m1" in out
    assert "Bootstrapped: True" in out
    assert "Paused:       no" in out
    assert "Spans:        4: Replicating 4" in out
    assert "3 alive, 0 lost, 0 draining" in out
    assert "lag " in out
    for name in CAPTURES:
        assert f"  {name}  " in out

    rc, out, _ = cli("spans")
    assert rc == 0
    for sp in (a, b, c, t2):
        row = next(line for line in out.splitlines() if line.startswith(sp.name)).split()
        assert row[1:8] == [str(sp.table_id), "default", *sp.key_range.hex(), "Replicating", sp.capture, sp.dispatcher]
    rc, out, _ = cli("spans", "--table", "2")
    assert rc == 0
    assert t2.name in out
    assert a.name not in out

    # -- refusals: exit 2, one line on stderr, nothing created ----------------------------------------
    api.create("captures", "Capture", "ghost", {})  # registered, but no Lease: not alive
    before = user_operators(watch.poll())
    key = a.key_range.even_split_keys(2)[0].hex()
    refusals = [
        (("move", "no-such-span", "--to", "c0"), "span 'no-such-span' not found"),
        (("move", t2.name, "--to", "ghost"), "capture 'ghost' is not alive"),
        (("move", t2.name, "--to", "nobody"), "capture 'nobody' not found"),
        (("merge", a.name, c.name), "are not adjacent"),
        (("merge", a.name, t2.name), "one table and mode"),
        (("merge", a.name), "at least two spans"),
        (("split", a.name, "--at", c.key_range.start.hex()), "not strictly inside"),
    ]
    for args, message in refusals:
        rc, out, err = cli(*args)
        assert rc == 2, (args, out, err)
        assert err.startswith("error: ")
        assert message in err, (args, err)
        assert err.count("\n") == 1, err
    rc, out, err = cli("split", a.name, "--into", "1")  # refused by the flag parser (usage, then the error)
    assert rc == 2, (out, err)
    assert "argument --into: must be between 2 and 128, got 1" in err
    rc, out, err = cli("move", t2.name, "--to", "c0" if t2.capture != "c0" else "c1", "--dry-run")
    assert (rc, err) == (0, "")
    body = yaml.safe_load(out)
    assert body["kind"] == "SpanOperator"
    assert body["metadata"]["labels"] == {f"{GROUP}/changefeed": CHANGEFEED}
    assert body["spec"]["type"] == "Move"
    assert body["spec"]["spans"] == [t2.name]
    rc, out, _ = cli("split", a.name, "--at", key, "--dry-run")
    assert rc == 0
    assert yaml.safe_load(out)["spec"]["splitKeys"] == [key]
    assert user_operators(watch.poll()) == before == []

    # -- move --wait ----------------------------------------------------------------------------------
    dest = next(x for x in CAPTURES if x != t2.capture)
    rc, out, err = cli("move", t2.name, "--to", dest, "--wait", "--timeout", WAIT)
    assert (rc, err) == (0, ""), out + err
    lines = out.splitlines()
    move_op = lines[0]
    assert move_op.startswith("move-")
    assert any(line.endswith(f"{move_op}  Running/RemoveOrigin") for line in lines), out
    assert any(line.endswith(f"{move_op}  Succeeded") for line in lines), out
    assert f"on {dest}" in out
    snap = watch.until(settled, "settled after the move", SETTLE)
    with watch.explained(snap):
        assert snap.spans[t2.name].capture == dest
        op = snap.operators[move_op]
        assert (op.phase, op.source, op.target) == (OpPhase.SUCCEEDED, OpSource.USER, dest)
        assert dict(op.labels) == {f"{GROUP}/changefeed": CHANGEFEED}

    # -- split --into --wait ----------------------------------------------------------------------------
    rc, out, err = cli("split", t2.name, "--into", "2", "--wait", "--timeout", WAIT)
    assert (rc, err) == (0, ""), out + err
    assert "Running/CreateSpans" in out
    assert "Succeeded" in out
    snap = watch.until(settled, "settled after the split", SETTLE)
    with watch.explained(snap):
        halves = snap.spans_of(2)
        assert len(halves) == 2
        assert KeyRange(halves[0].key_range.start, halves[1].key_range.end) == t2.key_range
        assert t2.name not in snap.spans

    # -- split --at --wait ------------------------------------------------------------------------------
    rc, out, err = cli("split", a.name, "--at", key, "--wait", "--timeout", WAIT)
    assert (rc, err) == (0, ""), out + err
    snap = watch.until(settled, "settled after the split at a key", SETTLE)
    with watch.explained(snap):
        pieces = snap.spans_of(1)
        assert [p.key_range for p in pieces[:2]] == [
            KeyRange(a.key_range.start, bytes.fromhex(key)),
            KeyRange(bytes.fromhex(key), a.key_range.end),
        ]
        assert [p.name for p in pieces[2:]] == [b.name, c.name]

    # -- merge --wait of two adjacent spans -------------------------------------------------------------
    rc, out, err = cli("merge", halves[1].name, halves[0].name, "--wait", "--timeout", WAIT)
    assert (rc, err) == (0, ""), out + err
    merge_op = out.splitlines()[0]
    assert merge_op.startswith("merge-")
    snap = watch.until(settled, "settled after the merge", SETTLE)
    with watch.explained(snap):
        (merged,) = snap.spans_of(2)
        assert merged.key_range == t2.key_range
        assert merged.state is SpanState.REPLICATING

    # -- reading again ------------------------------------------------------------------------------------
    rc, out, _ = cli("operators")
    assert rc == 0
    assert "In flight (0):" in out
    for name in user_operators(snap):
        row = next(line for line in out.splitlines() if line.strip().startswith(name)).split()
        assert row[2:4] == ["user", "Succeeded"], row
    rc, out, _ = cli("status")
    assert rc == 0
    assert "Spans:        5: Replicating 5" in out
    assert "ghost" in out
    assert "Operators in flight (0):" in out

    # -- pause / resume --------------------------------------------------------------------------------------
    rc, out, _ = cli("pause")
    assert (rc, out) == (
        0, f"changefeed {CHANGEFEED} paused: its captures stop reading and writing within 10 s; the checkpoint holds\n"
    )  # fmt: skip
    assert (api.get("changefeeds", CHANGEFEED) or {})["spec"]["paused"] is True
    rc, out, _ = cli("status")
    assert "Paused:       replication (spec.paused)" in out
    rc, out, _ = cli("resume")
    assert rc == 0
    assert (api.get("changefeeds", CHANGEFEED) or {})["spec"]["paused"] is False
    rc, out, _ = cli("pause", "--schedulers-only")
    assert (rc, out) == (0, f"changefeed {CHANGEFEED}: automatic schedulers paused (replication goes on)\n")
    spec = (api.get("changefeeds", CHANGEFEED) or {})["spec"]
    assert (spec["paused"], spec["scheduler"]["paused"]) == (False, True)
    rc, out, _ = cli("status")
    assert "Paused:       the schedulers only (spec.scheduler.paused)" in out
    rc, out, _ = cli("resume", "--schedulers-only")
    assert rc == 0
    assert (api.get("changefeeds", CHANGEFEED) or {})["spec"]["scheduler"]["paused"] is False
    no_gap(watch)  # the moves, split and merge the plugin asked for skipped nothing


def _drained(capture: str) -> Callable[[Snap], object]:
    def check(s: Snap) -> object:
        held = [sp.name for sp in s.spans.values() if sp.capture == capture]
        return f"{capture} holds {held}" if held else all_settled(s)

    return check


def test_plugin_drains_a_capture(api: Api, system: System, capsys: pytest.CaptureFixture[str]) -> None:
    cli = Cli(api, capsys)
    watch, snap = boot(api, system, {1: 6})
    victim = max(CAPTURES, key=lambda c: sum(1 for s in snap.spans.values() if s.capture == c))
    assert any(s.capture == victim for s in snap.spans.values())

    rc, _, err = cli("drain", "nobody")
    assert rc == 2
    assert err == f"error: capture 'nobody' not found in namespace '{api.namespace}'\n"

    rc, out, err = cli("drain", victim, "--wait", "--timeout", WAIT)
    assert (rc, err) == (0, ""), out + err
    assert out.splitlines()[0] == f"capture {victim} draining"
    assert "remain on" in out
    assert out.splitlines()[-1] == f"capture {victim} drained"
    snap = watch.until(_drained(victim), f"{victim} drained and settled", SETTLE)
    with watch.explained(snap):
        assert not [s.name for s in snap.spans.values() if s.capture == victim]
        assert snap.captures[victim].draining
    rc, out, _ = cli("status")
    row = next(line for line in out.splitlines() if line.strip().startswith(f"{victim} ")).split()
    assert row == [victim, "alive,", "draining", "0"]

    rc, out, _ = cli("undrain", victim)
    assert (rc, out) == (0, f"capture {victim} no longer draining\n")
    assert not watch.poll().captures[victim].draining
    no_gap(watch)  # the drain's moves skipped nothing


def test_plugin_wait_shows_a_failure_of_the_maintainer(
    api: Api, system: System, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Move whose destination dies mid-way: ``--wait`` prints the stages and the reason, and exits 1."""
    cli = Cli(api, capsys)
    watch, snap = boot(api, system, {1: 0})
    (span,) = snap.spans_of(1)
    dest = next(c for c in CAPTURES if c != span.capture)
    set_hooks(api, system, [dest], pause_create="*")  # the Move waits in AddDest on dest
    result: list[tuple[int, str, str]] = []
    waiter = threading.Thread(
        target=lambda: result.append(cli("move", span.name, "--to", dest, "--wait", "--timeout", WAIT))
    )
    waiter.start()
    watch.until(
        lambda s: any(o.stage.value == "AddDest" for o in s.operators.values() if o.source is OpSource.USER),
        "the Move in AddDest",
        SETTLE,
    )
    system.signal(dest)  # SIGKILL: its Lease lapses, the maintainer gives the destination up
    waiter.join(timeout=float(WAIT) + 30)
    assert not waiter.is_alive()
    ((rc, out, err),) = result
    assert rc == 1, out + err
    assert "Running/AddDest" in out
    assert err.startswith("error: Move ")
    assert "Failed: DestinationLost" in err
    snap = watch.until(settled, "the span placed again after the failed Move", SETTLE)
    with watch.explained(snap):
        assert snap.spans[span.name].state is SpanState.REPLICATING
        assert snap.spans[span.name].capture != dest
    no_gap(watch)  # nor did the killed destination


def _user_op_in(snap: Snap, stage: str) -> SpanOperator | None:
    ops = [o for o in snap.operators.values() if o.source is OpSource.USER and o.phase is OpPhase.RUNNING]
    return next((o for o in ops if o.stage.value == stage), None)


def test_plugin_wait_split_and_merge_succeed_partially_placed_when_every_destination_dies(
    api: Api, system: System, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found on a real cluster: a Split whose children's destinations all died ended Failed (DestinationLost)
    and ``split --wait`` exited 1, although the parent was gone and the children existed. Now the Split
    (and a Merge in the same case) succeeds "PartiallyPlaced": ``--wait`` exits 0, prints the reason and
    why each new span was not placed, and the basic scheduler places the new spans on a live capture."""
    cli = Cli(api, capsys)
    watch, snap = boot(api, system, {1: 0})
    (whole,) = snap.spans_of(1)

    def follow(*args: str) -> tuple[threading.Thread, list[tuple[int, str, str]]]:
        result: list[tuple[int, str, str]] = []
        waiter = threading.Thread(target=lambda: result.append(cli(*args, "--wait", "--timeout", WAIT)))
        waiter.start()
        return waiter, result

    def finished(waiter: threading.Thread, result: list[tuple[int, str, str]]) -> tuple[int, str, str]:
        waiter.join(timeout=float(WAIT) + 30)
        assert not waiter.is_alive()
        ((rc, out, err),) = result
        return rc, out, err

    # -- split: every child's destination killed while the children wait in AddSpans --------------------
    set_hooks(api, system, CAPTURES, pause_create="*")
    waiter, result = follow("split", whole.name, "--into", "2")
    op = _user_op_in(watch.until(lambda s: _user_op_in(s, "AddSpans"), "the Split in AddSpans", SETTLE), "AddSpans")
    assert op is not None
    dests = sorted({t.capture for t in op.targets})
    survivors = [c for c in CAPTURES if c not in dests]
    assert survivors, dests
    for dest in dests:
        system.signal(dest)  # SIGKILL: its Lease lapses, the maintainer gives the child up
    rc, out, err = finished(waiter, result)
    assert (rc, err) == (0, ""), out + err
    assert "Running/AddSpans" in out
    assert f"Split {op.name} succeeded (PartiallyPlaced)" in out
    for t in op.targets:
        assert f"span {t.span} " in out
        assert f"not placed (DestinationLost): destination capture {t.capture} lost" in out
    set_hooks(api, system, survivors, pause_create=None)
    snap = watch.until(settled, "the children placed by the basic scheduler", SETTLE)
    with watch.explained(snap):
        children = snap.spans_of(1)
        assert [c.name for c in children] == [t.span for t in op.targets]
        assert {c.capture for c in children} <= set(survivors)
        assert snap.operators[op.name].status_reason == "PartiallyPlaced"

    # -- merge: the merged span's destination killed while it waits in AddSpans --------------------------
    system.capture("c3")
    watch.until(lambda s: s.alive("c3"), "capture c3 registered", 30)
    live = [*survivors, "c3"]
    set_hooks(api, system, live, pause_create="*")
    waiter, result = follow("merge", *(c.name for c in children))
    op = _user_op_in(watch.until(lambda s: _user_op_in(s, "AddSpans"), "the Merge in AddSpans", SETTLE), "AddSpans")
    assert op is not None
    ((dest, merged),) = [(t.capture, t.span) for t in op.targets]
    system.signal(dest)
    rc, out, err = finished(waiter, result)
    assert (rc, err) == (0, ""), out + err
    assert f"Merge {op.name} succeeded (PartiallyPlaced)" in out
    assert f"span {merged} " in out
    assert f"not placed (DestinationLost): destination capture {dest} lost" in out
    set_hooks(api, system, [c for c in live if c != dest], pause_create=None)
    snap = watch.until(settled, "the merged span placed by the basic scheduler", SETTLE)
    with watch.explained(snap):
        (span,) = snap.spans_of(1)
        assert (span.name, span.key_range, span.state) == (merged, whole.key_range, SpanState.REPLICATING)
    no_gap(watch)
