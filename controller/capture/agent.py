"""The capture agent: one worker process that hosts dispatchers and proves it is alive through a Lease.

It is a few parts with one job each, wired here (the shape of controller-runtime's manager and its runnables):

```
 LeaseKeeper (lease_keeper.py)   the Lease capture-<name>: acquire, renew (carrying the report), pause at the renew
        |                        deadline, resume, fence; others read its Standing as a LeaseView
 Reconciler (reconciler.py)      the Dispatchers (ObjectInformer, controller/kube/objects.py): start, advance,
        |                        report, close, disown; epochs (epochs.py), traffic (traffic.py), sources (sources.py)
 Reporter (reporter.py)          the progress report each renewal carries
 Drainer (drainer.py)            SIGTERM with --drain-timeout: the spans moved off before it exits
 CaptureObject (registration.py) the Capture object: made, drained for a shutdown, its status
 Runs (runs.py)                  the dispatchers this process runs: the one record the parts share
```

Each part is built with what it needs, in an order that gives it: the Lease keeper's standing (``Standing``, which
the others read as a ``LeaseView``) first, the keeper last, with the reconciler it pauses and resumes.

The dispatchers run in a ``RoutedRuntime`` (controller/capture/routed.py): those of a changefeed that names a source
and a sink replicate etcd into that sink (controller/capture/dataplane.py), the others run the logical clock. A
background task that ends is an internal error: the agent fences itself (every dispatcher stopped, exit
``EXIT_FENCED``) and the supervisor restarts the process, which re-derives everything from the API. SIGTERM stops
every dispatcher, reports them Stopped and releases the Lease (after a drain, with ``--drain-timeout``). See
docs/architecture.md, "Capture agent".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass

from controller.capture.dataplane import DataplaneRuntime
from controller.capture.drainer import Drainer
from controller.capture.epochs import Epochs
from controller.capture.lease_keeper import API_ERRORS, LeaseKeeper, Standing
from controller.capture.ledger import Ledger
from controller.capture.logs import Notes, fields
from controller.capture.reconciler import Reconciler
from controller.capture.registration import CaptureObject
from controller.capture.reporter import Reporter
from controller.capture.routed import RoutedRuntime
from controller.capture.runs import Run, Runs
from controller.capture.runtime import DispatcherRuntime, LogicalClockRuntime
from controller.capture.sources import Sources
from controller.capture.traffic import TableRates
from controller.capture.troubles import Troubles
from controller.kube.client import RESOURCES, Client
from controller.kube.lease import LeaseLost
from controller.kube.objects import ObjectInformer
from controller.kube.probes import ProbeServer, parse_endpoint
from controller.model.resources import CAPTURE_LABEL, lease_name
from controller.model.states import DispatcherState, Kind
from controller.process import tenure

log = logging.getLogger("controller.capture")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_FENCED = 3


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
    #: Seconds between tenure steps (controller/process/tenure.py: what survived leaves the collector's full
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


class Agent:
    def __init__(self, client: Client, settings: Settings, runtime: DispatcherRuntime | None = None) -> None:
        self.client = client
        self.settings = s = settings
        #: This process: a report of another incarnation is about dispatchers this process does not run.
        self.incarnation = uuid.uuid4().hex[:8]
        self.stop = asyncio.Event()
        self.wake = asyncio.Event()
        self.runs = Runs()
        self.rates = TableRates(client, s.namespace, s.tables_interval)
        #: Paused, fenced, renewed when: the Lease keeper's to change, read by the parts built before it.
        standing = Standing()
        self.ledger: Ledger | None = None
        if runtime is None:
            if s.ledger_dir:
                self.ledger = Ledger(s.ledger_dir, s.name, self.incarnation)
            runtime = LogicalClockRuntime(
                init_delay=s.init_delay,
                rate_of=self.rates.of,
                deliver_until=lambda: standing.last_renew + s.renew_deadline,
                sink=self.ledger,
            )
        #: Dispatchers of a changefeed with a source and a sink run in the real data plane, configured from its
        #: Secrets before the first starts (``sources.Sources``); the others in ``runtime``.
        self.troubles = Troubles()
        self.routed = RoutedRuntime(runtime, DataplaneRuntime(troubles=self.troubles, wake=self.wake))
        self.reporter = Reporter(self.runs, self.routed, self.incarnation, self.troubles)
        self.sources = Sources(client, s.namespace, self.routed, self.troubles)
        self.capture = CaptureObject(client, s.namespace, s.name, pod=s.pod, address=s.address)
        self.dispatchers = ObjectInformer(
            client,
            RESOURCES[Kind.DISPATCHER],
            s.namespace,
            label_selector=f"{CAPTURE_LABEL}={s.name}",
            keep=lambda o: (o.get("spec") or {}).get("capture") == s.name,
            changed=self.wake,
            logger=log,
        )
        # The client has no fieldSelector: watch the namespace's Captures (few) and keep our own.
        self.captures = ObjectInformer(
            client,
            RESOURCES[Kind.CAPTURE],
            s.namespace,
            keep=lambda o: o.get("metadata", {}).get("name") == s.name,
            changed=self.wake,
            logger=log,
        )
        notes = Notes(log)
        self.epochs = Epochs(client, s.namespace, s.tables_interval, paused=lambda: standing.paused_at is not None)
        self.reconciler = Reconciler(
            client,
            s.namespace,
            s.name,
            runs=self.runs,
            runtime=self.routed,
            lease=standing,
            epochs=self.epochs,
            rates=self.rates,
            sources=self.sources,
            capture=self.capture,
            dispatchers=self.dispatchers,
            captures=self.captures,
            notes=notes,
            tick=s.tick,
            report_interval=s.report_interval,
            test_hooks=s.test_hooks,
        )
        self.keeper = LeaseKeeper(
            client,
            s.namespace,
            s.name,
            duration=s.lease_duration,
            renew_interval=s.renew_interval,
            renew_deadline=s.renew_deadline,
            tick=s.tick,
            standing=standing,
            dispatchers=self.reconciler,
            report=self.reporter.progress,
            fence=self._fenced,
        )
        self.drainer = Drainer(client, self.capture, self.runs, self.dispatchers, self.stop, s.drain_timeout)
        self.tenure = tenure.Tenure(s.gc_tenure) if s.gc_tenure > 0 else None
        #: A SIGTERM asked it to stop: it is draining (``drain_timeout``), then sets ``stop``.
        self.terminating = False
        self._drain_task: asyncio.Task[None] | None = None

    # -- process ---------------------------------------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        """Readiness: registered, its Lease renewed within the deadline, its Dispatchers and Capture listed."""
        keeper = self.keeper
        if keeper.fence_reason:
            return False, f"fenced: {keeper.fence_reason}"
        if not keeper.held:
            return False, "registering (Capture and Lease)"
        if keeper.paused_at is not None:
            return False, f"paused for {time.monotonic() - keeper.paused_at:.0f}s: the Lease cannot be renewed"
        since = time.monotonic() - keeper.last_renew
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
            return EXIT_ERROR if self.keeper.refused else EXIT_OK  # refused its Lease, or stopped before it registered
        tasks = {
            asyncio.create_task(self.dispatchers.run(), name="watch-dispatchers"),
            asyncio.create_task(self.captures.run(), name="watch-capture"),
            asyncio.create_task(self.keeper.renew_loop(), name="renew-lease"),
            asyncio.create_task(self.keeper.watchdog(), name="watchdog"),
            asyncio.create_task(self.reconciler.run(self.wake, self.keeper.took_over_foreign), name="main-loop"),
            asyncio.create_task(self.sources.run(self.stop), name="reload-secrets"),
        }
        if self.tenure is not None:
            tasks.add(asyncio.create_task(self.tenure.run(), name="gc-tenure"))
        stopper = asyncio.create_task(self.stop.wait(), name="stop")
        try:
            done, _ = await asyncio.wait({stopper, *tasks}, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopper}:
                # A background task must never end: a dead watch would leave a zombie agent. Fail loudly; the
                # supervisor restarts the process, which re-derives everything from the API.
                exc = task.exception() if not task.cancelled() else None
                self.keeper.fence(f"internal error: task {task.get_name()} ended ({exc!r})")
        finally:
            for task in (*tasks, stopper):
                task.cancel()
            await asyncio.gather(*tasks, stopper, return_exceptions=True)
        if self.keeper.fence_reason:
            return EXIT_FENCED
        await self._shutdown()
        return EXIT_OK

    def _fenced(self, reason: str) -> None:
        """The Lease keeper fenced this capture: stop every dispatcher now, synchronously, and exit non-zero."""
        stopped = {name: final for name, (_, final) in self._stop_all().items()}
        log.error(
            "fenced itself: stopped all dispatchers and exiting",
            extra=fields(capture=self.settings.name, reason=reason, stopped=stopped),
        )
        self.stop.set()

    def _stop_all(self) -> dict[str, tuple[Run, int]]:
        """Stop every dispatcher now, synchronously: name -> (its run, its final checkpoint)."""
        finals: dict[str, tuple[Run, int]] = {}
        for name in sorted(self.runs):
            run = self.runs.pop(name)
            if run is not None:
                with contextlib.suppress(KeyError):
                    finals[name] = (run, self.routed.close(name))
        return finals

    async def _shutdown(self) -> None:
        """SIGTERM: stop dispatchers, report them Stopped, then release the Lease.

        Releasing (holderIdentity "", leaseDurationSeconds 1, client-go's ReleaseOnCancel convention) rather than
        letting the Lease expire: every dispatcher of this process is already stopped, so there is nothing to fence,
        and the maintainer sees the capture gone within a second instead of a whole lease duration, and re-places
        whatever the Stopped reports below did not cover. The Lease is released last, so no one acts on this
        capture's absence while a dispatcher still runs."""
        finals = self._stop_all()
        log.info("stopping", extra=fields(capture=self.settings.name, dispatchers=sorted(finals)))

        async def report() -> None:
            for name, (run, final) in finals.items():
                try:
                    await self.reconciler.status.write(
                        run.record, DispatcherState.STOPPED, final, "capture agent stopped"
                    )
                except API_ERRORS:
                    pass  # the maintainer sees the Lease released (below) and places the spans again
                except Exception:  # a bug: said, and the others are reported and the Lease released all the same
                    log.exception("could not report a dispatcher Stopped", extra=fields(dispatcher=name))

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(report(), timeout=3.0)
        try:
            await asyncio.wait_for(self.keeper.release(), timeout=2.0)
            log.info("released the Lease", extra=fields(lease=lease_name(self.settings.name)))
        except (*API_ERRORS, LeaseLost) as exc:
            log.warning("could not release the Lease; it will expire", extra=fields(error=repr(exc)))

    async def _register(self) -> bool:
        s = self.settings
        while not self.stop.is_set():
            try:
                if not await self.keeper.allowed():
                    return False
                await self.capture.ensure()
                await self.capture.end_shutdown_drain()
                await self.keeper.acquire()
                log.info("registered", extra=fields(capture=s.name, lease=lease_name(s.name)))
                return True
            except (*API_ERRORS, LeaseLost) as exc:
                log.warning("registration failed; retrying", extra=fields(error=repr(exc)))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(s.renew_interval):
                        await self.stop.wait()
        return False

    def request_stop(self) -> None:
        """SIGTERM/SIGINT. With ``drain_timeout`` and once registered: drain first (``Drainer``), then stop. A second
        signal, or none of that: stop at once (stop what runs, report it Stopped, release the Lease)."""
        keeper = self.keeper
        if self.terminating or self.settings.drain_timeout <= 0 or not keeper.held or keeper.fence_reason:
            self.stop.set()
            return
        self.terminating = True
        self._drain_task = asyncio.create_task(self.drainer.drain_then_stop(), name="drain")


def install_signal_handlers(agent: Agent) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.request_stop)
