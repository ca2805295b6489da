"""Which capture reports the maintainer may use, and for which dispatchers (see controller.model.progress).

A capture's report says: "the dispatchers whose uids hash to ``digest`` (``dispatchers`` of them) have
each delivered up to ``checkpoint_ts``" for one (changefeed, mode). The maintainer uses that minimum for
a dispatcher only when the report covers exactly the set it believes the capture runs for that
changefeed and mode: the dispatchers it sees ``Working`` with ``spec.capture`` naming that capture
(deleting or not). It recomputes the digest over their uids from its own view; any difference (a
dispatcher that just started or stopped, a report older or newer than the view, a restarted capture)
means "not this set", and those dispatchers fall back to their persisted status checkpoints (older,
still lower bounds). The checkpoint then only waits; it never passes what a span delivered.

Why the exact set and not "the dispatcher is in the report": a digest can only say which set, not
whether one member belongs to it; and the count is checked first because it is free.

Incremental decisions (``World.index``) do not scan the dispatchers: the index keeps each (capture,
mode)'s Working dispatchers and the digest of their uids, recomputed only when that set changes
(``Index.working``, engine/digests.py), so judging the reports costs O(captures) per decision (:func:`group_reports`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from controller.engine.world import Tick, World
from controller.model.progress import ProgressEntry, digest_matches
from controller.model.records import Dispatcher
from controller.model.states import DispatcherState, Mode

#: The maintainer uses a capture's minimum for every Working dispatcher of that capture, covered or not.
MUTANT_BEYOND_COVERAGE = "progress-used-beyond-coverage"


def believed(world: World) -> dict[tuple[str, Mode], list[Dispatcher]]:
    """Per (capture, mode): the dispatchers of the changefeed the maintainer sees Working there."""
    groups: defaultdict[tuple[str, Mode], list[Dispatcher]] = defaultdict(list)
    cf = world.changefeed.name
    for d in world.dispatchers.values():
        if d.state is DispatcherState.WORKING and d.changefeed == cf:
            groups[(d.capture, d.mode)].append(d)
    return groups


def entries(world: World) -> Iterator[tuple[str, ProgressEntry, bool]]:
    """(capture, its report's entry for this changefeed, whether it covers exactly the believed set). With an index
    (``World.index``) the believed sets and their digests are the index's (``Index.working``, engine/digests.py):
    O(captures), not a pass over every dispatcher (a metrics scrape at 100,000 spans held the event loop 250-300 ms
    that way)."""
    cf = world.changefeed.name
    index = world.index
    groups = believed(world) if index is None else {}
    for name in sorted(world.captures):
        cap = world.captures[name]
        if cap.progress is None:
            continue
        for entry in cap.progress.entries:
            if entry.changefeed != cf:
                continue
            key = (name, entry.mode)
            if index is not None:
                members = index.working.members.get(key)
                covers = bool(members) and entry.dispatchers == len(members or ())
                covers = covers and index.working.covers(key, entry.digest)
                yield name, entry, covers
            else:
                ds = groups.get(key, [])
                yield name, entry, bool(ds) and exact(entry, ds)


def exact(entry: ProgressEntry, ds: list[Dispatcher]) -> bool:
    """The entry covers exactly ``ds`` (the count first: it is free)."""
    return entry.dispatchers == len(ds) and digest_matches(entry.digest, [d.uid for d in ds])


def covered(tick: Tick) -> dict[str, int]:
    """Dispatcher name -> the checkpoint its capture's report proves it has delivered."""
    out: dict[str, int] = {}
    cf = tick.changefeed.name
    for (capture, mode), ds in believed(tick.world).items():
        cap = tick.world.captures.get(capture)
        entry = cap.progress.entry(cf, mode) if cap is not None and cap.progress is not None else None
        if entry is None:
            continue
        if exact(entry, ds) or tick.mutant(MUTANT_BEYOND_COVERAGE):
            for d in ds:
                out[d.name] = entry.checkpoint_ts
    return out


#: An incremental decision uses no report at all (deliberate bug: the agreement check must see it).
MUTANT_INCREMENTAL_IGNORES = "incremental-ignores-progress-reports"


def group_reports(tick: Tick) -> dict[tuple[str, Mode], int]:
    """Per (capture, mode) with Working dispatchers of the changefeed: the minimum of that capture's report
    when it covers exactly those dispatchers (what :func:`covered` gives each of them), from the index."""
    index = tick.index
    assert index is not None
    out: dict[tuple[str, Mode], int] = {}
    if tick.mutant(MUTANT_INCREMENTAL_IGNORES):
        return out
    cf = tick.changefeed.name
    for name, cap in tick.world.captures.items():
        if cap.progress is None:
            continue
        for mode in Mode:
            key = (name, mode)
            members = index.working.members.get(key)
            if not members:
                continue
            entry = cap.progress.entry(cf, mode)
            if entry is None:
                continue
            exact = entry.dispatchers == len(members) and index.working.covers(key, entry.digest)
            if exact or tick.mutant(MUTANT_BEYOND_COVERAGE):
                out[key] = entry.checkpoint_ts
    return out
