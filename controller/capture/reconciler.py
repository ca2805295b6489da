"""The dispatchers of one capture: started, advanced, reported, closed, level-triggered.

A list+watch (label ``cdc.maintainer.dev/capture=<name>``, ``controller.kube.objects``) keeps the assigned
Dispatchers in memory; each pass re-derives what to do from that state plus what the runtime really runs. Nothing
depends on having seen a particular event, so a restarted agent picks up where the old one left off: dispatchers
the API shows live but that this process does not run are reported Stopped (their checkpoint is final) and the
maintainer places their spans again.

* **Epoch fencing** (``epochs.Epochs``): before starting a dispatcher, and again before it becomes Working, a strong
  read of its Changefeed rejects a dispatcher whose ``spec.epoch`` is older than the published one.
* **Close**: a dispatcher being deleted is closed in the runtime, reported Stopped with its final checkpoint, and
  only then is its finalizer released: the maintainer reads that checkpoint as the start of whatever replaces it.
* **Reports**: a dispatcher's status is written when its state changes and when its traffic changes materially,
  never just because its checkpoint moved (that rides on the Lease: ``reporter.Reporter``).
* **Passes**: a full pass (every dispatcher) every ``FULL_PASS_INTERVAL``, after a resume and when the test hooks
  change; in between a pass visits what changed (the informer's dirty names), the runs not settled, the closes not
  finished, the steps that failed, and the runs of a Table whose traffic moved. At rest that is nothing.
* **Errors**: transport errors and error statuses are the API's (the dispatcher is visited again next pass); any
  other error in a step is a bug: logged with its traceback, counted (``step_errors``), and that dispatcher alone is
  tried again after a back-off, while the others go on.
* **Pause and resume** (asked by the Lease keeper, ``lease_keeper.Dispatchers``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from controller.capture.epochs import Epochs, PassReads
from controller.capture.hooks import HookWatcher
from controller.capture.lease_keeper import API_ERRORS, LeaseView
from controller.capture.logs import Notes, fields
from controller.capture.registration import CaptureObject
from controller.capture.runs import Run, Runs
from controller.capture.runtime import DispatcherRuntime
from controller.capture.sources import Sources
from controller.capture.status import Fenced, StatusWriter
from controller.capture.traffic import TableRates
from controller.kube.client import JSON, RESOURCES, Client, remove_finalizer, sleep_or
from controller.kube.objects import ObjectInformer
from controller.model import progress
from controller.model.records import DISPATCHER_FAILED_PREFIX, Dispatcher
from controller.model.resources import CAPTURE_LABEL, InvalidResource, dispatcher_from_resource
from controller.model.states import (
    CLOSED_DISPATCHER_STATES,
    DISPATCHER_FINALIZER,
    LIVE_DISPATCHER_STATES,
    DispatcherState,
    Kind,
)

log = logging.getLogger("controller.capture")
DISPATCHERS = RESOURCES[Kind.DISPATCHER]
WORKING, STOPPED, REJECTED = DispatcherState.WORKING, DispatcherState.STOPPED, DispatcherState.REJECTED
#: Seconds from the start of one pass to the next, at least (at most ``tick``): a maintainer's decision creates
#: hundreds of dispatchers at once, and one pass takes the burst with one strong read of the epoch.
PASS_MIN_INTERVAL = 0.1
#: Seconds between full passes (every dispatcher held): the level-triggered backstop of the passes that visit only
#: what changed (a full pass every 2 s made three captures cost 0.39 of a core at 50,000 spans).
FULL_PASS_INTERVAL = 60.0
#: How many dispatchers one pass works on at once (each step is a few API requests).
STEP_CONCURRENCY = 16
#: A dispatcher whose step raised an unexpected error is tried again after this many seconds, doubling up to
#: ``MAX_STEP_ERROR_BACKOFF`` while it keeps failing.
STEP_ERROR_BACKOFF = 1.0
MAX_STEP_ERROR_BACKOFF = 60.0


@dataclass
class Closing:
    final: int
    written: bool
    released: bool = False


@dataclass(frozen=True)
class ResumePlan:
    """What a resume check found: the dispatchers to resume, and those to drop with why."""

    pause: float
    resumed: tuple[str, ...]
    dropped: dict[str, str]
    current: frozenset[str]
    published: dict[str, int | None]


class Reconciler:
    def __init__(
        self,
        client: Client,
        namespace: str,
        name: str,
        *,
        runs: Runs,
        runtime: DispatcherRuntime,
        lease: LeaseView,
        epochs: Epochs,
        rates: TableRates,
        sources: Sources,
        capture: CaptureObject,
        dispatchers: ObjectInformer,
        captures: ObjectInformer,
        notes: Notes,
        tick: float,
        report_interval: float,
        test_hooks: bool,
    ) -> None:
        self.client, self.namespace, self.name = client, namespace, name
        self.runs, self.rt, self.lease, self.notes = runs, runtime, lease, notes
        self.epochs, self.rates, self.sources, self.capture = epochs, rates, sources, capture
        self.dispatchers, self.captures = dispatchers, captures
        self.tick, self.report_interval = tick, report_interval
        self.status = StatusWriter(client, runtime, lease)
        self.closing: dict[str, Closing] = {}
        self.rejected: set[str] = set()
        #: Dispatchers reported Stopped/Rejected because they do not run here: when (skip re-writes for a while).
        self.disowned: dict[str, float] = {}
        #: Pending dispatchers assigned before this process took over a Lease that did not name it: reported
        #: Stopped, never started (the maintainer may be releasing them on the strength of that Lease).
        self.inherited: set[str] = set()
        self.hooks = HookWatcher(test_hooks, log)
        #: When the last full pass began (monotonic).
        self.full_at = -1e9
        #: Dispatchers whose step failed for want of the API: visited again at the next pass.
        self.retry: set[str] = set()
        #: Dispatchers waiting on their changefeed's source (``Sources.retry_at``): name -> when to visit again.
        self.waiting: dict[str, float] = {}
        #: Dispatchers whose step raised a bug: name -> (failures in a row, monotonic time before which no pass
        #: tries it again). Dropped when its step goes through or its object is gone.
        self.broken: dict[str, tuple[int, float]] = {}
        #: Unexpected errors raised by steps since the process started (each logged with its traceback).
        self.step_errors = 0
        #: Runs held because their changefeed's replication is paused (``_hold``), and what the set was computed at.
        self.held: set[str] = set()
        self._held_at: tuple[int, int] = (-1, -1)
        #: Runs not settled when last looked at: every pass visits them.
        self.active: set[str] = set()
        #: What the last resume dropped, until reported (``report_dropped``): name -> (its run, its final checkpoint).
        self._dropped: dict[str, tuple[Run | None, int]] = {}

    # -- the loop -------------------------------------------------------------------------------------------

    async def run(self, wake: asyncio.Event, took_over_foreign: bool) -> None:
        await self.dispatchers.synced.wait()
        await self.captures.synced.wait()
        if took_over_foreign:
            # Listed after the acquisition: everything assigned before it is here (and maybe a few after).
            self.inherited = set(self.dispatchers.objects)
            if self.inherited:
                log.info(
                    "took over a Lease that did not name this capture: its Pending dispatchers are reported "
                    "Stopped, not started",
                    extra=fields(dispatchers=len(self.inherited)),
                )
        log.info("watching dispatchers", extra=fields(selector=f"{CAPTURE_LABEL}={self.name}"))
        while True:
            began = time.monotonic()
            await self.reconcile()
            await sleep_or(wake, self.tick)
            rest = min(PASS_MIN_INTERVAL, self.tick) - (time.monotonic() - began)
            if rest > 0:
                await asyncio.sleep(rest)

    def _visit(self, now: float) -> tuple[set[str], set[str], set[str]]:
        """The names this pass visits, the runs whose objects are gone, and the finished closes to forget."""
        live = self.dispatchers.objects
        changed = self.dispatchers.take_dirty()
        if now - self.full_at >= FULL_PASS_INTERVAL:
            self.full_at = now
            self.retry.clear()
            self.active = {n for n, r in self.runs.items() if not r.settled}
            self.notes.keep(live)
            self.sources.keep({(obj.get("spec") or {}).get("changefeed") or "" for obj in live.values()})
            self.broken = {n: b for n, b in self.broken.items() if n in live}
            finished = (set(self.closing) | self.rejected | set(self.disowned)) - set(live)
            return set(live), set(self.runs) - set(live), finished
        names = changed | self.retry | self.rt.take_failed()  # stopped for good: why is written at once
        self.retry = set()
        due = [n for n, at in self.waiting.items() if at <= now]
        for n in due:
            del self.waiting[n]
        names.update(due)
        names.update(self.active)
        names.update(n for n, c in self.closing.items() if not c.released)
        names.update(self.broken)
        gone = {n for n in changed if n not in live and n in self.runs}
        finished = {n for n in changed if n not in live}
        return {n for n in names if n in live}, gone, finished  # not ``names & set(live)``: a copy of every name

    async def reconcile(self) -> None:
        """One level-triggered pass over the assigned dispatchers (see the module's doc)."""
        if self.lease.fence_reason:
            raise Fenced(self.lease.fence_reason)
        if self.hooks.read((self.captures.objects.get(self.name) or {}).get("metadata", {}).get("annotations")):
            self.full_at = -1e9
        paused = self.lease.paused_at is not None
        if not paused and len(self.runs):
            await self._refresh_rates()
        now = time.monotonic()
        names, gone, finished = self._visit(now)
        if self.broken:  # not before their back-off, whatever else marks them
            names = {n for n in names if n not in self.broken or self.broken[n][1] <= now}
        # Copied: the steps await, and the informer keeps changing its objects meanwhile.
        live = self.dispatchers.objects
        objects = {n: live[n] for n in names}
        for name in sorted(gone):
            # Deleted outright (e.g. the maintainer released the finalizer of a capture it thought lost).
            self.runs.pop(name)
            final = self.rt.close(name)
            log.warning("dispatcher vanished; stopped it", extra=fields(dispatcher=name, checkpointTs=final))
        for name in finished:
            self.closing.pop(name, None)
            self.rejected.discard(name)
            self.disowned.pop(name, None)
            self.broken.pop(name, None)
        reads: PassReads = {}  # strong reads of this pass, shared by its steps
        gate = asyncio.Semaphore(STEP_CONCURRENCY)
        if not paused:
            await self.epochs.refresh(self.runs.changefeeds, reads)
            self._hold()

        async def one(name: str) -> None:
            raw = objects[name]
            try:
                d = dispatcher_from_resource(raw)
            except InvalidResource as exc:
                self.notes.say(name, "invalid", logging.WARNING, "ignoring an invalid Dispatcher", error=str(exc))
                return
            async with gate:
                try:
                    await self._step(d, raw, reads)
                except API_ERRORS as exc:
                    self.retry.add(name)  # visited again next pass, not only at the next full one
                    log.warning("dispatcher step failed", extra=fields(dispatcher=name, error=repr(exc)))
                except Fenced:
                    raise
                except Exception:  # a bug: loud and counted, retried with back-off, the other dispatchers go on
                    self._step_error(name)
                else:
                    self.broken.pop(name, None)
            run = self.runs.get(name)
            if run is not None and not run.settled:
                self.active.add(name)
            else:
                self.active.discard(name)

        # Steps of different dispatchers are independent; their writes go out concurrently. A TaskGroup: if one step
        # finds the capture fenced, the others are cancelled at once.
        try:
            async with asyncio.TaskGroup() as group:
                for name in sorted(objects):
                    run = self.runs.get(name)
                    if run is None or not self._quiet(run, objects[name], now):
                        group.create_task(one(name))
                    else:
                        self.active.discard(name)
        except BaseExceptionGroup as eg:  # e.g. Fenced: raise it as a sequential pass would have
            raise eg.exceptions[0] from None
        if paused:
            return
        try:
            await self.capture.report(len(self.runs), self.report_interval)
        except API_ERRORS as exc:
            log.warning("Capture status write failed", extra=fields(error=repr(exc)))

    def _step_error(self, name: str) -> None:
        """``name``'s step raised an unexpected error (called while handling it): its traceback, counted, its next
        try put off (``STEP_ERROR_BACKOFF``, doubling)."""
        failures = self.broken.get(name, (0, 0.0))[0] + 1
        delay = min(STEP_ERROR_BACKOFF * 2 ** min(failures - 1, 16), MAX_STEP_ERROR_BACKOFF)
        self.broken[name] = (failures, time.monotonic() + delay)
        self.step_errors += 1
        log.exception(
            "dispatcher step raised an unexpected error (a bug); trying it again later",
            extra=fields(dispatcher=name, attempts=failures, retry_in=delay, step_errors=self.step_errors),
        )

    def _quiet(self, run: Run, raw: JSON, now: float) -> bool:
        """A Working dispatcher with nothing to write this pass (the common case at rest): skipped without a task or
        a conversion of its object, so that a pass over thousands stays cheap."""
        if not run.settled or (raw.get("metadata") or {}).get("deletionTimestamp"):
            return False
        if not run.failure_written and self.rt.failed(run.record.name):
            return False  # stopped for good (``take_failed``): why is written now
        if (raw.get("status") or {}).get("state") != WORKING.value:
            return False  # the API does not show what we wrote: _advance decides when to write again
        if run.traffic_at >= 0:
            return True  # its traffic moves only with its Table's, and that marks it (traffic_at < 0)
        run.traffic_at = now
        return not progress.traffic_changed(run.written_traffic, self.status.traffic(run.record.name))

    # -- one dispatcher ---------------------------------------------------------------------------------------

    async def _step(self, d: Dispatcher, raw: JSON, reads: PassReads) -> None:
        if d.deleting:
            await self._close(d, raw)  # closing is always safe, paused or not
        elif self.lease.paused_at is not None:
            return  # paused: nothing starts, nothing advances, nothing is reported
        elif d.name in self.runs:
            await self._advance(self.runs[d.name], d, reads)
        elif d.state is DispatcherState.PENDING and d.name in self.inherited:
            await self._disown(d)
        elif d.state is DispatcherState.PENDING:
            await self._create(d, reads)
        elif d.state in LIVE_DISPATCHER_STATES:
            await self._disown(d)

    async def _create(self, d: Dispatcher, reads: PassReads) -> None:
        if self.hooks.hooks.pauses_create(d.table_id):
            self.notes.say(d.name, "pause-create", logging.INFO, "create paused by hook", tableID=d.table_id)
            return
        epoch = await self.epochs.of(d.changefeed, reads)
        if epoch is None:
            self.notes.say(d.name, "no-changefeed", logging.WARNING, "changefeed not found; waiting", cf=d.changefeed)
            return
        if d.epoch < epoch:
            await self.status.write(
                d, REJECTED, d.start_ts, f"stale epoch: dispatcher epoch {d.epoch} < changefeed epoch {epoch}"
            )
            log.info("rejected dispatcher", extra=fields(dispatcher=d.name, epoch=d.epoch, current=epoch))
            return
        if self.lease.fence_reason:
            raise Fenced(self.lease.fence_reason)
        if self.lease.paused_at is not None:
            return  # paused while it read the epoch
        if not await self.sources.ready(d.changefeed):  # its source cannot be used yet: look again after a while
            self.waiting[d.name] = self.sources.retry_at(d.changefeed) or time.monotonic()
            return
        if self.lease.paused_at is not None:
            return  # paused while it read the Secrets
        self.rt.start(d)
        run = self.runs.start(d)
        if d.changefeed in self.epochs.paused_feeds:  # its replication is paused (as the epoch's read just showed)
            self.rt.pause(d.name)
            self.held.add(d.name)
        log.info(
            "started dispatcher",
            extra=fields(dispatcher=d.name, span=d.span, tableID=d.table_id, startTs=d.start_ts, epoch=d.epoch),
        )
        await self._report(run, d)

    async def _advance(self, run: Run, d: Dispatcher, reads: PassReads) -> None:
        failure = self.rt.failed(d.name)
        if failure and not run.failure_written:
            run.failure_written = True
            log.error("dispatcher failed", extra=fields(dispatcher=d.name, reason=failure))
            await self.status.write(d, run.state, self.rt.checkpoint(d.name), f"{DISPATCHER_FAILED_PREFIX}{failure}")
            return
        cp = self.rt.checkpoint(d.name)
        if run.state is DispatcherState.INITIALIZING and cp > d.start_ts:
            epoch = await self.epochs.of(d.changefeed, reads)
            if epoch is not None and d.epoch < epoch:
                self.runs.pop(d.name)
                final = self.rt.close(d.name)
                self.rejected.add(d.name)
                log.info("rejected dispatcher", extra=fields(dispatcher=d.name, epoch=d.epoch, current=epoch))
                message = f"stale epoch at Working: dispatcher epoch {d.epoch} < changefeed epoch {epoch}"
                await self.status.write(d, REJECTED, final, message)
                return
            if self.lease.paused_at is not None:
                return  # paused while it read the epoch
            if epoch is not None:
                self.runs.set_state(run, WORKING)
                log.info("dispatcher working", extra=fields(dispatcher=d.name, checkpointTs=cp))
        stale = time.monotonic() - run.written_at > 2 * self.report_interval
        if run.written_state is run.state and d.state is not run.state and stale:
            # What we wrote is not what the API shows (a write lost, or overwritten): level-triggered, re-report.
            self.runs.written(run, None)
        await self._report(run, d)

    async def _report(self, run: Run, d: Dispatcher) -> None:
        """Write a running dispatcher's status when its state changed, or its traffic materially; not when only its
        checkpoint moved (that goes on the Lease), and nothing while paused."""
        if self.lease.paused_at is not None:
            return
        now = time.monotonic()
        traffic = self.status.traffic(d.name)
        if run.written_state is run.state and not progress.traffic_changed(run.written_traffic, traffic):
            return
        young = now - run.started_at < self.report_interval
        if run.written_state is None and run.state is DispatcherState.INITIALIZING and young:
            # Not yet: most dispatchers are Working within init_delay, and then the one write says so
            # (Pending -> Working). One still Initializing after report_interval is reported as such.
            return
        state, cp = run.state, self.rt.checkpoint(d.name)
        await self.status.write(d, state, cp)
        self.runs.written(run, state, now, traffic)
        log.debug("reported", extra=fields(dispatcher=d.name, state=state.value, checkpointTs=cp))

    async def _close(self, d: Dispatcher, raw: JSON) -> None:
        name = d.name
        if name in self.runs and self.hooks.hooks.holds_close(d.table_id):
            self.notes.say(name, "hold-close", logging.INFO, "close held by hook", tableID=d.table_id)
            return
        closing = self.closing.get(name)
        if closing is None:
            run = self.runs.pop(name)
            if run is not None:
                final = self.rt.close(name)
                log.info("closed dispatcher", extra=fields(dispatcher=name, checkpointTs=final))
            else:
                final = d.known_checkpoint
            closing = self.closing[name] = Closing(final, written=run is None and d.state in CLOSED_DISPATCHER_STATES)
        if closing.released:
            return
        obj = raw
        if not closing.written:
            obj = await self.status.write(d, REJECTED if name in self.rejected else STOPPED, closing.final, "closed")
            closing.written = True
        if await remove_finalizer(self.client, DISPATCHERS, self.namespace, obj, DISPATCHER_FINALIZER):
            closing.released = True
            log.info("released finalizer", extra=fields(dispatcher=name, checkpointTs=closing.final))

    async def _disown(self, d: Dispatcher) -> None:
        """Live in the API but not run by this process (it restarted, or refused it at Working)."""
        at = self.disowned.get(d.name)
        if at is not None and time.monotonic() - at < 2 * self.report_interval:
            return
        if d.name in self.rejected:
            state, message = REJECTED, "stale epoch"
        elif d.name in self.inherited and d.state is DispatcherState.PENDING:
            state, message = STOPPED, "assigned before this process took over its Lease (not started)"
        else:
            state, message = STOPPED, "not running on this capture (the capture agent restarted)"
        await self.status.write(d, state, d.checkpoint_ts, message)
        self.disowned[d.name] = time.monotonic()
        log.info("reported a dispatcher it does not run", extra=fields(dispatcher=d.name, state=state.value))

    async def _refresh_rates(self) -> None:
        """The Tables re-read now and then (``TableRates``): the runs of a Table whose traffic moved are looked at."""
        moved = await self.rates.refresh()
        if moved:
            for name, run in self.runs.items():
                if (run.record.changefeed, run.record.table_id) in moved:
                    run.traffic_at = -1e9
                    self.active.add(name)

    # -- a changefeed's replication paused ---------------------------------------------------------------------

    def _hold(self) -> None:
        """Hold the runs of the changefeeds whose replication is paused (``Epochs.paused_feeds``: the runtime pauses
        them and releases what they held open), and let the others go again (resumed from where they stopped).
        Walks the runs only when that set or the runs changed."""
        if self.lease.paused_at is not None:
            return  # the Lease keeper's pause holds everything; its resume (``resume``) honours the held
        at = (self.epochs.paused_version, self.runs.version)
        if at == self._held_at:
            return
        self._held_at = at
        paused = self.epochs.paused_feeds
        released: set[str] = set()
        for name, run in self.runs.items():
            cf = run.record.changefeed
            if cf in paused and name not in self.held:
                self.rt.pause(name)
                self.held.add(name)
                released.add(cf)
            elif cf not in paused and name in self.held:
                self.held.discard(name)
                self.rt.resume(name)
                log.info("dispatcher resumed with its changefeed", extra=fields(dispatcher=name, changefeed=cf))
        self.held &= set(self.runs)
        for cf in sorted(released):
            self.rt.release(cf)
            log.info("changefeed paused: its dispatchers hold, their connections closed", extra=fields(changefeed=cf))

    # -- what the Lease keeper and the drainer ask -------------------------------------------------------------

    def pause_all(self, reason: str) -> None:
        """Stop delivering now, synchronously; keep every dispatcher and its position."""
        at = {name: self.rt.pause(name) for name in sorted(self.runs)}
        log.warning(
            "paused: stopped delivering until the Lease is renewed",
            extra=fields(capture=self.name, reason=reason, dispatchers=at),
        )

    async def resume_plan(self, pause: float) -> ResumePlan:
        """Read (strongly) this capture's Dispatchers and the epochs of its changefeeds: each paused dispatcher whose
        object still exists (same uid), is not being deleted, and whose changefeed published no epoch this capture
        had not seen may resume; the others are dropped (those being deleted stay paused: the close path reports
        where they stopped)."""
        items, _ = await self.client.list(DISPATCHERS, self.namespace, f"{CAPTURE_LABEL}={self.name}")
        current = {o["metadata"]["name"]: o for o in items if (o.get("spec") or {}).get("capture") == self.name}
        published = {cf: await self.epochs.read(cf, remember=False) for cf in self.runs.changefeeds()}
        resumed: list[str] = []
        dropped: dict[str, str] = {}
        for name, run in sorted(self.runs.items()):
            meta = (current.get(name) or {}).get("metadata") or {}
            epoch = published.get(run.record.changefeed)
            if name not in current or meta.get("uid") != run.record.uid:
                dropped[name] = "its Dispatcher is gone"
            elif meta.get("deletionTimestamp"):
                continue
            elif epoch is None:
                dropped[name] = "its changefeed is gone"
            elif self.epochs.newer(run.record.changefeed, epoch):
                dropped[name] = f"changefeed epoch {epoch} was published while it was paused"
            else:
                resumed.append(name)
        return ResumePlan(pause, tuple(resumed), dropped, frozenset(current), published)

    def resume(self, plan: ResumePlan) -> None:
        """Apply a resume check (synchronously, at once after the Lease keeper found it still vouched for)."""
        for cf, epoch in plan.published.items():
            if epoch is not None:
                self.epochs.saw(cf, epoch)
        self._dropped = {name: (self.runs.pop(name), self.rt.close(name)) for name in plan.dropped}
        for name in plan.resumed:
            if self.runs[name].record.changefeed in self.epochs.paused_feeds:
                self.held.add(name)  # its changefeed's replication is paused (as the plan's reads found): stays so
            if name not in self.held:
                self.rt.resume(name)
        self.full_at = -1e9  # everything was skipped while paused: the next pass looks at everything
        log.info(
            "resumed: delivering again",
            extra=fields(
                resumed=list(plan.resumed), dropped=plan.dropped, paused_for=round(time.monotonic() - plan.pause, 3)
            ),
        )
        # Claimed before the first await: the loop runs beside this, and would otherwise report a dropped dispatcher
        # Stopped itself, with the older checkpoint its object holds, and that write could land last.
        for name in self._dropped:
            if name in plan.current and name not in self.closing:
                self.disowned[name] = time.monotonic()

    async def report_dropped(self, plan: ResumePlan) -> None:
        """The dispatchers a resume dropped, reported Stopped with where they stopped."""
        dropped, self._dropped = self._dropped, {}
        for name, (run, final) in sorted(dropped.items()):
            if run is None or name not in plan.current or name in self.closing:
                continue
            try:
                await self.status.write(run.record, STOPPED, final, f"not resumed: {plan.dropped[name]}")
            except API_ERRORS:
                self.disowned.pop(name, None)  # reported by the level-triggered loop (_disown) instead
