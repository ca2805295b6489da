"""The progress report each Lease renewal carries (``controller.model.progress``): per (changefeed, mode), the lowest
checkpoint of the Working dispatchers whose Working status has been written, how many they are and a digest of
their uids, the slowest, and this process's ``incarnation``; with what the real data plane knows of each entry (the
wall time its checkpoint stands for); and, per changefeed, what keeps its data from flowing here (``troubles``: the
source or the sink unusable), whether or not any of its dispatchers is Working; and the figures of the sinks written
here (``DispatcherRuntime.sink_figures``).

At rest its cost does not grow with the dispatchers held: the groups (names, digest) are recomputed only when a run
starts, stops or changes state (``Runs.version``), and the runtime gives each group's minimum at once when it can
(``LogicalClockRuntime.low_watermark``); otherwise each run is asked. Before any checkpoint leaves the process the
runtime's sink is flushed: nothing is claimed that was not delivered.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from controller.capture.runs import Runs
from controller.capture.runtime import DispatcherRuntime
from controller.capture.troubles import Troubles
from controller.model import progress as prog
from controller.model.resources import round_time
from controller.model.states import Mode


@dataclass(frozen=True)
class Group:
    """One (changefeed, mode) of the progress report: the reported runs (names sorted) and their digest."""

    names: tuple[str, ...]
    digest: str


class Reporter:
    def __init__(
        self,
        runs: Runs,
        runtime: DispatcherRuntime,
        incarnation: str,
        troubles: Troubles,
    ) -> None:
        self.runs = runs
        #: What keeps each changefeed's data from flowing here, whatever its dispatchers' states.
        self.troubles = troubles
        self.runtime = runtime
        #: This process: a report of another incarnation is about dispatchers this process does not run.
        self.incarnation = incarnation
        self._groups: dict[tuple[str, Mode], Group] = {}
        self._groups_at = -1

    def _regroup(self) -> None:
        if self.runs.version == self._groups_at:
            return
        members: dict[tuple[str, Mode], list[str]] = {}
        for name, run in self.runs.items():
            if run.settled:
                members.setdefault((run.record.changefeed, run.record.mode), []).append(name)
        self._groups = {
            key: Group(tuple(sorted(names)), prog.digest(self.runs[n].record.uid for n in names))
            for key, names in members.items()
        }
        self._groups_at = self.runs.version

    def progress(self) -> prog.Progress:
        """The report for the Lease (``prog.build``'s entries), the runtime's sink flushed first."""
        self._regroup()
        rt = self.runtime
        entries = []
        for (cf, mode), group in sorted(self._groups.items()):
            low = rt.low_watermark(group.names)
            if low is not None:
                entries.append(prog.ProgressEntry(
                    changefeed=cf, mode=mode, checkpoint_ts=low[0], dispatchers=len(group.names),
                    digest=group.digest, slowest=low[1],
                ))  # fmt: skip
                continue
            running = []
            for name in group.names:
                d = self.runs[name].record
                with contextlib.suppress(KeyError):
                    running.append(prog.Running(d.uid, name, d.changefeed, d.mode, d.start_ts, rt.checkpoint(name)))
            entries.extend(prog.build(running, self.incarnation, 0.0).entries)
        rt.flush()
        return prog.Progress(
            incarnation=self.incarnation,
            at=round_time(time.time()),
            entries=tuple(self._annotated(entries)),
            troubles=self.troubles.report(),
            sinks=rt.sink_figures(),
        )

    def _annotated(self, entries: list[prog.ProgressEntry]) -> Iterator[prog.ProgressEntry]:
        """Each entry with the wall time its checkpoint stands for, where the runtime counts in source revisions
        (``checkpoint_time`` of the slowest dispatcher; a TSO's is its own physical part)."""
        for e in entries:
            t = None
            if e.slowest:
                with contextlib.suppress(KeyError):
                    t = self.runtime.checkpoint_time(e.slowest)
            yield e if t is None else replace(e, checkpoint_time=round(t, 3))
