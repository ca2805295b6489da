"""The capture agent: one worker process that hosts dispatchers and proves it is alive through a Lease.

What it does, and why in this shape:

* **Registration.** It creates (or reuses) its ``Capture`` object and the ``coordination.k8s.io/v1``
  Lease ``capture-<name>``, then renews the Lease every ``renew_interval`` with a resourceVersion
  precondition. The maintainer treats the capture as alive while ``renewTime + leaseDurationSeconds``
  is in the future (``Capture.alive``).
* **Self-fencing.** If it has not renewed for ``renew_deadline`` (< the lease duration), or finds the
  Lease deleted or held by someone else, it stops every dispatcher at once and exits non-zero. So by
  the time the maintainer sees the Lease lapse and releases this capture's finalizers to re-place its
  spans elsewhere, none of them runs here any more: never two owners of a key. The check runs in its
  own task on a short tick, so a hung API call cannot delay it.
* **Level-triggered dispatcher lifecycle.** A list+watch (label ``cdc.maintainer.dev/capture=<name>``)
  keeps the assigned Dispatchers in memory; every loop iteration (about 0.2 s, or at once on a watch
  event) re-derives what to do from that state plus what the runtime really runs. Nothing depends on
  having seen a particular event, so a restarted agent picks up where the old one left off: dispatchers
  the API shows live but that this process does not run are reported Stopped (their checkpoint is
  final) and the maintainer places their spans again.
* **Epoch fencing.** Before starting a dispatcher, and again before it becomes Working, the agent does
  a strong read (GET, not the cache) of its Changefeed and rejects a dispatcher whose ``spec.epoch`` is
  older than ``status.epoch``: a stale maintainer's writes never reach Working.
* **Close.** A dispatcher being deleted is closed in the runtime, reported Stopped with its final
  checkpoint, and only then is its finalizer released: the maintainer reads the final checkpoint as the
  start ts of whatever replaces it.
* **Test hooks** (see :mod:`controller.capture.hooks`) hold closes and pause creates per table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from controller.capture.hooks import Hooks, hooks_from_annotations
from controller.capture.informer import NETWORK_ERRORS, Informer
from controller.capture.logs import fields
from controller.capture.runtime import DispatcherRuntime, LogicalClockRuntime
from controller.kube.client import JSON, LEASES, RESOURCES, ApiError, Client, sleep_or
from controller.kube.probes import ProbeServer, parse_endpoint
from controller.model.records import Capture, Dispatcher
from controller.model.resources import (
    InvalidResource,
    dispatcher_from_resource,
    lease_name,
    lease_resource,
    parse_time,
    round_time,
    status_merge_patch,
)
from controller.model.states import (
    CLOSED_DISPATCHER_STATES,
    DISPATCHER_FINALIZER,
    GROUP,
    LIVE_DISPATCHER_STATES,
    DispatcherState,
    Kind,
)

log = logging.getLogger("controller.capture")

#: Label the maintainer puts on a Dispatcher naming the capture that runs it.
CAPTURE_LABEL = f"{GROUP}/capture"

DISPATCHERS = RESOURCES[Kind.DISPATCHER]
CAPTURES = RESOURCES[Kind.CAPTURE]
CHANGEFEEDS = RESOURCES[Kind.CHANGEFEED]
TABLES = RESOURCES[Kind.TABLE]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_FENCED = 3

API_ERRORS = (ApiError, *NETWORK_ERRORS)
#: How many dispatchers one reconcile pass works on at once (each step is a few API requests).
STEP_CONCURRENCY = 16
#: Per reconcile pass: changefeed name -> the strong read of its published epoch.
Epochs = dict[str, "asyncio.Future[int | None]"]


class LeaseLost(Exception):
    """The Lease was deleted or taken by another holder: this capture may already be considered dead."""


class Fenced(Exception):
    """Raised where the agent would act after it fenced itself."""


@dataclass(frozen=True)
class Settings:
    name: str
    namespace: str
    lease_duration: int = 10
    renew_interval: float = 2.0
    renew_deadline: float = 7.0
    report_interval: float = 2.0
    tick: float = 0.2
    init_delay: float = 0.5
    #: Seconds between status writes of an unchanged Working dispatcher (a heartbeat only).
    heartbeat_interval: float = 10.0
    #: Seconds between re-reads of the Tables list (write rates).
    tables_interval: float = 5.0
    pod: str = ""
    address: str = ""
    #: ``http://HOST:PORT/PATH`` of the readiness endpoint ("" for none).
    readiness: str = ""

    def check(self) -> None:
        if not self.name or not self.namespace:
            raise ValueError("name and namespace are required")
        if self.lease_duration < 1:
            raise ValueError("--lease-duration must be at least 1 s")
        if not 0 < self.renew_interval < self.renew_deadline < self.lease_duration:
            raise ValueError("need 0 < --renew-interval < --renew-deadline < --lease-duration")
        if self.report_interval <= 0 or self.tick <= 0:
            raise ValueError("--report-interval and the tick must be positive")
        if self.readiness:
            try:
                parse_endpoint(self.readiness)
            except ValueError as exc:
                raise ValueError(f"--readiness {exc}") from None


@dataclass
class Run:
    """A dispatcher this process runs, and what was last written about it."""

    record: Dispatcher
    state: DispatcherState
    written_state: DispatcherState | None = None
    written_cp: int = -1
    written_at: float = 0.0  # monotonic
    #: The Dispatcher's resourceVersion when a pass last found the API showing ``state``: while it is
    #: unchanged and no report is due, a pass has nothing to do for this dispatcher (``Agent._quiet``).
    seen_rv: str = ""


@dataclass
class Closing:
    final: int
    written: bool
    released: bool = False


@dataclass
class Agent:
    client: Client
    settings: Settings
    runtime: DispatcherRuntime | None = None

    runs: dict[str, Run] = field(default_factory=dict)
    closing: dict[str, Closing] = field(default_factory=dict)
    rejected: set[str] = field(default_factory=set)
    #: Dispatchers reported Stopped/Rejected because they do not run here: when (skip re-writes for a while).
    disowned: dict[str, float] = field(default_factory=dict)
    rates: dict[tuple[str, int], tuple[float, int]] = field(default_factory=dict)
    rates_at: float = -1e9
    last_renew: float = 0.0
    lease_rv: str = ""
    fence_reason: str = ""
    hooks: Hooks = field(default_factory=Hooks)
    capture_status: dict[str, Any] = field(default_factory=dict)
    capture_status_at: float = -1e9
    _noted: set[tuple[str, str]] = field(default_factory=set)
    _hook_problems: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.runtime is None:
            self.runtime = LogicalClockRuntime(init_delay=self.settings.init_delay, rate_of=self._rate_of)
        self.rt: DispatcherRuntime = self.runtime
        self.stop = asyncio.Event()
        self.wake = asyncio.Event()
        s = self.settings
        self.dispatchers = Informer(
            self.client,
            DISPATCHERS,
            s.namespace,
            label_selector=f"{CAPTURE_LABEL}={s.name}",
            keep=lambda o: (o.get("spec") or {}).get("capture") == s.name,
            changed=self.wake,
        )
        # The client has no fieldSelector: watch the namespace's Captures (few) and keep our own.
        self.captures = Informer(
            self.client,
            CAPTURES,
            s.namespace,
            keep=lambda o: o.get("metadata", {}).get("name") == s.name,
            changed=self.wake,
        )

    # -- process ---------------------------------------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        """Readiness: registered, its Lease renewed within the deadline, its Dispatchers and Capture listed."""
        if self.fence_reason:
            return False, f"fenced: {self.fence_reason}"
        if not self.lease_rv:
            return False, "registering (Capture and Lease)"
        since = time.monotonic() - self.last_renew
        if since >= self.settings.renew_deadline:
            return False, f"Lease not renewed for {since:.0f}s"
        if not (self.dispatchers.synced.is_set() and self.captures.synced.is_set()):
            return False, "listing Dispatchers and Captures"
        return True, f"holding Lease {lease_name(self.settings.name)}, running {len(self.runs)} dispatcher(s)"

    async def run(self) -> int:
        """Register, then work until SIGTERM (exit 0) or fencing (exit 3)."""
        s = self.settings
        log.info("capture agent starting", extra=fields(capture=s.name, namespace=s.namespace, pid=os.getpid()))
        probe = ProbeServer(s.readiness, self.ready) if s.readiness else None
        if probe is not None:
            await probe.start()
        try:
            return await self._run()
        finally:
            if probe is not None:
                await probe.stop()

    async def _run(self) -> int:
        if not await self._register():
            return EXIT_OK  # stopped before it could register
        tasks = {
            asyncio.create_task(self.dispatchers.run(), name="watch-dispatchers"),
            asyncio.create_task(self.captures.run(), name="watch-capture"),
            asyncio.create_task(self._renew_loop(), name="renew-lease"),
            asyncio.create_task(self._watchdog(), name="watchdog"),
            asyncio.create_task(self._main_loop(), name="main-loop"),
        }
        stopper = asyncio.create_task(self.stop.wait(), name="stop")
        try:
            done, _ = await asyncio.wait({stopper, *tasks}, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopper}:
                # A background task must never end: a dead watch would leave a zombie agent. Fail loudly;
                # the supervisor restarts the process, which re-derives everything from the API.
                exc = task.exception() if not task.cancelled() else None
                self._fence(f"internal error: task {task.get_name()} ended ({exc!r})")
        finally:
            for task in (*tasks, stopper):
                task.cancel()
            await asyncio.gather(*tasks, stopper, return_exceptions=True)
        if self.fence_reason:
            return EXIT_FENCED
        await self._shutdown()
        return EXIT_OK

    def _fence(self, reason: str) -> None:
        """Stop every dispatcher now, synchronously, and make the process exit non-zero."""
        if self.fence_reason:
            return
        self.fence_reason = reason
        stopped = {}
        for name in sorted(self.runs):
            with contextlib.suppress(KeyError):
                stopped[name] = self.rt.close(name)
        self.runs.clear()
        log.error(
            "fenced itself: stopped all dispatchers and exiting",
            extra=fields(capture=self.settings.name, reason=reason, stopped=stopped),
        )
        self.stop.set()

    async def _shutdown(self) -> None:
        """SIGTERM: stop dispatchers, report them Stopped, then release the Lease.

        Releasing (holderIdentity "", leaseDurationSeconds 1, client-go's ReleaseOnCancel convention)
        rather than letting the Lease expire: every dispatcher of this process is already stopped, so
        there is nothing to fence, and the maintainer sees the capture gone within a second instead of
        a whole lease duration, and re-places whatever the Stopped reports below did not cover. The
        Lease is released last, so no one acts on this capture's absence while a dispatcher still runs.
        """
        finals: dict[str, tuple[Run, int]] = {}
        for name in sorted(self.runs):
            run = self.runs.pop(name)
            finals[name] = (run, self.rt.close(name))
        log.info("stopping", extra=fields(capture=self.settings.name, dispatchers=sorted(finals)))

        async def report() -> None:
            for run, final in finals.values():
                with contextlib.suppress(*API_ERRORS):
                    await self._write(run.record, DispatcherState.STOPPED, final, "capture agent stopped")

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(report(), timeout=3.0)
        try:
            await asyncio.wait_for(self._release_lease(), timeout=2.0)
            log.info("released the Lease", extra=fields(lease=lease_name(self.settings.name)))
        except (*API_ERRORS, LeaseLost) as exc:
            log.warning("could not release the Lease; it will expire", extra=fields(error=repr(exc)))

    # -- registration and Lease -----------------------------------------------------------------------

    def _lease_body(self, *, release: bool = False) -> JSON:
        s = self.settings
        capture = Capture(
            name=s.name,
            namespace=s.namespace,
            renew_time=round_time(time.time()),
            lease_duration=float(1 if release else s.lease_duration),
        )
        body = lease_resource(capture)
        if release:
            body["spec"]["holderIdentity"] = ""
        if self.lease_rv:
            body["metadata"]["resourceVersion"] = self.lease_rv
        return body

    async def _register(self) -> bool:
        s = self.settings
        while not self.stop.is_set():
            try:
                await self._ensure_capture()
                await self._acquire_lease()
                self.last_renew = time.monotonic()
                log.info("registered", extra=fields(capture=s.name, lease=lease_name(s.name)))
                return True
            except (*API_ERRORS, LeaseLost) as exc:
                log.warning("registration failed; retrying", extra=fields(error=repr(exc)))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), timeout=s.renew_interval)
        return False

    async def _ensure_capture(self) -> None:
        s = self.settings
        body: JSON = {
            "apiVersion": CAPTURES.group + "/" + CAPTURES.version,
            "kind": CAPTURES.kind,
            "metadata": {"name": s.name, "namespace": s.namespace},
            "spec": {},
        }
        try:
            await self.client.create(CAPTURES, s.namespace, body)
            log.info("created Capture", extra=fields(capture=s.name))
        except ApiError as exc:
            if not exc.already_exists:
                raise

    async def _acquire_lease(self) -> None:
        s = self.settings
        name = lease_name(s.name)
        self.lease_rv = ""
        try:
            out = await self.client.create(LEASES, s.namespace, self._lease_body())
            self.lease_rv = out["metadata"]["resourceVersion"]
            return
        except ApiError as exc:
            if not exc.already_exists:
                raise
        current = await self.client.get(LEASES, s.namespace, name)
        spec = current.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        if holder not in ("", s.name) and not _expired(spec):
            raise LeaseLost(f"Lease {name} is held by {holder!r} and has not expired")
        self.lease_rv = current["metadata"]["resourceVersion"]
        out = await self.client.replace(LEASES, s.namespace, name, self._lease_body())
        self.lease_rv = out["metadata"]["resourceVersion"]

    async def _renew(self) -> None:
        s = self.settings
        name = lease_name(s.name)
        for _ in range(2):
            try:
                out = await self.client.replace(LEASES, s.namespace, name, self._lease_body())
                self.lease_rv = out["metadata"]["resourceVersion"]
                return
            except ApiError as exc:
                if exc.not_found:
                    raise LeaseLost(f"Lease {name} was deleted") from None
                if not exc.conflict:
                    raise
            try:
                current = await self.client.get(LEASES, s.namespace, name)
            except ApiError as exc:
                if exc.not_found:
                    raise LeaseLost(f"Lease {name} was deleted") from None
                raise
            holder = (current.get("spec") or {}).get("holderIdentity") or ""
            if holder != s.name:
                raise LeaseLost(f"Lease {name} is now held by {holder!r}")
            # Our own write whose answer we missed (e.g. a timed-out request): adopt it and retry.
            self.lease_rv = current["metadata"]["resourceVersion"]
        raise ApiError(409, "Conflict", f"Lease {name} kept changing")

    async def _release_lease(self) -> None:
        s = self.settings
        await self.client.replace(LEASES, s.namespace, lease_name(s.name), self._lease_body(release=True))

    async def _renew_loop(self) -> None:
        s = self.settings
        timeout = min(s.renew_deadline / 2, max(1.0, s.renew_interval))
        while True:
            await asyncio.sleep(s.renew_interval)
            sent = time.monotonic()
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
                # arrives as the renewal fails (e.g. connection refused), and this loop would never end.
                async with asyncio.timeout(timeout):
                    await self._renew()
                self.last_renew = sent
            except LeaseLost as exc:
                self._fence(str(exc))
                return
            except API_ERRORS as exc:
                log.warning(
                    "Lease renewal failed",
                    extra=fields(error=repr(exc), since_renew=round(time.monotonic() - self.last_renew, 3)),
                )

    async def _watchdog(self) -> None:
        s = self.settings
        while True:
            late = time.monotonic() - self.last_renew
            if late > s.renew_deadline:
                self._fence(
                    f"could not renew Lease {lease_name(s.name)} for {late:.1f}s "
                    f"(renew deadline {s.renew_deadline}s, lease duration {s.lease_duration}s)"
                )
                return
            await asyncio.sleep(min(0.1, s.tick))

    # -- the loop ---------------------------------------------------------------------------------------

    async def _main_loop(self) -> None:
        await self.dispatchers.synced.wait()
        await self.captures.synced.wait()
        log.info("watching dispatchers", extra=fields(selector=f"{CAPTURE_LABEL}={self.settings.name}"))
        while True:
            await self.reconcile()
            await sleep_or(self.wake, self.settings.tick)

    async def reconcile(self) -> None:
        """One level-triggered pass over the assigned dispatchers."""
        if self.fence_reason:
            raise Fenced(self.fence_reason)
        self._read_hooks()
        await self._refresh_rates()
        objects = dict(self.dispatchers.objects)
        for name in sorted(set(self.runs) - set(objects)):
            # Deleted outright (e.g. the maintainer released the finalizer of a capture it thought lost).
            self.runs.pop(name)
            final = self.rt.close(name)
            log.warning("dispatcher vanished; stopped it", extra=fields(dispatcher=name, checkpointTs=final))
        for gone in (set(self.closing) | self.rejected | set(self.disowned)) - set(objects):
            self.closing.pop(gone, None)
            self.rejected.discard(gone)
            self.disowned.pop(gone, None)
        self._noted = {n for n in self._noted if n[0] in objects}
        epochs: Epochs = {}  # strong reads of this pass, shared by its steps
        gate = asyncio.Semaphore(STEP_CONCURRENCY)

        async def one(name: str) -> None:
            raw = objects[name]
            try:
                d = dispatcher_from_resource(raw)
            except InvalidResource as exc:
                self._note(name, "invalid", logging.WARNING, "ignoring an invalid Dispatcher", error=str(exc))
                return
            async with gate:
                try:
                    await self._step(d, raw, epochs)
                except API_ERRORS as exc:
                    log.warning("dispatcher step failed", extra=fields(dispatcher=name, error=repr(exc)))
                    return
            run = self.runs.get(name)
            if run is not None and d.state is run.state:
                run.seen_rv = str((raw.get("metadata") or {}).get("resourceVersion") or "")

        # Steps of different dispatchers are independent; their writes go out concurrently (a capture
        # with thousands of dispatchers must not report them one request at a time). A TaskGroup: if one
        # step finds the capture fenced, the others are cancelled at once.
        now = time.monotonic()
        try:
            async with asyncio.TaskGroup() as group:
                for name in sorted(objects):
                    if not self._quiet(name, objects[name], now):
                        group.create_task(one(name))
        except BaseExceptionGroup as eg:  # e.g. Fenced: raise it as a sequential pass would have
            raise eg.exceptions[0] from None
        try:
            await self._report_capture()
        except API_ERRORS as exc:
            log.warning("Capture status write failed", extra=fields(error=repr(exc)))

    def _quiet(self, name: str, raw: JSON, now: float) -> bool:
        """A Working dispatcher this process runs, unchanged in the API since a pass found it showing what
        was written, with no report due: a pass has nothing to do for it. (With thousands of dispatchers,
        converting and stepping each one five times a second was most of a capture's CPU.)"""
        run = self.runs.get(name)
        if run is None or run.state is not DispatcherState.WORKING or run.written_state is not run.state:
            return False
        meta = raw.get("metadata") or {}
        if meta.get("deletionTimestamp") or str(meta.get("resourceVersion") or "") != run.seen_rv:
            return False
        s = self.settings
        return now - run.written_at < min(s.report_interval, s.heartbeat_interval)

    async def _step(self, d: Dispatcher, raw: JSON, epochs: Epochs) -> None:
        name = d.name
        if d.deleting:
            await self._close(d, raw)
        elif name in self.runs:
            await self._advance(self.runs[name], d, epochs)
        elif d.state is DispatcherState.PENDING:
            await self._create(d, epochs)
        elif d.state in LIVE_DISPATCHER_STATES:
            await self._disown(d)

    async def _create(self, d: Dispatcher, epochs: Epochs) -> None:
        if self.hooks.pauses_create(d.table_id):
            self._note(d.name, "pause-create", logging.INFO, "create paused by hook", tableID=d.table_id)
            return
        epoch = await self._epoch(d.changefeed, epochs)
        if epoch is None:
            self._note(d.name, "no-changefeed", logging.WARNING, "changefeed not found; waiting", cf=d.changefeed)
            return
        if d.epoch < epoch:
            message = f"stale epoch: dispatcher epoch {d.epoch} < changefeed epoch {epoch}"
            await self._write(d, DispatcherState.REJECTED, d.start_ts, message)
            log.info("rejected dispatcher", extra=fields(dispatcher=d.name, epoch=d.epoch, current=epoch))
            return
        if self.fence_reason:
            raise Fenced(self.fence_reason)
        self.rt.start(d)
        self.runs[d.name] = Run(d, DispatcherState.INITIALIZING)
        log.info(
            "started dispatcher",
            extra=fields(dispatcher=d.name, span=d.span, tableID=d.table_id, startTs=d.start_ts, epoch=d.epoch),
        )
        await self._report(self.runs[d.name], d)

    async def _advance(self, run: Run, d: Dispatcher, epochs: Epochs) -> None:
        cp = self.rt.checkpoint(d.name)
        if run.state is DispatcherState.INITIALIZING and cp > d.start_ts:
            epoch = await self._epoch(d.changefeed, epochs)
            if epoch is not None and d.epoch < epoch:
                self.runs.pop(d.name)
                final = self.rt.close(d.name)
                self.rejected.add(d.name)
                message = f"stale epoch at Working: dispatcher epoch {d.epoch} < changefeed epoch {epoch}"
                log.info("rejected dispatcher", extra=fields(dispatcher=d.name, epoch=d.epoch, current=epoch))
                await self._write(d, DispatcherState.REJECTED, final, message)
                return
            if epoch is not None:
                run.state = DispatcherState.WORKING
                log.info("dispatcher working", extra=fields(dispatcher=d.name, checkpointTs=cp))
        stale = time.monotonic() - run.written_at > 2 * self.settings.report_interval
        if run.written_state is run.state and d.state is not run.state and stale:
            # What we wrote is not what the API shows (a write lost, or overwritten): level-triggered, re-report.
            run.written_state = None
        await self._report(run, d)

    async def _report(self, run: Run, d: Dispatcher) -> None:
        """Write the status of a running dispatcher when due: at once on a state change, else batched."""
        s = self.settings
        now = time.monotonic()
        cp = self.rt.checkpoint(d.name)
        due = (
            run.written_state is not run.state
            or (now - run.written_at >= s.report_interval and cp != run.written_cp)
            or now - run.written_at >= s.heartbeat_interval
        )
        if not due:
            return
        state = run.state
        await self._write(d, state, cp)
        run.written_state, run.written_cp, run.written_at = state, cp, now
        log.debug(
            "reported",
            extra=fields(dispatcher=d.name, state=state.value, checkpointTs=cp),
        )

    async def _close(self, d: Dispatcher, raw: JSON) -> None:
        name = d.name
        if name in self.runs and self.hooks.holds_close(d.table_id):
            self._note(name, "hold-close", logging.INFO, "close held by hook", tableID=d.table_id)
            return
        closing = self.closing.get(name)
        if closing is None:
            run = self.runs.pop(name, None)
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
            state = DispatcherState.REJECTED if name in self.rejected else DispatcherState.STOPPED
            obj = await self._write(d, state, closing.final, "closed")
            closing.written = True
        if await self._release_finalizer(obj):
            closing.released = True
            log.info("released finalizer", extra=fields(dispatcher=name, checkpointTs=closing.final))

    async def _disown(self, d: Dispatcher) -> None:
        """Live in the API but not run by this process (it restarted, or refused it at Working)."""
        at = self.disowned.get(d.name)
        if at is not None and time.monotonic() - at < 2 * self.settings.report_interval:
            return
        if d.name in self.rejected:
            state, message = DispatcherState.REJECTED, "stale epoch"
        else:
            state, message = DispatcherState.STOPPED, "not running on this capture (the capture agent restarted)"
        await self._write(d, state, d.checkpoint_ts, message)
        self.disowned[d.name] = time.monotonic()
        log.info("reported a dispatcher it does not run", extra=fields(dispatcher=d.name, state=state.value))

    # -- API helpers -----------------------------------------------------------------------------------

    async def _write(self, d: Dispatcher, state: DispatcherState, cp: int, message: str = "") -> JSON:
        if self.fence_reason and state in LIVE_DISPATCHER_STATES:
            raise Fenced(self.fence_reason)
        record = d.evolve(state=state, checkpoint_ts=cp, heartbeat=round_time(time.time()), message=message)
        rate, regions = 0.0, 0
        if state in LIVE_DISPATCHER_STATES:  # what the split and merge schedulers judge by
            with contextlib.suppress(KeyError):  # not started in the runtime yet
                rate, regions = self.rt.write_rate(d.name), self.rt.region_count(d.name)
        record = record.evolve(write_rate=rate, region_count=regions)
        return await self.client.patch(DISPATCHERS, d.namespace, d.name, status_merge_patch(record), sub="status")

    async def _release_finalizer(self, obj: JSON) -> bool:
        """Remove our finalizer with a resourceVersion precondition, re-reading on conflict."""
        s = self.settings
        for _ in range(5):
            meta = obj.get("metadata") or {}
            finalizers = list(meta.get("finalizers") or [])
            if DISPATCHER_FINALIZER not in finalizers:
                return True
            patch = {
                "metadata": {
                    "finalizers": [f for f in finalizers if f != DISPATCHER_FINALIZER],
                    "resourceVersion": meta.get("resourceVersion"),
                }
            }
            try:
                await self.client.patch(DISPATCHERS, s.namespace, meta["name"], patch)
                return True
            except ApiError as exc:
                if exc.not_found:
                    return True
                if not exc.conflict:
                    raise
            try:
                obj = await self.client.get(DISPATCHERS, s.namespace, meta["name"])
            except ApiError as exc:
                if exc.not_found:
                    return True
                raise
        return False

    async def _epoch(self, changefeed: str, epochs: Epochs) -> int | None:
        """The changefeed's published epoch by a strong read (GET); ``None`` if it does not exist.

        One read per changefeed per pass, shared by the pass's concurrent steps."""
        if changefeed not in epochs:
            epochs[changefeed] = asyncio.ensure_future(self._read_epoch(changefeed))
        return await epochs[changefeed]

    async def _read_epoch(self, changefeed: str) -> int | None:
        try:
            obj = await self.client.get(CHANGEFEEDS, self.settings.namespace, changefeed)
        except ApiError as exc:
            if not exc.not_found:
                raise
            return None
        return int((obj.get("status") or {}).get("epoch") or 0)

    def _read_hooks(self) -> None:
        obj = self.captures.objects.get(self.settings.name) or {}
        hooks, problems = hooks_from_annotations((obj.get("metadata") or {}).get("annotations"))
        if hooks != self.hooks:
            log.info("test hooks changed", extra=fields(hooks=hooks.describe()))
            self.hooks = hooks
        if tuple(problems) != self._hook_problems:
            self._hook_problems = tuple(problems)
            for problem in problems:
                log.warning("bad test hook annotation", extra=fields(problem=problem))

    def _rate_of(self, d: Dispatcher) -> tuple[float, int]:
        return self.rates.get((d.changefeed, d.table_id), (0.0, 0))

    async def _refresh_rates(self) -> None:
        """Re-read the Tables list now and then while dispatchers run (traffic, for split and merge)."""
        if not self.runs or time.monotonic() - self.rates_at < self.settings.tables_interval:
            return
        self.rates_at = time.monotonic()
        try:
            items, _ = await self.client.list(TABLES, self.settings.namespace)
        except API_ERRORS as exc:
            log.warning("could not list Tables", extra=fields(error=repr(exc)))
            return
        rates: dict[tuple[str, int], tuple[float, int]] = {}
        for item in items:
            spec = item.get("spec") or {}
            with contextlib.suppress(KeyError, TypeError, ValueError):
                key = (str(spec.get("changefeed")), int(spec["tableID"]))
                rates[key] = (float(spec.get("writeRate") or 0.0), int(spec.get("regionCount") or 0))
        self.rates = rates

    async def _report_capture(self) -> None:
        """The Capture's status, for humans (liveness is the Lease): when it changes, or every 30 s."""
        s = self.settings
        status = {"dispatchers": len(self.runs), "pod": s.pod or None, "address": s.address or None}
        now = time.monotonic()
        if status == self.capture_status and now - self.capture_status_at < 30.0:
            return
        try:
            await self.client.patch(CAPTURES, s.namespace, s.name, {"status": status}, sub="status")
        except ApiError as exc:
            if not exc.not_found:
                raise
            log.warning("Capture object is gone; registering again", extra=fields(capture=s.name))
            await self._ensure_capture()
            return
        self.capture_status, self.capture_status_at = status, now

    def _note(self, name: str, what: str, level: int, msg: str, **extra: Any) -> None:
        """Log a waiting condition once per dispatcher (not on every loop iteration)."""
        if (name, what) in self._noted:
            return
        self._noted.add((name, what))
        log.log(level, msg, extra=fields(dispatcher=name, **extra))


def _expired(lease_spec: JSON) -> bool:
    renew = lease_spec.get("renewTime")
    if not renew:
        return True
    try:
        return parse_time(str(renew)) + float(lease_spec.get("leaseDurationSeconds") or 0) < time.time()
    except ValueError:
        return True


def install_signal_handlers(agent: Agent) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stop.set)
