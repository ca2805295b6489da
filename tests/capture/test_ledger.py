"""The delivery ledger: what the runtime writes, and the checker finding every gap (and nothing else)."""

from __future__ import annotations

from pathlib import Path

from controller.capture.ledger import Delivered, Ledger, Required, check, read
from controller.capture.runtime import LogicalClockRuntime
from controller.model.keys import KeyRange, table_key
from controller.model.records import Dispatcher
from controller.model.states import Mode
from controller.model.tso import tso

T = KeyRange.of_table(1)
MID = table_key(1) + b"\x80"
LEFT, RIGHT = KeyRange(T.start, MID), KeyRange(MID, T.end)


def got(rng: KeyRange, a: int, b: int, mode: Mode = Mode.DEFAULT, table_id: int = 1) -> Delivered:
    return Delivered(changefeed="cf", table_id=table_id, mode=mode, key_range=rng, from_ts=a, to_ts=b)


def need(a: int, b: int, mode: Mode = Mode.DEFAULT, table_id: int = 1) -> Required:
    return Required("cf", table_id, mode, a, b)


def test_whole_table_covered() -> None:
    assert check([got(T, 0, 100)], [need(0, 100)]) == []


def test_two_spans_side_by_side() -> None:
    assert check([got(LEFT, 0, 100), got(RIGHT, 0, 120)], [need(0, 100)]) == []


def test_keys_nobody_delivered() -> None:
    problems = check([got(LEFT, 0, 100)], [need(0, 100)])
    assert len(problems) == 1
    assert f"keys [{MID.hex()}, {T.end.hex()})" in problems[0]
    assert "nothing delivered in (0, 100]" in problems[0]


def test_a_successor_starting_above_its_predecessor() -> None:
    # A Move whose destination started at 60 while the origin had delivered up to 50 only.
    problems = check([got(T, 0, 50), got(T, 60, 100)], [need(0, 100)])
    assert len(problems) == 1
    assert "nothing delivered in (50, 60]" in problems[0]


def test_handoff_at_the_final_checkpoint_and_duplicates_are_fine() -> None:
    assert check([got(T, 0, 50), got(T, 50, 100)], [need(0, 100)]) == []
    assert check([got(T, 0, 80), got(T, 40, 100), got(T, 10, 20)], [need(0, 100)]) == []


def test_split_and_merge_handoffs() -> None:
    parent = got(T, 0, 50)
    assert check([parent, got(LEFT, 50, 90), got(RIGHT, 45, 100)], [need(0, 90)]) == []
    problems = check([parent, got(LEFT, 50, 90), got(RIGHT, 51, 100)], [need(0, 90)])
    assert len(problems) == 1
    assert "(50, 51]" in problems[0]
    assert MID.hex() in problems[0]
    # Merge: the merged span starts at the lowest final checkpoint of its sources.
    assert check([got(LEFT, 0, 70), got(RIGHT, 0, 60), got(T, 60, 100)], [need(0, 100)]) == []
    assert check([got(LEFT, 0, 70), got(RIGHT, 0, 60), got(T, 70, 100)], [need(0, 100)]) != []


def test_the_start_and_the_end() -> None:
    assert check([got(T, 10, 100)], [need(0, 100)]) != []  # nothing in (0, 10]
    assert check([got(T, 0, 99)], [need(0, 100)]) != []  # nothing in (99, 100]
    assert check([got(T, 0, 99)], [need(0, 99)]) == []
    assert check([], [need(50, 50)]) == []  # nothing required


def test_modes_and_tables_are_separate() -> None:
    assert check([got(T, 0, 100)], [need(0, 100, Mode.REDO)]) != []
    assert check([got(T, 0, 100)], [need(0, 100, table_id=2)]) != []
    assert check([got(T, 0, 100), got(KeyRange.of_table(2), 0, 100, table_id=2)], [need(0, 100, table_id=2)]) == []


def test_runtime_writes_what_it_delivered_and_a_kill_loses_only_unflushed_lines(tmp_path: Path) -> None:
    now = [1000.0]
    ledger = Ledger(tmp_path, "c1", "abc")
    rt = LogicalClockRuntime(lag_ms=0, init_delay=0.0, clock=lambda: now[0], monotonic=lambda: now[0], sink=ledger)
    d = Dispatcher(name="d1", uid="u1", changefeed="cf", span="s1", table_id=1, key_range=T, capture="c1",
                   start_ts=tso(900_000), epoch=1)  # fmt: skip
    rt.start(d)
    now[0] = 1001.0
    cp1 = rt.checkpoint("d1")
    rt.flush()
    now[0] = 1002.0
    rt.checkpoint("d1")  # delivered, not flushed: as if the process were killed now
    (line,) = read(tmp_path)
    assert (line.from_ts, line.to_ts, line.uid, line.dispatcher, line.capture) == (d.start_ts, cp1, "u1", "d1", "c1")
    final = rt.close("d1")  # closing flushes
    assert max(x.to_ts for x in read(tmp_path)) == final
    ledger.close()
    # A line cut short (the process killed mid-write) is skipped.
    with (tmp_path / "c1.abc.jsonl").open("a") as f:
        f.write('{"changefeed": "cf", "tab')
    assert len(read(tmp_path)) == 2
