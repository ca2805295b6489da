"""The capture agent: one worker process that hosts dispatchers and proves it is alive through a Lease.

What it does, and why in this shape:

* **Registration.** It creates (or reuses) its ``Capture`` object and the ``coordination.k8s.io/v1``
  Lease ``capture-<name>``, then renews the Lease every ``renew_interval`` with a resourceVersion
  precondition and the Lease's uid (a Lease PUT to a missing name *creates* it on kube-apiserver: without the
  uid, a renewal re-created a Lease deleted by hand and the capture never fenced; with it the renewal is
  refused, 409). The maintainer treats the capture as alive while ``renewTime + leaseDurationSeconds``
  is in the future (``Capture.alive``).
* **Pause, then resume or fence.** If it has not renewed for ``renew_deadline`` (< the lease duration)
  it *pauses*: every dispatcher stops delivering at once but stays in memory with its position, and it
  keeps trying to renew. So by the time the maintainer could call the capture lost, nothing runs here.
  The check runs in its own task on a short tick, so a hung API call cannot delay it. Each renewal is a
  compare-and-swap on the Lease's resourceVersion of its previous renewal, and the maintainer takes a
  lapsed Lease (holder cleared) before it lets anyone else replicate this capture's spans: so a renewal
  that succeeds proves nothing was taken, and only then does a paused capture read its Dispatchers
  (strongly, beside the renewals: the reads may outlast a renew deadline) and, if a renewal younger than
  the renew deadline still vouches for it when they are done, resume those that still exist, are not
  being deleted, and whose changefeed has started no maintainer term it did not see. If the Lease was
  deleted (409 for the uid, then 404), was created again (another uid) or names someone else (taken), it
  stops everything and exits non-zero (``EXIT_FENCED``), as a fenced capture.
  ``acquireTime`` identifies this process's incarnation, so a renewal that timed out but landed is
  recognised as its own and a restarted process of the same name is not. An outage of the API shorter
  than the maintainer's patience therefore costs no dispatcher anything but the pause
  (docs/architecture.md, Fencing).
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
* **Reports** (see :mod:`controller.model.progress`). A dispatcher's status is written when its state
  changes (Initializing, Working, Stopped or Rejected with the final checkpoint) and when its traffic
  changes materially, never just because its checkpoint moved. How far the Working dispatchers got
  travels with every Lease renewal instead, as one report per (changefeed, mode): the lowest
  checkpoint, how many dispatchers and a digest of their uids, the slowest, and this process's
  ``incarnation`` (random per start). So at rest a capture costs the API one write per renew interval
  however many spans it holds. Before any checkpoint leaves the process, the runtime's sink (the
  delivery ledger, ``--ledger-dir``) is flushed: nothing is claimed that was not delivered.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from controller.capture.dataplane import Endpoints, RoutedRuntime, unsupported_endpoint
from controller.capture.hooks import Hooks, disabled_hooks, hooks_from_annotations
from controller.capture.informer import NETWORK_ERRORS, Informer
from controller.capture.ledger import Ledger
from controller.capture.logs import fields
from controller.capture.runtime import DispatcherRuntime, LogicalClockRuntime
from controller.kube import tenure
from controller.kube.client import (
    JSON,
    LEASES,
    RESOURCES,
    SECRETS,
    ApiError,
    Client,
    remove_finalizer,
    sleep_or,
)
from controller.kube.probes import ProbeServer, parse_endpoint
from controller.model import progress
from controller.model.records import DISPATCHER_FAILED_PREFIX, Capture, Dispatcher
from controller.model.resources import (
    CAPTURE_LABEL,
    DRAIN_FOR_SHUTDOWN,
    DRAIN_REASON_ANNOTATION,
    InvalidResource,
    changefeed_from_resource,
    dispatcher_from_resource,
    format_time,
    lease_name,
    lease_resource,
    parse_time,
    round_time,
    status_merge_patch,
)
from controller.model.states import (
    CLOSED_DISPATCHER_STATES,
    DISPATCHER_FINALIZER,
    LIVE_DISPATCHER_STATES,
    DispatcherState,
    Kind,
    Mode,
)

log = logging.getLogger("controller.capture")

DISPATCHERS = RESOURCES[Kind.DISPATCHER]
CAPTURES = RESOURCES[Kind.CAPTURE]
CHANGEFEEDS = RESOURCES[Kind.CHANGEFEED]
TABLES = RESOURCES[Kind.TABLE]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_FENCED = 3
#: Seconds between renewal attempts after one failed (an API that comes back is seen at once).
RETRY_AFTER_FAILURE = 0.5
#: At most this long to read what a paused capture may resume (then it tries again after a renewal).
RESUME_CHECK_TIMEOUT = 120.0

API_ERRORS = (ApiError, *NETWORK_ERRORS)
#: Seconds between rewrites of an unchanged Capture status.
CAPTURE_STATUS_REFRESH = 300.0
#: Seconds from the start of one reconcile pass to the next, at least (at most ``tick``): events come in
#: bursts (a maintainer's decision creates hundreds of dispatchers), and one pass takes a burst with one
#: strong read of the epoch and one Capture status write instead of a pass, a read and a write per event.
PASS_MIN_INTERVAL = 0.1
#: Seconds between full reconcile passes (every dispatcher held), the level-triggered backstop of the passes
#: that visit only what changed. A dispatcher's traffic changes when its Table's does, and that marks the
#: dispatchers of the Table (``_refresh_rates``), so at rest a capture does not walk its dispatchers but once
#: a minute (issue 25: a pass every 2 s made three captures cost 0.39 of a core at 50,000 spans).
FULL_PASS_INTERVAL = 60.0
#: How many dispatchers one reconcile pass works on at once (each step is a few API requests).
STEP_CONCURRENCY = 16
#: A dispatcher whose step raised an unexpected error (a bug, not the API's) is tried again after this many seconds,
#: doubling up to ``MAX_STEP_ERROR_BACKOFF`` while it keeps failing: loud (a traceback each time), counted
#: (``Agent.step_errors``), and neither spinning at the pace of the passes nor stopping the capture's other
#: dispatchers.
STEP_ERROR_BACKOFF = 1.0
MAX_STEP_ERROR_BACKOFF = 60.0
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
    #: Seconds before a status write the API does not show is sent again (twice this), before a dispatcher
    #: still Initializing is reported so, and at least between two Capture status writes. A dispatcher's
    #: traffic is looked at when its Table's changes (the Tables are read every ``tables_interval``); full
    #: passes run every ``FULL_PASS_INTERVAL``. (Checkpoints are reported with every Lease renewal:
    #: ``renew_interval``.)
    report_interval: float = 2.0
    tick: float = 0.2
    init_delay: float = 0.5
    #: Seconds between re-reads of the Tables list (write rates).
    tables_interval: float = 5.0
    pod: str = ""
    address: str = ""
    #: ``http://HOST:PORT/PATH`` of the readiness endpoint ("" for none).
    readiness: str = ""
    #: Directory of the delivery ledger of the default runtime ("" for none; controller/capture/ledger.py).
    ledger_dir: str = ""
    #: Honour the test hooks (``controller.capture.hooks``): off in production, where anyone allowed to patch a
    #: Capture could otherwise freeze every close, a teardown's included.
    test_hooks: bool = False
    #: SIGTERM: seconds to wait for the maintainer to move this capture's dispatchers off (the agent marks its
    #: Capture draining) before it stops what is left and releases its Lease; 0 stops at once.
    drain_timeout: float = 0.0
    #: Seconds between tenure steps (controller/kube/tenure.py: what survived leaves the collector's full
    #: passes, which at tens of thousands of dispatchers would hold the loop, Lease renewals included); 0: off,
    #: the class's default (a test's process); the command line's default is tenure.PERIOD (0.5 s).
    gc_tenure: float = 0.0

    def check(self) -> None:
        if not self.name or not self.namespace:
            raise ValueError("name and namespace are required")
        if self.lease_duration < 1:
            raise ValueError("--lease-duration must be at least 1 s")
        if not 0 < self.renew_interval < self.renew_deadline < self.lease_duration:
            raise ValueError("need 0 < --renew-interval < --renew-deadline < --lease-duration")
        if self.report_interval <= 0 or self.tick <= 0:
            raise ValueError("--report-interval and the tick must be positive")
        if self.gc_tenure < 0:
            raise ValueError("--gc-tenure must be 0 (off) or positive")
        if self.drain_timeout < 0:
            raise ValueError("--drain-timeout must be at least 0")
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
    written_at: float = 0.0  # monotonic
    #: Write rate and region count as last written, and when they were last looked at (monotonic).
    written_traffic: tuple[float, int] = (0.0, 0)
    traffic_at: float = 0.0
    #: When this process started it (monotonic).
    started_at: float = field(default_factory=time.monotonic)
    #: Its runtime's failure (``RoutedRuntime.failed``) has been written to its status message.
    failure_written: bool = False
    #: Assignments of ``state`` or ``written_state``, of any run (with ``Runs.version``: what the progress
    #: report's groups are cached on).
    changes: ClassVar[int] = 0

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("state", "written_state"):
            Run.changes += 1
        object.__setattr__(self, name, value)


class Runs(dict[str, Run]):
    """The runs of a process, counting the changes of which dispatchers run (``version``)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    def __setitem__(self, name: str, run: Run) -> None:
        self.version += 1
        super().__setitem__(name, run)

    def __delitem__(self, name: str) -> None:
        self.version += 1
        super().__delitem__(name)

    def pop(self, name: str, *default: Any) -> Any:
        self.version += 1
        return super().pop(name, *default)

    def clear(self) -> None:
        self.version += 1
        super().clear()


@dataclass(frozen=True)
class Group:
    """One (changefeed, mode) of the progress report: the reported runs (names sorted) and their digest."""

    names: tuple[str, ...]
    digest: str


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

    runs: Runs = field(default_factory=Runs)
    closing: dict[str, Closing] = field(default_factory=dict)
    rejected: set[str] = field(default_factory=set)
    #: Dispatchers reported Stopped/Rejected because they do not run here: when (skip re-writes for a while).
    disowned: dict[str, float] = field(default_factory=dict)
    rates: dict[tuple[str, int], tuple[float, int]] = field(default_factory=dict)
    rates_at: float = -1e9
    last_renew: float = 0.0
    lease_rv: str = ""
    #: The uid of the Lease this process holds (from the answer of its create, GET or last PUT): every renewal
    #: carries it, so a Lease deleted meanwhile is not re-created by the renewal (a Lease PUT to a missing name
    #: creates it) but refused with 409 (the uid precondition fails), and a Lease created again is not ours.
    lease_uid: str = ""
    fence_reason: str = ""
    #: Why this capture may not run here at all (its Lease is forbidden to it): it exits 1 without registering.
    refused: str = ""
    #: A SIGTERM asked it to stop: it is draining (``drain_timeout``), then sets ``stop``.
    terminating: bool = False
    #: The Lease this process took over did not name this capture (released by a previous process, or taken by a
    #: maintainer after it lapsed): the maintainer may be releasing what was assigned before, on the strength of
    #: that Lease. So the Pending dispatchers of its first listing (``inherited``) are reported Stopped, never
    #: started: the maintainer places those spans again. (A Lease still naming it: the maintainer's take is a
    #: compare-and-swap on the version this process's acquisition changed, so nothing was released.)
    took_over_foreign: bool = False
    inherited: set[str] = field(default_factory=set)
    _drain_task: asyncio.Task[None] | None = field(default=None, repr=False)
    #: When it stopped delivering because it could not renew its Lease (monotonic); None while delivering.
    paused_at: float | None = None
    #: Per changefeed, the highest epoch a strong read has shown it (a paused dispatcher resumes only if no
    #: newer one was published meanwhile).
    epochs_seen: dict[str, int] = field(default_factory=dict)
    epochs_at: float = -1e9
    hooks: Hooks = field(default_factory=Hooks)
    capture_status: dict[str, Any] = field(default_factory=dict)
    capture_status_at: float = -1e9
    #: This process: a report of another incarnation is about dispatchers this process does not run.
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    ledger: Ledger | None = None
    _noted: set[tuple[str, str]] = field(default_factory=set)
    _hook_problems: tuple[str, ...] = ()
    #: When the last full pass began (monotonic); see ``reconcile``.
    full_at: float = -1e9
    #: Dispatchers whose step failed for want of the API (a transport error, an error status): visited again at
    #: the next pass.
    retry: set[str] = field(default_factory=set)
    #: Dispatchers whose step raised an unexpected error (a bug): name -> (failures in a row, monotonic time before
    #: which no pass tries it again). Dropped when its step goes through or its object is gone.
    broken: dict[str, tuple[int, float]] = field(default_factory=dict)
    #: Unexpected errors raised by dispatcher steps since the process started (each logged with its traceback).
    step_errors: int = 0
    #: Runs not settled (see ``_settled``) when last looked at: every pass visits them.
    active: set[str] = field(default_factory=set)
    #: The progress report's groups, and the (``Runs.version``, ``Run.changes``) they were computed at.
    _groups: dict[tuple[str, Mode], Group] = field(default_factory=dict)
    _groups_at: tuple[int, int] = (-1, -1)
    #: The changefeeds of the runs, at ``Runs.version`` (the epochs re-read every few seconds are theirs).
    _changefeeds: tuple[int, list[str]] = (-1, [])

    def __post_init__(self) -> None:
        if self.runtime is None:
            if self.settings.ledger_dir and self.ledger is None:
                self.ledger = Ledger(self.settings.ledger_dir, self.settings.name, self.incarnation)
            self.runtime = LogicalClockRuntime(
                init_delay=self.settings.init_delay,
                rate_of=self._rate_of,
                deliver_until=lambda: self.last_renew + self.settings.renew_deadline,
                sink=self.ledger,
            )
        #: Dispatchers of a changefeed with a source and a sink run in the real data plane (controller/capture/
        #: dataplane.py), configured from its Secrets before the first starts; the others in ``runtime``.
        self.routed = RoutedRuntime(self.runtime)
        self.rt: DispatcherRuntime = self.routed
        #: Changefeeds whose source was looked up (its Secrets read, or found to have none).
        self.sources_read: set[str] = set()
        #: This process's hold on its Lease: the ``acquireTime`` it wrote. A renewal answered 409 whose Lease
        #: still carries it was our own write (its answer lost); any other means the Lease is not ours.
        self.acquire_time = format_time(time.time(), micro=True)
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
        self.tenure = tenure.Tenure(s.gc_tenure) if s.gc_tenure > 0 else None

    # -- process ---------------------------------------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        """Readiness: registered, its Lease renewed within the deadline, its Dispatchers and Capture listed."""
        if self.fence_reason:
            return False, f"fenced: {self.fence_reason}"
        if not self.lease_rv:
            return False, "registering (Capture and Lease)"
        if self.paused_at is not None:
            return False, f"paused for {time.monotonic() - self.paused_at:.0f}s: the Lease cannot be renewed"
        since = time.monotonic() - self.last_renew
        if since >= self.settings.renew_deadline:
            return False, f"Lease not renewed for {since:.0f}s"
        if not (self.dispatchers.synced.is_set() and self.captures.synced.is_set()):
            return False, "listing Dispatchers and Captures"
        return True, f"holding Lease {lease_name(self.settings.name)}, running {len(self.runs)} dispatcher(s)"

    async def run(self) -> int:
        """Register, then work until SIGTERM (exit 0) or fencing (exit 3)."""
        s = self.settings
        log.info(
            "capture agent starting",
            extra=fields(capture=s.name, namespace=s.namespace, pid=os.getpid(), incarnation=self.incarnation),
        )
        probe = ProbeServer(s.readiness, self.ready) if s.readiness else None
        if probe is not None:
            await probe.start()
        try:
            return await self._run()
        finally:
            if self.ledger is not None:
                self.ledger.close()
            with contextlib.suppress(Exception):
                await self.routed.aclose()
            if probe is not None:
                await probe.stop()

    async def _run(self) -> int:
        if not await self._register():
            return EXIT_ERROR if self.refused else EXIT_OK  # refused its Lease, or stopped before it registered
        tasks = {
            asyncio.create_task(self.dispatchers.run(), name="watch-dispatchers"),
            asyncio.create_task(self.captures.run(), name="watch-capture"),
            asyncio.create_task(self._renew_loop(), name="renew-lease"),
            asyncio.create_task(self._watchdog(), name="watchdog"),
            asyncio.create_task(self._main_loop(), name="main-loop"),
        }
        if self.tenure is not None:
            tasks.add(asyncio.create_task(self.tenure.run(), name="gc-tenure"))
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
            for name, (run, final) in finals.items():
                try:
                    await self._write(run.record, DispatcherState.STOPPED, final, "capture agent stopped")
                except API_ERRORS:
                    pass  # the maintainer sees the Lease released (below) and places the spans again
                except Exception:  # a bug: said, and the others are reported and the Lease released all the same
                    log.exception("could not report a dispatcher Stopped", extra=fields(dispatcher=name))

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
            progress=None if release else self._progress(),
        )
        body = lease_resource(capture)
        body["spec"]["acquireTime"] = self.acquire_time
        if release:
            body["spec"]["holderIdentity"] = ""
        if self.lease_rv:
            body["metadata"]["resourceVersion"] = self.lease_rv
        if self.lease_uid:
            body["metadata"]["uid"] = self.lease_uid
        return body

    def _held(self, answer: JSON) -> None:
        """Remember the version and the uid of the Lease as the API answered (the next write's preconditions)."""
        self.lease_rv = answer["metadata"]["resourceVersion"]
        self.lease_uid = answer["metadata"]["uid"]

    async def _register(self) -> bool:
        s = self.settings
        while not self.stop.is_set():
            try:
                if not await self._lease_allowed():
                    return False
                await self._ensure_capture()
                await self._end_shutdown_drain()
                await self._acquire_lease()
                self.last_renew = time.monotonic()
                log.info("registered", extra=fields(capture=s.name, lease=lease_name(s.name)))
                return True
            except (*API_ERRORS, LeaseLost) as exc:
                log.warning("registration failed; retrying", extra=fields(error=repr(exc)))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(s.renew_interval):
                        await self.stop.wait()
        return False

    # -- graceful shutdown: drain first ---------------------------------------------------------------------

    def request_stop(self) -> None:
        """SIGTERM/SIGINT. With ``drain_timeout`` and once registered: mark the Capture draining and wait (at
        most that long) for the maintainer to move its dispatchers off, then stop. A second signal, or none of
        that: stop at once (stop what runs, report it Stopped, release the Lease)."""
        if self.terminating or self.settings.drain_timeout <= 0 or not self.lease_rv or self.fence_reason:
            self.stop.set()
            return
        self.terminating = True
        self._drain_task = asyncio.create_task(self._drain_then_stop(), name="drain")

    def holding(self) -> list[str]:
        """The dispatchers this capture still holds: those it runs, those being deleted whose close has not
        finished (its finalizer is still on), and those assigned to it that are not closed (a Pending one the
        maintainer created before it saw the drain). A closed one not being deleted is no work of this
        capture's: the maintainer deletes it when it gets to it."""
        return sorted(set(self.runs) | {n for n, o in self.dispatchers.objects.items() if _unfinished(o)})

    async def _drain_then_stop(self) -> None:
        s = self.settings
        began = time.monotonic()
        try:
            try:
                await self._mark_draining()
            except API_ERRORS as exc:
                log.warning("could not mark the Capture draining; stopping now", extra=fields(error=repr(exc)))
                return
            log.info(
                "draining before exit: waiting for the maintainer to move the dispatchers off",
                extra=fields(capture=s.name, dispatchers=len(self.holding()), timeout=s.drain_timeout),
            )
            while time.monotonic() - began < s.drain_timeout and not self.stop.is_set():
                if not self.holding() and not await self._assigned():
                    log.info(
                        "drained: every dispatcher moved off",
                        extra=fields(capture=s.name, seconds=round(time.monotonic() - began, 3)),
                    )
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.1):
                        await self.stop.wait()
            left = self.holding()
            if left:
                log.warning(
                    "drain timed out; stopping the dispatchers still here (their spans are placed again)",
                    extra=fields(capture=s.name, dispatchers=len(left), timeout=s.drain_timeout),
                )
        finally:
            self.stop.set()

    async def _assigned(self) -> list[str]:
        """A consistent read (LIST without resourceVersion) of the Dispatchers assigned to this capture that it
        would still have to run or close: what its watch may not show yet (one the maintainer created just
        before it saw the drain). Unreadable: assume some are."""
        try:
            items, _ = await self.client.list(
                DISPATCHERS, self.settings.namespace, label_selector=f"{CAPTURE_LABEL}={self.settings.name}"
            )
        except API_ERRORS:
            return ["(unreadable)"]
        return [
            o["metadata"]["name"]
            for o in items
            if (o.get("spec") or {}).get("capture") == self.settings.name and _unfinished(o)
        ]

    async def _mark_draining(self) -> None:
        """``spec.draining: true`` on its own Capture, with the annotation that says the agent set it for its
        shutdown (so the next process of this capture clears it). A drain a person set already stays theirs."""
        current = await self.client.get(CAPTURES, self.settings.namespace, self.settings.name)
        if (current.get("spec") or {}).get("draining"):
            return
        await self._set_shutdown_drain(current, True)
        log.info("marked the Capture draining for shutdown", extra=fields(capture=self.settings.name))

    async def _set_shutdown_drain(self, current: JSON, on: bool) -> None:
        """``spec.draining`` and the shutdown annotation together, on the Capture as read (its resourceVersion)."""
        s = self.settings
        patch = {
            "metadata": {
                "resourceVersion": current["metadata"]["resourceVersion"],
                "annotations": {DRAIN_REASON_ANNOTATION: DRAIN_FOR_SHUTDOWN if on else None},
            },
            "spec": {"draining": on},
        }
        await self.client.patch(CAPTURES, s.namespace, s.name, patch)

    async def _end_shutdown_drain(self) -> None:
        """A previous process of this capture drained it for its shutdown: this one is new and empty, so the
        maintainer may place spans on it again (a person's drain, without the annotation, stays)."""
        current = await self.client.get(CAPTURES, self.settings.namespace, self.settings.name)
        annotations = (current.get("metadata") or {}).get("annotations") or {}
        if annotations.get(DRAIN_REASON_ANNOTATION) != DRAIN_FOR_SHUTDOWN:
            return
        await self._set_shutdown_drain(current, False)
        log.info("cleared the drain a previous process set for its shutdown", extra=fields(capture=self.settings.name))

    async def _lease_allowed(self) -> bool:
        """Whether this capture may read (hence renew) its own Lease. The chart's Role names the Leases of the
        StatefulSet's pods 0 .. capture.maxReplicas-1; a pod beyond them (``kubectl scale`` or an HPA past it)
        could create its Lease (a create cannot be limited by name) but never renew it, so its spans would be
        placed on it and lost again one lease duration later. It is refused before it registers, saying why."""
        s = self.settings
        name = lease_name(s.name)
        try:
            await self.client.get(LEASES, s.namespace, name)
        except ApiError as exc:
            if exc.status == 403:
                self.refused = (
                    f"this capture may not read its Lease {name} ({exc.message}). The chart's Role names the Leases "
                    "of capture pods 0 .. capture.maxReplicas-1 only: raise capture.maxReplicas (helm upgrade) "
                    "before scaling the StatefulSet beyond it"
                )
                log.error("refused: %s", self.refused, extra=fields(capture=s.name, lease=name))
                return False
            if not exc.not_found:
                raise
        return True

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
        self.lease_rv = self.lease_uid = ""
        try:
            out = await self.client.create(LEASES, s.namespace, self._lease_body())
            self._held(out)
            return
        except ApiError as exc:
            if not exc.already_exists:
                raise
        current = await self.client.get(LEASES, s.namespace, name)
        spec = current.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        if holder not in ("", s.name) and not _expired(spec):
            raise LeaseLost(f"Lease {name} is held by {holder!r} and has not expired")
        self.took_over_foreign = self.took_over_foreign or holder != s.name
        self._held(current)
        out = await self.client.replace(LEASES, s.namespace, name, self._lease_body())
        self._held(out)

    async def _renew(self) -> None:
        s = self.settings
        name = lease_name(s.name)
        for _ in range(2):
            try:
                out = await self.client.replace(LEASES, s.namespace, name, self._lease_body())
                self._held(out)
                return
            except ApiError as exc:
                if exc.not_found:  # (a Lease PUT that carries the uid meets a deleted Lease with 409, not 404)
                    raise LeaseLost(f"Lease {name} was deleted") from None
                if not exc.conflict:
                    raise
            try:
                current = await self.client.get(LEASES, s.namespace, name)
            except ApiError as exc:
                if exc.not_found:
                    raise LeaseLost(f"Lease {name} was deleted") from None
                raise
            if current["metadata"]["uid"] != self.lease_uid:
                raise LeaseLost(f"Lease {name} was deleted (and created again, uid {current['metadata']['uid']})")
            spec = current.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            if holder != s.name:
                raise LeaseLost(f"Lease {name} is now held by {holder!r}")
            if spec.get("acquireTime") != self.acquire_time:
                raise LeaseLost(f"Lease {name} was taken over by another process named {s.name!r}")
            # Our own write whose answer we missed (e.g. a timed-out request): adopt it and retry.
            self._held(current)
        raise ApiError(409, "Conflict", f"Lease {name} kept changing")

    async def _release_lease(self) -> None:
        s = self.settings
        await self.client.replace(LEASES, s.namespace, lease_name(s.name), self._lease_body(release=True))

    async def _renew_loop(self) -> None:
        s = self.settings
        timeout = min(s.renew_deadline / 2, max(1.0, s.renew_interval))
        failed = 0
        checking: asyncio.Task[None] | None = None
        try:
            while True:
                await asyncio.sleep(min(s.renew_interval, RETRY_AFTER_FAILURE) if failed else s.renew_interval)
                sent = time.monotonic()
                try:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
                    # arrives as the renewal fails (e.g. connection refused), and this loop would never end.
                    async with asyncio.timeout(timeout):
                        await self._renew()
                    self.last_renew = sent
                    failed = 0
                except LeaseLost as exc:
                    self._fence(str(exc))
                    return
                except API_ERRORS as exc:
                    failed += 1
                    if failed == 1 or failed % 20 == 0:  # an outage: say so, not twice a second
                        log.warning(
                            "Lease renewal failed",
                            extra=fields(
                                error=repr(exc),
                                since_renew=round(time.monotonic() - self.last_renew, 3),
                                attempts=failed,
                            ),
                        )
                    continue
                if self.paused_at is not None and (checking is None or checking.done()):
                    # What to resume is read beside the renewals, not within one renew deadline: with
                    # thousands of dispatchers on an overloaded API the reads can take longer than that
                    # (a capture then stayed paused for good), and a renewal landing meanwhile keeps
                    # vouching for the result (see _resume).
                    checking = asyncio.create_task(self._check_resume(self.paused_at), name="resume-check")
        finally:
            if checking is not None:
                checking.cancel()

    async def _check_resume(self, pause: float) -> None:
        try:
            async with asyncio.timeout(RESUME_CHECK_TIMEOUT):
                await self._resume(pause)
        except API_ERRORS as exc:  # stay paused; the next renewal tries again
            log.warning("could not check what to resume", extra=fields(error=repr(exc)))
        except Exception as exc:  # a bug: fail loudly, as any background task that ends does (see _run)
            self._fence(f"internal error: the resume check failed ({exc!r})")

    async def _watchdog(self) -> None:
        s = self.settings
        while True:
            late = time.monotonic() - self.last_renew
            if late > s.renew_deadline and self.paused_at is None:
                self._pause(
                    f"could not renew Lease {lease_name(s.name)} for {late:.1f}s "
                    f"(renew deadline {s.renew_deadline}s, lease duration {s.lease_duration}s)"
                )
            await asyncio.sleep(min(0.1, s.tick))

    def _pause(self, reason: str) -> None:
        """Stop delivering now, synchronously; keep every dispatcher and its position (see the module doc)."""
        self.paused_at = time.monotonic()
        at = {name: self.rt.pause(name) for name in sorted(self.runs)}
        log.warning(
            "paused: stopped delivering until the Lease is renewed",
            extra=fields(capture=self.settings.name, reason=reason, dispatchers=at),
        )

    async def _resume(self, pause: float) -> None:
        """A renewal just succeeded while paused (the pause that began at ``pause``): the Lease is still
        ours, so nothing was re-placed through it. Read (strongly) this capture's Dispatchers and the epochs
        of its changefeeds; then, if it is still that pause, not fenced, and the last renewal is younger than
        the renew deadline (renewals go on while it reads, and each one that lands proves the Lease was not
        taken), resume each paused dispatcher whose object still exists (same uid), is not being deleted,
        and whose changefeed published no epoch this capture had not seen; drop the others. Otherwise it
        stays paused, and the next renewal checks again."""
        s = self.settings
        items, _ = await self.client.list(DISPATCHERS, s.namespace, f"{CAPTURE_LABEL}={s.name}")
        current = {o["metadata"]["name"]: o for o in items if (o.get("spec") or {}).get("capture") == s.name}
        published: dict[str, int | None] = {}
        for cf in sorted({run.record.changefeed for run in self.runs.values()}):
            published[cf] = await self._read_epoch(cf, remember=False)
        if self.paused_at != pause or self.fence_reason:
            return  # resumed, fenced or paused again meanwhile
        if time.monotonic() - self.last_renew >= s.renew_deadline:
            return  # no renewal vouches for us now; wait for the next one
        resumed: list[str] = []
        dropped: dict[str, str] = {}
        for name, run in sorted(self.runs.items()):
            obj = current.get(name)
            meta = (obj or {}).get("metadata") or {}
            epoch = published.get(run.record.changefeed)
            if obj is None or meta.get("uid") != run.record.uid:
                dropped[name] = "its Dispatcher is gone"
            elif meta.get("deletionTimestamp"):
                continue  # stays paused: the close path closes it, reporting where it stopped
            elif epoch is None:
                dropped[name] = "its changefeed is gone"
            elif epoch > self.epochs_seen.get(run.record.changefeed, 0):
                dropped[name] = f"changefeed epoch {epoch} was published while it was paused"
            else:
                resumed.append(name)
        for cf, epoch in published.items():
            if epoch is not None:
                self.epochs_seen[cf] = max(self.epochs_seen.get(cf, 0), epoch)
        finals = {name: (self.runs.pop(name), self.rt.close(name)) for name in dropped}
        for name in resumed:
            self.rt.resume(name)
        paused_for = time.monotonic() - pause
        self.paused_at = None
        self.full_at = -1e9  # everything was skipped while paused: the next pass looks at everything
        log.info(
            "resumed: delivering again",
            extra=fields(resumed=resumed, dropped=dropped, paused_for=round(paused_for, 3)),
        )
        # Claimed before the first await: the loop runs beside this task, and would otherwise report a dropped
        # dispatcher Stopped itself, with the older checkpoint its object holds, and that write could land last
        # (test_a_new_maintainer_term_while_paused_starts_its_dispatchers_afresh failed 1 run in 6).
        reports = {n: rf for n, rf in finals.items() if n in current and n not in self.closing}
        for name in reports:
            self.disowned[name] = time.monotonic()
        for name, (run, final) in sorted(reports.items()):
            try:
                await self._write(run.record, DispatcherState.STOPPED, final, f"not resumed: {dropped[name]}")
            except API_ERRORS:
                self.disowned.pop(name, None)  # reported by the level-triggered loop (_disown) instead

    # -- the loop ---------------------------------------------------------------------------------------

    async def _main_loop(self) -> None:
        await self.dispatchers.synced.wait()
        await self.captures.synced.wait()
        if self.took_over_foreign:
            # Listed after the acquisition: everything assigned before it is here (and maybe a few after).
            self.inherited = set(self.dispatchers.objects)
            if self.inherited:
                log.info(
                    "took over a Lease that did not name this capture: its Pending dispatchers are reported "
                    "Stopped, not started",
                    extra=fields(dispatchers=len(self.inherited)),
                )
        log.info("watching dispatchers", extra=fields(selector=f"{CAPTURE_LABEL}={self.settings.name}"))
        while True:
            began = time.monotonic()
            await self.reconcile()
            await sleep_or(self.wake, self.settings.tick)
            rest = min(PASS_MIN_INTERVAL, self.settings.tick) - (time.monotonic() - began)
            if rest > 0:
                await asyncio.sleep(rest)

    async def reconcile(self) -> None:
        """One level-triggered pass over the assigned dispatchers.

        A full pass (every dispatcher) every ``FULL_PASS_INTERVAL``, after a resume and when the test hooks
        change; in between, a pass visits only what can have something to do: the Dispatchers whose objects
        changed since the last pass (the informer's ``dirty``), the runs not yet Working-and-written, the
        closes not finished, the steps that failed, and the runs of a Table whose traffic changed. At rest
        that is nothing, so a capture holding thousands of dispatchers costs a few operations per wake-up
        instead of one per dispatcher."""
        if self.fence_reason:
            raise Fenced(self.fence_reason)
        if self._read_hooks():
            self.full_at = -1e9
        paused = self.paused_at is not None
        if not paused:
            await self._refresh_rates()
        live = self.dispatchers.objects
        changed = self.dispatchers.take_dirty()
        now = time.monotonic()
        full = now - self.full_at >= FULL_PASS_INTERVAL
        if full:
            self.full_at = now
            names: set[str] = set(live)
            self.retry.clear()
            self.active = {n for n, r in self.runs.items() if not self._settled(r)}
            gone = set(self.runs) - names
            finished = (set(self.closing) | self.rejected | set(self.disowned)) - names
            self._noted = {n for n in self._noted if n[0] in live}
            self.broken = {n: b for n, b in self.broken.items() if n in live}
        else:
            names = changed | self.retry
            self.retry = set()
            names.update(self.active)
            names.update(n for n, c in self.closing.items() if not c.released)
            names.update(self.broken)
            gone = {n for n in changed if n not in live and n in self.runs}
            finished = {n for n in changed if n not in live}
            names = {n for n in names if n in live}  # not ``names & set(live)``: a copy of every name held
        if self.broken:  # not before their back-off, whatever else marks them
            names = {n for n in names if n not in self.broken or self.broken[n][1] <= now}
        # Copied: the steps await, and the informer keeps changing ``live`` meanwhile.
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
        epochs: Epochs = {}  # strong reads of this pass, shared by its steps
        gate = asyncio.Semaphore(STEP_CONCURRENCY)
        if not paused:
            await self._refresh_epochs(epochs)

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
                    self.retry.add(name)  # visited again next pass, not only at the next full one
                    log.warning("dispatcher step failed", extra=fields(dispatcher=name, error=repr(exc)))
                except Fenced:
                    raise
                except Exception:  # a bug: loud and counted, retried with back-off, the other dispatchers go on
                    self._step_error(name)
                else:
                    self.broken.pop(name, None)
            run = self.runs.get(name)
            if run is not None and not self._settled(run):
                self.active.add(name)
            else:
                self.active.discard(name)

        # Steps of different dispatchers are independent; their writes go out concurrently (a capture
        # with thousands of dispatchers must not report them one request at a time). A TaskGroup: if one
        # step finds the capture fenced, the others are cancelled at once.
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
            await self._report_capture()
        except API_ERRORS as exc:
            log.warning("Capture status write failed", extra=fields(error=repr(exc)))

    def _step_error(self, name: str) -> None:
        """Dispatcher ``name``'s step raised an unexpected error (called while handling it): log its traceback,
        count it, and put its next try off (``STEP_ERROR_BACKOFF``, doubling)."""
        failures = self.broken.get(name, (0, 0.0))[0] + 1
        delay = min(STEP_ERROR_BACKOFF * 2 ** min(failures - 1, 16), MAX_STEP_ERROR_BACKOFF)
        self.broken[name] = (failures, time.monotonic() + delay)
        self.step_errors += 1
        log.exception(
            "dispatcher step raised an unexpected error (a bug); trying it again later",
            extra=fields(dispatcher=name, attempts=failures, retry_in=delay, step_errors=self.step_errors),
        )

    @staticmethod
    def _settled(run: Run) -> bool:
        """Working, and its Working status written: nothing to do for it until its object changes (or the
        next full pass looks at its traffic)."""
        return run.state is DispatcherState.WORKING and run.written_state is DispatcherState.WORKING

    def _quiet(self, run: Run, raw: JSON, now: float) -> bool:
        """A Working dispatcher with nothing to write this pass (the common case at rest): skipped
        without a task or a conversion of its object, so that a pass over thousands stays cheap."""
        if not self._settled(run):
            return False
        if (raw.get("metadata") or {}).get("deletionTimestamp"):
            return False
        if (raw.get("status") or {}).get("state") != DispatcherState.WORKING.value:
            return False  # the API does not show what we wrote: _advance decides when to write again
        if run.traffic_at >= 0:
            return True  # its traffic moves only with its Table's, and that marks it (traffic_at < 0: _refresh_rates)
        run.traffic_at = now
        return not progress.traffic_changed(run.written_traffic, self._traffic(run.record.name))

    async def _step(self, d: Dispatcher, raw: JSON, epochs: Epochs) -> None:
        name = d.name
        if d.deleting:
            await self._close(d, raw)  # closing is always safe, paused or not
        elif self.paused_at is not None:
            return  # paused: nothing starts, nothing advances, nothing is reported
        elif name in self.runs:
            await self._advance(self.runs[name], d, epochs)
        elif d.state is DispatcherState.PENDING and name in self.inherited:
            await self._disown(d)
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
        if self.paused_at is not None:
            return  # paused while it read the epoch
        if not await self._read_source(d.changefeed):
            return
        if self.paused_at is not None:
            return  # paused while it read the Secrets
        self.rt.start(d)
        self.runs[d.name] = Run(d, DispatcherState.INITIALIZING)
        log.info(
            "started dispatcher",
            extra=fields(dispatcher=d.name, span=d.span, tableID=d.table_id, startTs=d.start_ts, epoch=d.epoch),
        )
        await self._report(self.runs[d.name], d)

    async def _read_source(self, changefeed: str) -> bool:
        """Before the first dispatcher of ``changefeed`` starts here: if it names a source and a sink, read
        their Secrets and configure the data plane with them. False (try again at a later pass) when a
        Secret is missing or incomplete. Credentials are never logged: only the Secrets' names."""
        if changefeed in self.sources_read:
            return True
        try:
            cf = changefeed_from_resource(await self.client.get(CHANGEFEEDS, self.settings.namespace, changefeed))
        except InvalidResource as exc:
            self._note(changefeed, "bad-changefeed", logging.WARNING, "unreadable changefeed", error=str(exc))
            return False
        if bool(cf.source_secret) != bool(cf.sink_secret):
            self._note(changefeed, "half-dataplane", logging.WARNING,
                       "the changefeed names a source without a sink or a sink without a source; waiting")  # fmt: skip
            return False
        if cf.source_secret:
            try:
                source = _secret_data(await self.client.get(SECRETS, self.settings.namespace, cf.source_secret))
                sink = _secret_data(await self.client.get(SECRETS, self.settings.namespace, cf.sink_secret))
            except ApiError as exc:
                if exc.status not in (403, 404):
                    raise
                self._note(changefeed, "no-secret", logging.WARNING, "cannot read the changefeed's Secrets; waiting",
                           source=cf.source_secret, sink=cf.sink_secret, status=exc.status)  # fmt: skip
                return False
            endpoints = tuple(e.strip() for e in source.get("endpoints", "").split(",") if e.strip())
            if not endpoints or not sink.get("dsn"):
                self._note(changefeed, "bad-secret", logging.WARNING,
                           "the source Secret needs endpoints and the sink Secret dsn; waiting",
                           source=cf.source_secret, sink=cf.sink_secret)  # fmt: skip
                return False
            problem = unsupported_endpoint(endpoints)
            if problem:
                self._note(changefeed, "unsupported-source", logging.WARNING, f"{problem}; waiting",
                           source=cf.source_secret)  # fmt: skip
                return False
            self.routed.configure(
                changefeed,
                Endpoints(endpoints, sink["dsn"], source.get("username") or None, source.get("password") or None),
            )
            log.info("changefeed replicates etcd to PostgreSQL",
                     extra=fields(changefeed=changefeed, source=cf.source_secret, sink=cf.sink_secret))  # fmt: skip
        self.sources_read.add(changefeed)
        return True

    async def _advance(self, run: Run, d: Dispatcher, epochs: Epochs) -> None:
        failure = self.routed.failed(d.name)
        if failure and not run.failure_written:
            run.failure_written = True
            log.error("dispatcher failed", extra=fields(dispatcher=d.name, reason=failure))
            await self._write(d, run.state, self.rt.checkpoint(d.name), f"{DISPATCHER_FAILED_PREFIX}{failure}")
            return
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
            if self.paused_at is not None:
                return  # paused while it read the epoch
            if epoch is not None:
                run.state = DispatcherState.WORKING
                log.info("dispatcher working", extra=fields(dispatcher=d.name, checkpointTs=cp))
        stale = time.monotonic() - run.written_at > 2 * self.settings.report_interval
        if run.written_state is run.state and d.state is not run.state and stale:
            # What we wrote is not what the API shows (a write lost, or overwritten): level-triggered, re-report.
            run.written_state = None
        await self._report(run, d)

    async def _report(self, run: Run, d: Dispatcher) -> None:
        """Write the status of a running dispatcher when its state changed, or its traffic materially.

        Not when only its checkpoint moved: that goes in the progress report on the Lease. Nothing while
        paused (without a Lease renewal the capture claims nothing)."""
        if self.paused_at is not None:
            return
        now = time.monotonic()
        due = run.written_state is not run.state or progress.traffic_changed(run.written_traffic, self._traffic(d.name))
        if not due:
            return
        young = now - run.started_at < self.settings.report_interval
        if run.written_state is None and run.state is DispatcherState.INITIALIZING and young:
            # Not yet: most dispatchers are Working within init_delay, and then the one write says so
            # (Pending -> Working). One still Initializing after report_interval is reported as such.
            return
        state = run.state
        cp = self.rt.checkpoint(d.name)
        traffic = self._traffic(d.name)
        await self._write(d, state, cp)
        run.written_state, run.written_at, run.written_traffic, run.traffic_at = state, now, traffic, now
        log.debug("reported", extra=fields(dispatcher=d.name, state=state.value, checkpointTs=cp))

    def _progress(self) -> progress.Progress:
        """The report for the Lease: Working dispatchers whose Working status has been written, per
        (changefeed, mode) (``progress.build``'s entries). The runtime's sink is flushed first: these
        checkpoints are delivered.

        At rest its cost does not grow with the dispatchers held: the groups (names, digest) are recomputed
        only when a run starts, stops or changes state, and the runtime gives each group's minimum at once
        when it can (``LogicalClockRuntime.low_watermark``); otherwise each run is asked."""
        at = (self.runs.version, Run.changes)
        if at != self._groups_at:
            members: dict[tuple[str, Mode], list[str]] = {}
            for name, run in self.runs.items():
                if run.state is DispatcherState.WORKING and run.written_state is DispatcherState.WORKING:
                    members.setdefault((run.record.changefeed, run.record.mode), []).append(name)
            self._groups = {
                key: Group(tuple(sorted(names)), progress.digest(self.runs[n].record.uid for n in names))
                for key, names in members.items()
            }
            self._groups_at = at
        entries = []
        fast = getattr(self.rt, "low_watermark", None)
        for (cf, mode), group in sorted(self._groups.items()):
            low = fast(group.names) if fast is not None else None
            if low is not None:
                entries.append(progress.ProgressEntry(
                    changefeed=cf, mode=mode, checkpoint_ts=low[0], dispatchers=len(group.names),
                    digest=group.digest, slowest=low[1],
                ))  # fmt: skip
                continue
            running = []
            for name in group.names:
                d = self.runs[name].record
                with contextlib.suppress(KeyError):
                    running.append(
                        progress.Running(d.uid, name, d.changefeed, d.mode, d.start_ts, self.rt.checkpoint(name))
                    )
            entries.extend(progress.build(running, self.incarnation, 0.0).entries)
        self.rt.flush()
        return progress.Progress(
            incarnation=self.incarnation, at=round_time(time.time()), entries=tuple(self._annotated(entries))
        )

    def _annotated(self, entries: list[progress.ProgressEntry]) -> Iterator[progress.ProgressEntry]:
        """Each entry with what the real runtime knows of it: the wall time its checkpoint stands for (where
        it counts in source revisions: ``checkpoint_time`` of the slowest dispatcher; a TSO's is its own
        physical part), and the sink's error while its transactions fail (``sink_error``)."""
        when = getattr(self.rt, "checkpoint_time", None)
        sink = getattr(self.rt, "sink_error", None)
        for e in entries:
            t, error = None, ""
            if e.slowest:
                with contextlib.suppress(KeyError):
                    t = when(e.slowest) if when is not None else None
                    error = sink(e.slowest) if sink is not None else ""
            if t is not None:
                e = replace(e, checkpoint_time=round(t, 3))
            if error:
                e = replace(e, sink_error=error[: progress.SINK_ERROR_LIMIT])
            yield e

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
        elif d.name in self.inherited and d.state is DispatcherState.PENDING:
            state, message = DispatcherState.STOPPED, "assigned before this process took over its Lease (not started)"
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
        # What the split and merge schedulers judge by.
        rate, regions = self._traffic(d.name) if state in LIVE_DISPATCHER_STATES else (0.0, 0)
        record = record.evolve(write_rate=rate, region_count=regions)
        self.rt.flush()  # the checkpoint written here must be delivered downstream first
        return await self.client.patch(DISPATCHERS, d.namespace, d.name, status_merge_patch(record), sub="status")

    def _traffic(self, name: str) -> tuple[float, int]:
        """Write rate and region count of a running dispatcher ((0, 0) if the runtime does not run it)."""
        try:
            return self.rt.write_rate(name), self.rt.region_count(name)
        except KeyError:
            return 0.0, 0

    async def _release_finalizer(self, obj: JSON) -> bool:
        """Remove our finalizer with a resourceVersion precondition, re-reading on conflict."""
        return await remove_finalizer(self.client, DISPATCHERS, self.settings.namespace, obj, DISPATCHER_FINALIZER)

    async def _epoch(self, changefeed: str, epochs: Epochs) -> int | None:
        """The changefeed's published epoch by a strong read (GET); ``None`` if it does not exist.

        One read per changefeed per pass, shared by the pass's concurrent steps."""
        if changefeed not in epochs:
            epochs[changefeed] = asyncio.ensure_future(self._read_epoch(changefeed))
        return await epochs[changefeed]

    async def _read_epoch(self, changefeed: str, remember: bool = True) -> int | None:
        try:
            obj = await self.client.get(CHANGEFEEDS, self.settings.namespace, changefeed)
        except ApiError as exc:
            if not exc.not_found:
                raise
            return None
        epoch = int((obj.get("status") or {}).get("epoch") or 0)
        if remember and self.paused_at is None:
            self.epochs_seen[changefeed] = max(self.epochs_seen.get(changefeed, 0), epoch)
        return epoch

    async def _refresh_epochs(self, epochs: Epochs) -> None:
        """Re-read, now and then, the published epoch of every changefeed it runs dispatchers of: what a paused
        dispatcher's resume is judged against (a term that began before the pause is no reason to drop it)."""
        if not self.runs or time.monotonic() - self.epochs_at < self.settings.tables_interval:
            return
        self.epochs_at = time.monotonic()
        if self._changefeeds[0] != self.runs.version:
            self._changefeeds = (self.runs.version, sorted({run.record.changefeed for run in self.runs.values()}))
        for cf in self._changefeeds[1]:
            try:
                await self._epoch(cf, epochs)
            except API_ERRORS as exc:
                log.warning("could not read the epoch of changefeed", extra=fields(changefeed=cf, error=repr(exc)))

    def _read_hooks(self) -> bool:
        """Read the test hooks from the Capture's annotations; whether they changed."""
        obj = self.captures.objects.get(self.settings.name) or {}
        annotations = (obj.get("metadata") or {}).get("annotations")
        hooks, problems = hooks_from_annotations(annotations)
        if not self.settings.test_hooks:
            if hooks != Hooks():
                problems = [f"{', '.join(disabled_hooks(annotations))}: ignored, test hooks are off (--test-hooks)"]
            hooks = Hooks()
        changed = hooks != self.hooks
        if changed:
            log.info("test hooks changed", extra=fields(hooks=hooks.describe()))
            self.hooks = hooks
        if tuple(problems) != self._hook_problems:
            self._hook_problems = tuple(problems)
            for problem in problems:
                log.warning("bad test hook annotation", extra=fields(problem=problem))
        return changed

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
        moved = {k for k in rates.keys() | self.rates.keys() if rates.get(k) != self.rates.get(k)}
        self.rates = rates
        if moved:
            # Their dispatchers' traffic may have moved enough to be written: the next pass looks at them.
            for name, run in self.runs.items():
                if (run.record.changefeed, run.record.table_id) in moved:
                    run.traffic_at = -1e9
                    self.active.add(name)

    async def _report_capture(self) -> None:
        """The Capture's status, for humans (liveness is the Lease): when it changes, at most once per
        ``report_interval`` (a count that moves with every dispatcher placed is not worth a write each), or
        every ``CAPTURE_STATUS_REFRESH`` seconds (in case someone overwrote it; rarely: it is a write at rest).
        A change held back is written by a later pass: there is one at least every ``tick``."""
        s = self.settings
        status = {"dispatchers": len(self.runs), "pod": s.pod or None, "address": s.address or None}
        now = time.monotonic()
        since = now - self.capture_status_at
        if status == self.capture_status and since < CAPTURE_STATUS_REFRESH:
            return
        if self.capture_status and since < s.report_interval:
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


def _secret_data(secret: JSON) -> dict[str, str]:
    """A Secret's ``data``, decoded (base64 -> text). Never logged."""
    out = {}
    for key, value in (secret.get("data") or {}).items():
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            out[str(key)] = base64.b64decode(str(value)).decode()
    return out


def _expired(lease_spec: JSON) -> bool:
    renew = lease_spec.get("renewTime")
    if not renew:
        return True
    try:
        return parse_time(str(renew)) + float(lease_spec.get("leaseDurationSeconds") or 0) < time.time()
    except ValueError:
        return True


_CLOSED = frozenset(st.value for st in CLOSED_DISPATCHER_STATES)


def _unfinished(obj: JSON) -> bool:
    """A Dispatcher its capture still has to run or close: being deleted (its finalizer still on), or not closed
    (a closed one not being deleted is the maintainer's to delete)."""
    return (
        bool((obj.get("metadata") or {}).get("deletionTimestamp"))
        or (obj.get("status") or {}).get("state") not in _CLOSED
    )


def install_signal_handlers(agent: Agent) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.request_stop)
