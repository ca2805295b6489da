"""The split and merge schedulers: hot spans are split, cold adjacent spans merged back.

Every ``trafficCheckIntervalSeconds`` (a "check"), each Replicating span whose dispatcher is Working
is judged from what its capture last reported (``Dispatcher.status.writeRate``/``regionCount``):

- hot: write rate above ``splitWriteThreshold``, or regions above ``splitRegionThreshold``. A span
  hot for ``splitChecks`` checks in a row is split into ``max(live schedulable captures,
  ceil(rate / threshold), ceil(regions / threshold))`` even pieces, at least 2, never making its
  table hold more than ``maxSpansPerTable`` spans in that mode; the Split places the pieces on the
  least-loaded captures, so they spread.
- cold: write rate below ``mergeWriteThreshold``. Runs of adjacent spans of one table and mode, each
  cold for ``mergeChecks`` checks in a row, are merged while their summed rate stays below the merge
  threshold and not above the split threshold (and their regions within the region threshold), so
  a merged span is never immediately hot again; at most ``mergeMaxPerRound`` Merges a check, and
  never below the span count the table's ``preSplit`` asked for.

A span a scheduler Split made that still carries more than half of its parent's write rate is a hot
spot (the writes hit a few keys): it is not split again this term, which stops a split/merge churn
that would only lengthen keys. A span is never cut into more pieces than the regions it reports.

Neither runs on a table (and mode) with an operator in flight on it, and neither while the changefeed
is paused (the counters start again on resume). The consecutive-check counters and the split
history live in the maintainer's memory: a new maintainer starts counting afresh, which only delays
a split or merge (or allows one more split of a hot spot).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from controller.engine import controller
from controller.engine.operators.split import MAX_PIECES
from controller.engine.scheduler import fresh_operator_name, movable, room, scheduler_operator
from controller.engine.world import Tick
from controller.model.keys import KeyError_
from controller.model.ordering import in_order
from controller.model.records import Span, Table
from controller.model.states import DispatcherState, Mode, OpType, SpanState


@dataclass(frozen=True)
class Counters:
    """Consecutive hot and cold checks per span, when the last check ran, and the split history.

    ``splits``: this term's scheduler Splits (operator name -> the parent's write rate then);
    ``children``: spans those Splits made (span -> the parent's rate), kept while the span exists.
    """

    checked_at: float = 0.0
    hot: Mapping[str, int] = field(default_factory=dict)
    cold: Mapping[str, int] = field(default_factory=dict)
    splits: Mapping[str, float] = field(default_factory=dict)
    children: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Load:
    rate: float
    regions: int


def enabled(tick: Tick) -> bool:
    cfg = tick.changefeed.scheduler
    return cfg.split_write_threshold > 0 or cfg.split_region_threshold > 0 or cfg.merge_write_threshold > 0


def run(tick: Tick, counters: Counters) -> Counters:
    """One traffic check if it is due: update the counters, then split and merge."""
    cfg = tick.changefeed.scheduler
    if not enabled(tick) or tick.now - counters.checked_at < cfg.traffic_check_interval_seconds:
        return counters
    loads = _loads(tick, counters)
    old_hot, old_cold = counters.hot, counters.cold
    hot: dict[str, int] = {}
    cold: dict[str, int] = {}
    for name, load in loads.items():
        if _is_hot(tick, load):
            hot[name] = old_hot.get(name, 0) + 1
        if cfg.merge_write_threshold > 0 and load.rate < cfg.merge_write_threshold:
            cold[name] = old_cold.get(name, 0) + 1
    splits, children = _split_history(tick, counters)
    busy = _busy_tables(tick)
    split_tables = _split(tick, loads, hot, busy, splits, children)
    _merge(tick, loads, cold, busy | split_tables)
    return Counters(checked_at=tick.now, hot=hot, cold=cold, splits=splits, children=children)


def _split_history(tick: Tick, counters: Counters) -> tuple[dict[str, float], dict[str, float]]:
    """Follow this term's Splits to the spans they made, and forget spans that are gone."""
    splits = dict(counters.splits)
    children = {s: r for s, r in counters.children.items() if s in tick.spans}
    for name, rate in list(splits.items()):
        op = tick.operators.get(name)
        if op is None:
            del splits[name]
            continue
        for t in op.targets:
            if t.span in tick.spans:
                children[t.span] = rate
        if op.phase.terminal:
            del splits[name]
    return splits, children


def _hot_spot(name: str, load: _Load, children: Mapping[str, float]) -> bool:
    """``name`` came from a Split and still carries more than half of its parent's traffic.

    Splitting it again would not spread the load (the writes hit a few keys), only churn: split,
    merge the cold siblings back, split again, with keys growing each time. Such a span is left as
    it is for the rest of the term.
    """
    parent = children.get(name)
    return parent is not None and load.rate > parent / 2


def _loads(tick: Tick, counters: Counters) -> dict[str, _Load]:
    """What each Replicating span's Working dispatcher last reported.

    In an incremental decision, only for the spans that can count: those the index finds hot or cold now,
    and those counted before (their count ends)."""
    out: dict[str, _Load] = {}
    if tick.index is None:
        pool: list[Span] = list(tick.spans.values())
    else:
        pool = tick.span_candidates(tick.index.hot, tick.index.cold, counters.hot, counters.cold)
    for s in in_order(pool, key=lambda s: s.name):
        if s.state is not SpanState.REPLICATING or s.deleting or not s.dispatcher:
            continue
        d = tick.dispatchers.get(s.dispatcher)
        if d is None or d.deleting or d.state is not DispatcherState.WORKING:
            continue
        out[s.name] = _Load(d.write_rate, d.region_count)
    return out


def _is_hot(tick: Tick, load: _Load) -> bool:
    cfg = tick.changefeed.scheduler
    return (cfg.split_write_threshold > 0 and load.rate > cfg.split_write_threshold) or (
        cfg.split_region_threshold > 0 and load.regions > cfg.split_region_threshold
    )


def _busy_tables(tick: Tick) -> set[tuple[int, Mode]]:
    """Tables (per mode) that an in-flight operator touches."""
    busy: set[tuple[int, Mode]] = set()
    for op in tick.in_flight():
        for name in (*op.spans, *(t.span for t in op.targets)):
            span = tick.spans.get(name) or tick.world.spans.get(name)
            if span is not None:
                busy.add((span.table_id, span.mode))
    return busy


def _spans_by_table(tick: Tick, keys: set[tuple[int, Mode]] | None = None) -> dict[tuple[int, Mode], list[Span]]:
    """Spans per table and mode (not deleting, not Invalid), key-ordered; in an incremental decision only
    for ``keys`` (the tables the caller asks about)."""
    groups: dict[tuple[int, Mode], list[Span]] = {}
    if tick.index is None:
        pool: list[Span] = list(tick.spans.values())
    else:
        pool = tick.span_candidates(*(tick.index.spans_by_table.get(k, ()) for k in sorted(keys or ())))
        pool = [s for s in pool if (s.table_id, s.mode) in (keys or ())]
    for s in pool:
        if not s.deleting and s.state is not SpanState.INVALID:
            groups.setdefault((s.table_id, s.mode), []).append(s)
    for spans in groups.values():
        spans.sort(key=lambda s: s.key_range)
    return groups


def pieces_for(tick: Tick, load: _Load, spans_in_table: int) -> int:
    """How many pieces a hot span is split into (0: it may not be split any further).

    A span is cut at most into as many pieces as it has regions, when its capture reports them (a
    region is TiKV's smallest unit: TiCDC splits at region boundaries).
    """
    cfg = tick.changefeed.scheduler
    want = max(2, len(tick.schedulable_captures()))
    if cfg.split_write_threshold > 0 and load.rate > cfg.split_write_threshold:
        want = max(want, math.ceil(load.rate / cfg.split_write_threshold))
    if cfg.split_region_threshold > 0 and load.regions > cfg.split_region_threshold:
        want = max(want, math.ceil(load.regions / cfg.split_region_threshold))
    pieces = min(want, cfg.max_spans_per_table - spans_in_table + 1, MAX_PIECES)
    if load.regions > 0:
        pieces = min(pieces, load.regions)
    return pieces if pieces >= 2 else 0


def _split(
    tick: Tick,
    loads: Mapping[str, _Load],
    hot: dict[str, int],
    busy: set[tuple[int, Mode]],
    splits: dict[str, float],
    children: Mapping[str, float],
) -> set[tuple[int, Mode]]:
    cfg = tick.changefeed.scheduler
    done: set[tuple[int, Mode]] = set()
    due = [n for n, c in hot.items() if c >= cfg.split_checks]
    groups = _spans_by_table(tick, {(tick.spans[n].table_id, tick.spans[n].mode) for n in due})
    left = room(tick, cfg.max_in_flight_operators)
    for name in sorted(n for n, c in hot.items() if c >= cfg.split_checks):
        span = tick.spans[name]
        key = (span.table_id, span.mode)
        table = tick.table_of(span)
        if left <= 0:
            break
        if key in busy or key in done or table is None or not table.splittable or not movable(tick, span):
            continue
        if _hot_spot(name, loads[name], children):
            continue
        pieces = pieces_for(tick, loads[name], len(groups.get(key, ())))
        if not pieces:
            continue
        try:
            span.key_range.even_split_keys(pieces)
        except KeyError_:
            continue  # too narrow to cut that finely
        op_name = fresh_operator_name(tick, OpType.SPLIT, (name,), (span.resource_version, pieces))
        if not op_name:
            continue
        load = loads[name]
        reason = (
            f"hot for {hot[name]} checks: {load.rate:g} rows/s (threshold {cfg.split_write_threshold:g}), "
            f"{load.regions} regions (threshold {cfg.split_region_threshold})"
        )
        op = scheduler_operator(tick, op_name, OpType.SPLIT, (name,), split_into=pieces, reason=reason)
        controller.admit(tick, op, create=True)
        splits[op_name] = loads[name].rate
        hot.pop(name)
        done.add(key)
        left -= 1
    return done


def _floor(table: Table) -> int:
    """The fewest spans the merge scheduler leaves a table with: what its preSplit asked for."""
    if table.pre_split_keys:
        return len(table.pre_split_keys) + 1
    return max(1, table.pre_split_spans)


def _merge(tick: Tick, loads: Mapping[str, _Load], cold: dict[str, int], busy: set[tuple[int, Mode]]) -> None:
    cfg = tick.changefeed.scheduler
    if cfg.merge_write_threshold <= 0:
        return
    left = min(cfg.merge_max_per_round, room(tick, cfg.merge_max_per_round))
    # Only a table with a span cold for long enough can merge anything.
    ripe = {(tick.spans[n].table_id, tick.spans[n].mode) for n, c in cold.items() if c >= cfg.merge_checks}
    for key, spans in sorted(_spans_by_table(tick, ripe).items()):
        if key not in ripe:
            continue
        if left <= 0:
            return
        table = tick.tables_by_id.get(key[0])
        if key in busy or table is None or len(spans) <= _floor(table):
            continue
        budget = len(spans) - _floor(table)  # spans a merge may still take away from this table
        run: list[Span] = []
        for span in [*spans, None]:
            if span is not None and _joins(tick, run, span, loads, cold):
                run.append(span)
                continue
            if len(run) >= 2 and budget > 0 and left > 0:
                take = run[: budget + 1]
                if _start_merge(tick, take, loads):
                    budget -= len(take) - 1
                    left -= 1
                    for s in take:
                        cold.pop(s.name, None)
            run = [span] if span is not None and _joins(tick, [], span, loads, cold) else []


def _joins(tick: Tick, run: list[Span], span: Span, loads: Mapping[str, _Load], cold: Mapping[str, int]) -> bool:
    """``span`` may extend ``run`` (adjacent, cold long enough, and the merged span stays cold)."""
    cfg = tick.changefeed.scheduler
    if cold.get(span.name, 0) < cfg.merge_checks or not movable(tick, span):
        return False
    if run and run[-1].key_range.end != span.key_range.start:
        return False
    rate = sum(loads[s.name].rate for s in run) + loads[span.name].rate
    regions = sum(loads[s.name].regions for s in run) + loads[span.name].regions
    if rate >= cfg.merge_write_threshold or (cfg.split_write_threshold > 0 and rate > cfg.split_write_threshold):
        return False
    return not (cfg.split_region_threshold > 0 and regions > cfg.split_region_threshold)


def _start_merge(tick: Tick, spans: list[Span], loads: Mapping[str, _Load]) -> bool:
    names = tuple(s.name for s in spans)
    name = fresh_operator_name(tick, OpType.MERGE, names, tuple(s.resource_version for s in spans))
    if not name:
        return False
    rate = sum(loads[s.name].rate for s in spans)
    reason = f"{len(spans)} adjacent cold spans: {rate:g} rows/s together"
    controller.admit(tick, scheduler_operator(tick, name, OpType.MERGE, names, reason=reason), create=True)
    return True
