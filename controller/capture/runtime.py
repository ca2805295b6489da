"""The dispatcher runtime: what actually replicates a span, behind a small interface (``DispatcherRuntime``).

The capture's parts decide *when* a dispatcher runs (the reconciler: epoch checks, hooks, deletion, a paused
changefeed; the Lease keeper: a pause at the renew deadline, fencing); the runtime decides *how*. Its verbs are all
synchronous and cheap, so that fencing can stop every dispatcher at once from any task without awaiting I/O:

* ``start(dispatcher)``: begin replicating ``dispatcher.key_range`` from ``dispatcher.start_ts``;
* ``checkpoint(name)``: all changes up to this ts have been delivered (never decreases);
* ``write_rate(name)`` / ``region_count(name)``: the upstream rows/s and the regions of the span, for
  the split and merge schedulers (reported in ``Dispatcher.status``);
* ``close(name)``: stop; returns the final checkpoint (what a successor must start from);
* ``pause(name)`` / ``resume(name)``: stop delivering but keep the position (``pause`` returns it), then go on from
  it. A capture that cannot renew its Lease pauses everything (another capture may soon own these spans) and
  resumes in place only if nothing was taken from it meanwhile;
* ``flush()``: make every checkpoint returned so far durable downstream; called before a checkpoint is claimed to
  anyone (a status write, the progress report on the Lease);
* ``release(changefeed)``: every dispatcher of the changefeed is paused because its replication is
  (``spec.paused``): close the connections they hold; resuming one opens them again;
* ``failed(name)`` / ``take_failed()``: why a dispatcher stopped for good (None: it did not), and which stopped
  since the last call (the reconciler writes why at once);
* ``checkpoint_time(name)``: the wall time a checkpoint stands for, where the runtime counts in source revisions
  (None where it is a TSO, whose physical part says it), for the progress report's lag;
* ``low_watermark(names)``: a group's lowest checkpoint at once when the runtime can tell (None: ask each);
* ``sink_figures()``: the sinks' figures of the changefeeds replicated here (the progress report's).

The agent drives a :class:`controller.capture.routed.RoutedRuntime`, which runs the dispatchers of a changefeed that
names a source and a sink in :class:`controller.capture.dataplane.DataplaneRuntime` (etcd into the sink) and the
others in a :class:`LogicalClockRuntime`. That one, for benchmarks of the control plane, replicates nothing: its
upstream ts follows wall time like a TiDB TSO (physical milliseconds << 18), and each dispatcher's checkpoint trails
it by a small lag, never below the dispatcher's startTs. A span's write rate and region count are its share (by key
space) of the Table's ``spec.writeRate`` and ``spec.regionCount`` (the regions rounded up: those it
touches, ``controller.model.keys.regions_touched``), looked up through a callable the
agent supplies (the runtime does no API I/O of its own). With a ``sink``
(:class:`controller.capture.ledger.Ledger`), what it delivers is recorded there: a dispatcher that
reached checkpoint ``cp`` from ``start_ts`` has delivered (start_ts, cp] of its key range.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from controller.model.keys import KeyRange, regions_touched
from controller.model.progress import SinkFigures
from controller.model.records import Dispatcher
from controller.model.tso import tso


class DispatcherRuntime(Protocol):
    """What runs dispatchers for a capture agent. Every method is synchronous and must not block."""

    def start(self, dispatcher: Dispatcher) -> None:
        """Start replicating (idempotent: starting a running dispatcher changes nothing)."""

    def checkpoint(self, name: str) -> int:
        """The current checkpoint of a running dispatcher (``KeyError`` if it does not run)."""
        ...

    def write_rate(self, name: str) -> float:
        """Rows/s the running dispatcher's span receives (``KeyError`` if it does not run)."""
        ...

    def region_count(self, name: str) -> int:
        """Regions of the running dispatcher's span (``KeyError`` if it does not run)."""
        ...

    def close(self, name: str) -> int:
        """Stop it; returns its final checkpoint (``KeyError`` if it does not run)."""
        ...

    def pause(self, name: str) -> int:
        """Stop delivering at once, keeping the position; returns the checkpoint, which stays put until
        ``resume`` (``KeyError`` if it does not run). Idempotent."""
        ...

    def resume(self, name: str) -> None:
        """Deliver again from where it paused (``KeyError`` if it does not run). Idempotent."""
        ...

    def flush(self) -> None:
        """Make every checkpoint returned so far durable downstream (before it is claimed to anyone)."""

    def release(self, changefeed: str) -> None:
        """Every dispatcher of ``changefeed`` here is paused (its replication is): close what they hold open (their
        connections to the source and the sink); a resume opens them again."""

    def failed(self, name: str) -> str | None:
        """Why the dispatcher stopped for good (its source compacted past its position...); None if it did not."""
        ...

    def take_failed(self) -> set[str]:
        """The dispatchers that stopped for good since the last call."""
        ...

    def checkpoint_time(self, name: str) -> float | None:
        """The wall time the dispatcher's checkpoint stands for, where the runtime counts in source revisions
        (``KeyError`` if it does not run); None where the checkpoint is a TSO (its physical part says it)."""
        ...

    def low_watermark(self, names: Sequence[str]) -> tuple[int, str] | None:
        """The lowest checkpoint over the running ``names`` (sorted) and the first name holding it, when the runtime
        can tell without asking each; None: ask each (``checkpoint``)."""
        ...

    def sink_figures(self) -> tuple[SinkFigures, ...]:
        """Per changefeed replicated here, its sink's figures (tombstones collected and held, live rows)."""
        ...


class DeliverySink(Protocol):
    """Where the default runtime records what it delivered (:class:`controller.capture.ledger.Ledger`)."""

    def delivered(self, d: Dispatcher, to_ts: int) -> None: ...

    def flush(self) -> None: ...

    def forget(self, uid: str) -> None: ...


@dataclass
class _Run:
    dispatcher: Dispatcher
    started: float  # monotonic
    checkpoint: int
    #: The dispatcher's share of its table's key range (fixed for its life: computed once).
    share: float
    paused: bool = False


class LogicalClockRuntime:
    """The default runtime: a logical clock instead of real replication.

    ``lag_ms``: how far a checkpoint trails the upstream ts. ``init_delay``: seconds before a new
    dispatcher makes its first progress (while Initializing a real dispatcher resolves its span and
    connects to the downstream). ``rate_of``: the write rate and region count of a dispatcher's table.
    ``deliver_until``: a monotonic deadline past which nothing is delivered (the agent's Lease renewal
    deadline), checked at every delivery as a real sink would check a fencing deadline before each write:
    a starved event loop whose watchdog pauses late still delivers nothing late.
    ``clock``/``monotonic`` can be replaced in tests.
    """

    def __init__(
        self,
        *,
        lag_ms: int = 500,
        init_delay: float = 0.5,
        rate_of: Callable[[Dispatcher], tuple[float, int]] | None = None,
        deliver_until: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        sink: DeliverySink | None = None,
    ) -> None:
        self.lag_ms = lag_ms
        self.init_delay = init_delay
        self.rate_of = rate_of
        self.deliver_until = deliver_until
        self.clock = clock
        self.monotonic = monotonic
        self.sink = sink
        self._runs: dict[str, _Run] = {}
        self._last_upstream = 0
        # For ``low_watermark``: runs paused now; the latest start (monotonic) and the highest start ts of any
        # run started (never lowered: conservative); and the last floor claimed, with the latest start it covers.
        self._paused = 0
        self._newest_start = -1e18
        self._max_start_ts = 0
        self._floor = 0
        self._floor_covers = -1e18

    def upstream(self) -> int:
        """The upstream ts now: wall time as a TSO, strictly increasing across calls."""
        ts = max(tso(int(self.clock() * 1000)), self._last_upstream + 1)
        self._last_upstream = ts
        return ts

    def start(self, dispatcher: Dispatcher) -> None:
        if dispatcher.name in self._runs:
            return
        share = dispatcher.key_range.share_of(KeyRange.of_table(dispatcher.table_id))
        started = self.monotonic()
        self._runs[dispatcher.name] = _Run(dispatcher, started, dispatcher.start_ts, share)
        self._newest_start = max(self._newest_start, started)
        self._max_start_ts = max(self._max_start_ts, dispatcher.start_ts)

    def checkpoint(self, name: str) -> int:
        run = self._runs[name]
        now = self.monotonic()
        late = self.deliver_until is not None and now > self.deliver_until()
        if not run.paused and not late and now - run.started >= self.init_delay:
            target = self.upstream() - tso(self.lag_ms)
            if target > run.checkpoint:
                run.checkpoint = target
                if self.sink is not None:
                    self.sink.delivered(run.dispatcher, target)
        if run.started <= self._floor_covers and run.checkpoint < self._floor:
            run.checkpoint = self._floor  # claimed for it by low_watermark (no sink then): never go back
        return run.checkpoint

    def low_watermark(self, names: Sequence[str]) -> tuple[int, str] | None:
        """The lowest checkpoint over the running ``names`` (sorted) and the first name holding it, without
        asking each of them, when every one is at the same point: no sink records deliveries one by one,
        nothing is paused or late, every run has made its first progress (started ``init_delay`` ago) and
        none started past the target. Then each is at the target (upstream minus lag): O(1), so that a
        capture's report at rest costs the same for 10 dispatchers or 30,000. None when it cannot tell (ask
        each: ``checkpoint``). What it claims holds afterwards: ``checkpoint`` of a run it covered never
        returns less (paused or late later included)."""
        if self.sink is not None or self._paused or not names:
            return None
        now = self.monotonic()
        if self.deliver_until is not None and now > self.deliver_until():
            return None
        if now - self._newest_start < self.init_delay:
            return None
        target = self.upstream() - tso(self.lag_ms)
        if target < self._max_start_ts:
            return None
        self._floor = max(self._floor, target)
        self._floor_covers = self._newest_start
        return target, names[0]

    def _share(self, name: str) -> tuple[float, int, float]:
        run = self._runs[name]
        rate, regions = self.rate_of(run.dispatcher) if self.rate_of is not None else (0.0, 0)
        return rate, regions, run.share

    def write_rate(self, name: str) -> float:
        rate, _, share = self._share(name)
        return round(rate * share, 3)

    def region_count(self, name: str) -> int:
        _, regions, _ = self._share(name)
        key_range = self._runs[name].dispatcher.key_range
        return regions_touched(regions, key_range, KeyRange.of_table(self._runs[name].dispatcher.table_id))

    def close(self, name: str) -> int:
        final = self.checkpoint(name)
        run = self._runs.pop(name)
        if run.paused:
            self._paused -= 1
        if self.sink is not None:
            self.sink.flush()  # the final checkpoint is claimed next (Stopped): it must be downstream first
            self.sink.forget(run.dispatcher.uid)
        return final

    def pause(self, name: str) -> int:
        cp = self.checkpoint(name)
        run = self._runs[name]
        if not run.paused:
            run.paused = True
            self._paused += 1
        return cp

    def resume(self, name: str) -> None:
        run = self._runs[name]
        if run.paused:
            run.paused = False  # catches up with the upstream at the next checkpoint
            self._paused -= 1

    def flush(self) -> None:
        if self.sink is not None:
            self.sink.flush()

    def release(self, changefeed: str) -> None:
        """Nothing is held open by a logical clock."""

    def failed(self, name: str) -> str | None:
        """A logical clock never stops a dispatcher for good."""
        return None

    def take_failed(self) -> set[str]:
        return set()

    def checkpoint_time(self, name: str) -> float | None:
        """None: a checkpoint here is a TSO, whose physical part is its wall time."""
        return None

    def sink_figures(self) -> tuple[SinkFigures, ...]:
        """None: no sink of a changefeed is written here (the ledger records deliveries, not rows)."""
        return ()

    def running(self) -> list[str]:
        return sorted(self._runs)
