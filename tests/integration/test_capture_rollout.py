"""A rolling restart of the captures moves their spans instead of dropping them (issue 24, item 3).

Three real capture processes hold 1,000 spans; each is stopped with SIGTERM in turn, as a StatefulSet rollout
does (highest ordinal first), and started again under the same name. Run with ``--drain-timeout``, a capture
being stopped marks its Capture draining (annotation cdc.maintainer.dev/drain-reason: shutdown), the
maintainer moves every span off with Move operators while the capture keeps replicating them, and the capture
exits once it holds nothing; its next process clears the drain. Checked at every poll: no span Absent, single
ownership, the changefeed's checkpoint within 10 s of now; and at the end: every span of each stopped capture
was moved by a Move before the capture exited, and the delivery ledger has no gap.
"""

from __future__ import annotations

import os
import signal
import time

from controller.model.resources import DRAIN_FOR_SHUTDOWN, DRAIN_REASON_ANNOTATION
from controller.model.states import OpSource, OpType, SpanState
from controller.model.tso import physical_seconds
from tests.integration.harness import CAPTURE_FLAGS, Api, Snap, System, Watch, all_settled, no_gap

CAPTURES = ["c0", "c1", "c2"]
TABLES = 10
SPANS_PER_TABLE = 100
DRAIN = ["--drain-timeout", "60"]
#: The checkpoint must keep moving through the rollout: a drain that stalled it (a Move that never finishes, a
#: capture whose spans go Absent and wait for its Lease) would exceed this. Not a speed assertion: the lag this
#: test sees (6-8 s on a quiet 2-core machine, each Move holding the checkpoint at its start until it finishes)
#: is reported by ``CFM_ROLLOUT_REPORT=1``.
MAX_LAG = 30.0


def test_a_rolling_restart_of_the_captures_moves_every_span_first(api: Api, system: System) -> None:
    watch = Watch(api, system, every=1.5)
    for c in CAPTURES:
        system.capture(c, flags=[*CAPTURE_FLAGS, *DRAIN])
    watch.until(lambda s: all(s.alive(c) for c in CAPTURES), "captures registered", 30)
    api.changefeed()
    for table_id in range(1, TABLES + 1):
        api.table(table_id, SPANS_PER_TABLE)
    system.maintainer("m1")
    total = TABLES * SPANS_PER_TABLE

    def placed(s: Snap) -> object:
        if len(s.spans) != total:
            return f"{len(s.spans)} spans, want {total}"
        return all_settled(s)

    snap = watch.until(placed, "1,000 spans placed", 180)
    with watch.explained(snap):
        assert {s.capture for s in snap.spans.values()} == set(CAPTURES)

    worst_lag = 0.0

    def healthy(s: Snap) -> list[str]:
        """What must hold at every poll of the rollout."""
        nonlocal worst_lag
        problems = [f"span {n} Absent" for n, sp in s.spans.items() if sp.state is SpanState.ABSENT]
        if s.changefeed is not None and s.changefeed.checkpoint_ts:
            lag = time.time() - physical_seconds(s.changefeed.checkpoint_ts)
            worst_lag = max(worst_lag, lag)
            if lag > MAX_LAG:
                problems.append(f"checkpoint lag {lag:.1f}s")
        return problems

    def roll(capture: str) -> None:
        before = watch.poll()
        held = {n for n, sp in before.spans.items() if sp.capture == capture}
        assert held, f"{capture} holds no span before its restart"
        moves_before = set(before.operators)
        # Out of the running set first: its exit is expected (the watch fails on a process that exits).
        proc = system.procs.pop(capture)
        system.gone[f"{capture}-{len(system.gone)}"] = proc
        proc.popen.send_signal(signal.SIGTERM)
        try:
            while proc.popen.poll() is None:
                s = watch.poll()
                problems = healthy(s)
                if problems:
                    raise watch.fail(f"while {capture} drains: " + "; ".join(problems[:5]), s)
                time.sleep(1.0)
        finally:
            if proc.popen.poll() is None:
                proc.popen.kill()
        after = watch.poll()
        with watch.explained(after):
            assert proc.popen.returncode == 0, proc.tail()
            assert proc.count("drained: every dispatcher moved off") == 1, proc.tail()
            assert proc.count("drain timed out") == 0, proc.tail()
            moves = [
                op
                for name, op in after.operators.items()
                if name not in moves_before and op.type is OpType.MOVE and op.source is OpSource.SCHEDULER
            ]
            moved = {sp for op in moves for sp in op.spans}
            assert held <= moved, f"{len(held - moved)} span(s) of {capture} not moved by a Move before it exited"
            cap = after.captures[capture]
            assert cap.draining, "the Capture stays draining until its next process starts"
        # The capture exits once its dispatchers are closed (each Move's destination runs by then); the Moves
        # finish after, writing the spans' new placement.
        names = {op.name for op in moves}

        def finished(s: Snap) -> object:
            problems = healthy(s)
            if problems:
                raise watch.fail("; ".join(problems[:5]), s)
            phases = {s.operators[n].phase.value for n in names if n in s.operators}
            left = [n for n in held if n in s.spans and s.spans[n].capture == capture]
            return (phases <= {"Succeeded"} and not left) or f"phases {sorted(phases)}, {len(left)} spans on {capture}"

        done = watch.until(finished, f"the Moves off {capture} Succeeded", 60)
        if os.environ.get("CFM_ROLLOUT_REPORT"):
            took = sorted(done.operators[n].finished_at - done.operators[n].created for n in names)
            print(
                f"{capture}: {len(took)} Moves, p50 {took[len(took) // 2]:.1f}s, max {took[-1]:.1f}s; "
                f"worst checkpoint lag so far {worst_lag:.1f}s"
            )
        # Its pod comes back under the same name: the new process clears the drain and takes spans again.
        system.capture(capture, flags=[*CAPTURE_FLAGS, *DRAIN])

        def back(s: Snap, name: str = capture) -> object:
            problems = healthy(s)
            if problems:
                raise watch.fail("; ".join(problems[:5]), s)
            cap = s.captures.get(name)
            if cap is None or not s.alive(name) or cap.draining:
                return f"{name} not back (draining={getattr(cap, 'draining', None)})"
            raw = next(c for c in s.raw["captures"] if c["metadata"]["name"] == name)
            annotations = raw["metadata"].get("annotations") or {}
            return annotations.get(DRAIN_REASON_ANNOTATION) != DRAIN_FOR_SHUTDOWN or "annotation still there"

        watch.until(back, f"{capture} back, not draining", 30)

    for capture in reversed(CAPTURES):  # a StatefulSet rolls from the highest ordinal down
        roll(capture)

    no_gap(watch)
    assert worst_lag < MAX_LAG
