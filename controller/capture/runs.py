"""The dispatchers a capture process runs, and what was last written about each.

``Runs`` is the one record of them: the reconciler starts, advances and stops runs; the reporter builds the
progress report from them; the Lease keeper's pause and resume and the shutdown walk them. Every change of which
dispatchers run, or of a run's state, goes through a method of ``Runs`` and moves its ``version``: what the
progress report's groups are cached on (a report costs nothing at rest however many dispatchers run).
"""

from __future__ import annotations

import time
from collections.abc import ItemsView, Iterator, ValuesView
from dataclasses import dataclass, field

from controller.model.records import Dispatcher
from controller.model.states import DispatcherState


@dataclass
class Run:
    """A dispatcher this process runs, and what was last written about it (change ``state`` and ``written_state``
    through ``Runs``)."""

    record: Dispatcher
    state: DispatcherState
    written_state: DispatcherState | None = None
    written_at: float = 0.0  # monotonic
    #: Write rate and region count as last written, and when they were last looked at (monotonic).
    written_traffic: tuple[float, int] = (0.0, 0)
    traffic_at: float = 0.0
    #: When this process started it (monotonic).
    started_at: float = field(default_factory=time.monotonic)
    #: Its runtime's failure (``RoutedRuntime.failed``) has been written to its status message.
    failure_written: bool = False

    @property
    def settled(self) -> bool:
        """Working, and its Working status written: nothing to do for it until its object changes (or the next full
        pass looks at its traffic)."""
        return self.state is DispatcherState.WORKING and self.written_state is DispatcherState.WORKING


class Runs:
    def __init__(self) -> None:
        self._runs: dict[str, Run] = {}
        #: Moves with every change of which dispatchers run and of any run's state or written state.
        self.version = 0

    def __contains__(self, name: object) -> bool:
        return name in self._runs

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[str]:
        return iter(self._runs)

    def __getitem__(self, name: str) -> Run:
        return self._runs[name]

    def get(self, name: str) -> Run | None:
        return self._runs.get(name)

    def items(self) -> ItemsView[str, Run]:
        return self._runs.items()

    def values(self) -> ValuesView[Run]:
        return self._runs.values()

    def start(self, d: Dispatcher) -> Run:
        """A run of ``d`` began (Initializing)."""
        run = self._runs[d.name] = Run(d, DispatcherState.INITIALIZING)
        self.version += 1
        return run

    def pop(self, name: str) -> Run | None:
        run = self._runs.pop(name, None)
        if run is not None:
            self.version += 1
        return run

    def clear(self) -> list[str]:
        """Every run forgotten; their names, sorted."""
        names = sorted(self._runs)
        self._runs.clear()
        self.version += 1
        return names

    def set_state(self, run: Run, state: DispatcherState) -> None:
        run.state = state
        self.version += 1

    def written(
        self, run: Run, state: DispatcherState | None, at: float = 0.0, traffic: tuple[float, int] | None = None
    ) -> None:
        """``state`` is what the API was last told of ``run`` (None: told nothing that still holds)."""
        run.written_state = state
        if state is not None:
            run.written_at = at
            if traffic is not None:
                run.written_traffic, run.traffic_at = traffic, at
        self.version += 1

    def changefeeds(self) -> list[str]:
        """The changefeeds of the runs, sorted."""
        return sorted({run.record.changefeed for run in self._runs.values()})
