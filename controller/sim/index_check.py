"""The simulator's check of the engine's index (engine/index.py): an index kept per event must be the index rebuilt
from its own records.

The simulator runs it every ``--verify-every`` decisions, and the unit tests after their event sequences; the
production maintainer never does (a rebuild costs O(records)), so it lives here, beside the simulator, not in the
engine.
"""

from __future__ import annotations

from controller.engine.index import Index
from controller.model.progress import digest


def verify(index: Index) -> list[str]:
    """Differences between ``index`` and one rebuilt from its own records (empty: it is exact)."""
    fresh = Index.build(
        index.name,
        [
            *([index.changefeed] if index.changefeed is not None else []),
            *index.tables.values(),
            *index.spans.values(),
            *index.dispatchers.values(),
            *index.operators.values(),
        ],
    )
    problems = []
    for attr in (
        "span_facts",
        "by_state",
        "placing",
        "suspect",
        "stray",
        "hot",
        "cold",
        "spans_by_capture",
        "holding",
        "spans_by_table",
        "foreign_naming",
        "table_counts",
        "span_tally",
        "span_load",
        "replicating_by_capture",
        "dispatcher_facts",
        "loose_by_span",
        "disp_by_capture",
        "disp_by_table",
        "unclaimed",
        "orphans",
        "deleting_dispatchers",
        "failed_dispatchers",
        "in_flight",
        "running",
        "tables_by_id",
        "table_attention",
        "table_stale",
    ):
        mine, theirs = getattr(index, attr), getattr(fresh, attr)
        if callable(mine):
            mine, theirs = mine(), theirs()
        if attr == "table_counts":
            mine = {k: +v for k, v in mine.items() if +v}
            theirs = {k: +v for k, v in theirs.items() if +v}
        if attr in ("state_counts", "holding", "span_load", "replicating_by_capture"):
            mine, theirs = +mine, +theirs
        if mine != theirs:
            problems.append(f"index {attr} differs from a rebuilt one: {_diff(mine, theirs)}")
    if +index.state_counts != +fresh.state_counts:
        problems.append(f"index state_counts differs: {+index.state_counts} != {+fresh.state_counts}")
    if index.checkpoints.values != fresh.checkpoints.values:
        problems.append("index checkpoints differ from a rebuilt one")
    if index.checkpoints.min_excluding() != fresh.checkpoints.min_excluding():
        problems.append("index lowest checkpoint differs from a rebuilt one")
    mine_r = {k: t.values for k, t in index.reported_checkpoints.items()}
    theirs_r = {k: t.values for k, t in fresh.reported_checkpoints.items()}
    if mine_r != theirs_r:
        problems.append(f"index reported checkpoints differ from a rebuilt one: {_diff(mine_r, theirs_r)}")
    for key in {*index.reported_checkpoints, *fresh.reported_checkpoints}:
        if index.lowest_reported(key) != fresh.lowest_reported(key):
            problems.append(f"index lowest checkpoint of {key} differs from a rebuilt one")
    if index.working.members != fresh.working.members:
        diff = _diff(index.working.members, fresh.working.members)
        problems.append(f"index working dispatchers differ from a rebuilt one: {diff}")
    for key, members in index.working.members.items():
        if index.working.digest(key) != fresh.working.digest(key) or index.working.digest(key) != digest(
            members.values()
        ):
            problems.append(f"index digest of {key} differs from a rebuilt one")
    # The pairings found through the records (``spans_naming``, ``dispatchers_of``) against the records themselves.
    naming: dict[str, set[str]] = {}
    for name, sf in index.span_facts.items():
        if sf.record.dispatcher:
            naming.setdefault(sf.record.dispatcher, set()).add(name)
    of_span: dict[str, set[str]] = {}
    for name, df in index.dispatcher_facts.items():
        of_span.setdefault(df.record.span, set()).add(name)
    for d in sorted({*naming, *index.dispatcher_facts}):
        if sorted(index.spans_naming(d)) != sorted(naming.get(d, ())):
            problems.append(f"index spans naming {d}: {index.spans_naming(d)} != {sorted(naming.get(d, ()))}")
    for sp in sorted({*of_span, *index.span_facts}):
        if sorted(index.dispatchers_of(sp)) != sorted(of_span.get(sp, ())):
            found, truth = index.dispatchers_of(sp), sorted(of_span.get(sp, ()))
            problems.append(f"index dispatchers of {sp}: {found} != {truth}")
    mine, theirs = sorted(index.coverage_problems()), sorted(fresh.coverage_problems())
    if mine != theirs:
        problems.append(f"index coverage problems differ: {mine} != {theirs}")
    return problems


def _diff(mine: object, theirs: object) -> str:
    if isinstance(mine, dict) and isinstance(theirs, dict):
        keys = sorted({*mine, *theirs}, key=repr)
        parts = [f"{k!r}: {mine.get(k)!r} != {theirs.get(k)!r}" for k in keys if mine.get(k) != theirs.get(k)]
        return "; ".join(parts[:4])
    if isinstance(mine, set) and isinstance(theirs, set):
        return f"extra {sorted(mine - theirs, key=repr)[:4]}, missing {sorted(theirs - mine, key=repr)[:4]}"
    return f"{mine!r} != {theirs!r}"
