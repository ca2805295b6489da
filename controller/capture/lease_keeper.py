"""The capture's Lease ``capture-<name>``: acquired, renewed, released; and what its renewals say about this process.

* **Held with the one Lease protocol** (``controller.kube.lease.renew``): each renewal is a compare-and-swap on the
  Lease as last answered (its resourceVersion and uid). A Lease deleted, created again (another uid), held by
  someone else or taken over by another process of the same name (``acquireTime`` names this process) is lost:
  the capture fences itself (stops every dispatcher and exits ``EXIT_FENCED``). The maintainer treats the capture as
  alive while ``renewTime + leaseDurationSeconds`` is in the future, and takes a lapsed Lease (holder cleared)
  before it lets anyone else replicate this capture's spans: so a renewal that succeeds proves nothing was taken.
* **Pause, then resume or fence.** If no renewal succeeded for ``renew_deadline`` (< the lease duration) the keeper
  pauses the dispatchers (every dispatcher stops delivering at once, keeping its position): by the time the
  maintainer could call the capture lost, nothing runs here. The check runs in its own task on a short tick, so a
  hung API call cannot delay it. Once a renewal succeeds while paused, the dispatchers' part reads what may resume
  (beside the renewals: the reads may outlast a renew deadline), and if the same pause still holds, nothing fenced,
  and a renewal younger than the renew deadline still vouches for it, resumes them. An API outage shorter than the
  maintainer's patience costs no dispatcher anything but the pause (docs/architecture.md, Fencing).
* **Each renewal carries the progress report** (``controller.model.progress``): how far the Working dispatchers
  got, per (changefeed, mode), so that at rest a capture costs the API one write per renew interval.

Its standing (paused, fenced, renewed when) is a ``Standing``, made before the parts that read it and given to them as
a ``LeaseView`` (the runtime's delivery deadline, the epochs, the reconciler); only the keeper changes it. So the
keeper is built last, with the part it pauses and resumes (``Dispatchers``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from controller.capture.logs import fields
from controller.kube.client import JSON, LEASES, TRANSPORT_ERRORS, ApiError, Client
from controller.kube.lease import LeaseLost, renew
from controller.model import progress
from controller.model.records import Capture
from controller.model.resources import format_time, lease_name, lease_resource, parse_time, round_time

log = logging.getLogger("controller.capture")

#: Seconds between renewal attempts after one failed (an API that comes back is seen at once).
RETRY_AFTER_FAILURE = 0.5
#: At most this long to read what a paused capture may resume (then it tries again after a renewal).
RESUME_CHECK_TIMEOUT = 120.0
API_ERRORS = (ApiError, *TRANSPORT_ERRORS)


class LeaseView(Protocol):
    """What the other parts read of the Lease keeper."""

    @property
    def paused_at(self) -> float | None:
        """When delivery paused because the Lease could not be renewed (monotonic); None while delivering."""

    @property
    def fence_reason(self) -> str:
        """Why this capture fenced itself ("" if it did not)."""

    @property
    def last_renew(self) -> float:
        """When the last successful renewal was sent (monotonic)."""


@dataclass
class Standing:
    """The capture's standing as its Lease keeper judges it (a ``LeaseView``): changed by the keeper alone, read by the
    others through ``LeaseView`` (which has no setters)."""

    #: When delivery paused because the Lease could not be renewed (monotonic); None while delivering.
    paused_at: float | None = None
    #: Why this capture fenced itself ("" if it did not).
    fence_reason: str = ""
    #: When the last successful renewal was sent (monotonic).
    last_renew: float = 0.0


class Dispatchers(Protocol):
    """What the keeper asks of the part that runs the dispatchers (``reconciler.Reconciler``)."""

    def pause_all(self, reason: str) -> None: ...

    async def resume_plan(self, pause: float) -> Any: ...

    def resume(self, plan: Any) -> None: ...

    async def report_dropped(self, plan: Any) -> None: ...


def _expired(lease_spec: JSON) -> bool:
    renewed = lease_spec.get("renewTime")
    if not renewed:
        return True
    try:
        return parse_time(str(renewed)) + float(lease_spec.get("leaseDurationSeconds") or 0) < time.time()
    except ValueError:
        return True


class LeaseKeeper:
    def __init__(
        self,
        client: Client,
        namespace: str,
        name: str,
        *,
        duration: int,
        renew_interval: float,
        renew_deadline: float,
        tick: float,
        standing: Standing,
        dispatchers: Dispatchers,
        report: Callable[[], progress.Progress],
        fence: Callable[[str], None],
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.lease_name = lease_name(name)
        self.duration = duration
        self.renew_interval = renew_interval
        self.renew_deadline = renew_deadline
        self.tick = tick
        #: The progress report each renewal carries.
        self.report = report
        #: Stop everything and exit (the agent's): called once, when the Lease is lost.
        self._on_fence = fence
        #: What it judges of the Lease, which the others read (``LeaseView``).
        self.standing = standing
        #: The part that runs the dispatchers: paused, and resumed when a renewal vouches for it.
        self.dispatchers = dispatchers
        #: The Lease as last answered (its resourceVersion and uid: the next write's preconditions); None before it
        #: was acquired.
        self.lease: JSON | None = None
        #: Why this capture may not run here at all (its Lease is forbidden to it): it exits 1 without registering.
        self.refused = ""
        #: The Lease this process took over did not name this capture (released by a previous process, or taken by a
        #: maintainer after it lapsed): the maintainer may be releasing what was assigned before, on the strength of
        #: that Lease (``Reconciler.inherit``).
        self.took_over_foreign = False
        #: This process's hold on its Lease: the ``acquireTime`` it wrote. A renewal refused whose Lease still
        #: carries it was our own write (its answer lost); any other means the Lease is not ours.
        self.acquire_time = format_time(time.time(), micro=True)

    # -- LeaseView ------------------------------------------------------------------------------------------

    @property
    def paused_at(self) -> float | None:
        return self.standing.paused_at

    @property
    def fence_reason(self) -> str:
        return self.standing.fence_reason

    @property
    def last_renew(self) -> float:
        return self.standing.last_renew

    @property
    def held(self) -> bool:
        return self.lease is not None

    def fence(self, reason: str) -> None:
        """Lost (or an internal error): say why, once, and let the agent stop everything now."""
        if self.standing.fence_reason:
            return
        self.standing.fence_reason = reason
        self._on_fence(reason)

    # -- the Lease's body ---------------------------------------------------------------------------------

    def _content(self, *, release: bool = False) -> tuple[JSON, JSON]:
        """The spec and the annotations of a write."""
        capture = Capture(
            name=self.name,
            namespace=self.namespace,
            renew_time=round_time(time.time()),
            lease_duration=float(1 if release else self.duration),
            progress=None if release else self.report(),
        )
        body = lease_resource(capture)
        spec = {**body["spec"], "acquireTime": self.acquire_time}
        if release:
            spec["holderIdentity"] = ""
        return spec, body["metadata"].get("annotations") or {}

    def _mine(self, current: JSON) -> str:
        spec = current.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        if holder != self.name:
            return f"is now held by {holder!r}"
        if spec.get("acquireTime") != self.acquire_time:
            return f"was taken over by another process named {self.name!r}"
        return ""

    # -- registration ---------------------------------------------------------------------------------------

    async def allowed(self) -> bool:
        """Whether this capture may read (hence renew) its own Lease. The chart's Role names the Leases of the
        StatefulSet's pods 0 .. capture.maxReplicas-1; a pod beyond them (``kubectl scale`` or an HPA past it) could
        create its Lease (a create cannot be limited by name) but never renew it, so its spans would be placed on it
        and lost again one lease duration later. It is refused before it registers, saying why."""
        try:
            await self.client.get(LEASES, self.namespace, self.lease_name)
        except ApiError as exc:
            if exc.status == 403:
                self.refused = (
                    f"this capture may not read its Lease {self.lease_name} ({exc.message}). The chart's Role names "
                    "the Leases of capture pods 0 .. capture.maxReplicas-1 only: raise capture.maxReplicas (helm "
                    "upgrade) before scaling the StatefulSet beyond it"
                )
                log.error("refused: %s", self.refused, extra=fields(capture=self.name, lease=self.lease_name))
                return False
            if not exc.not_found:
                raise
        return True

    async def acquire(self) -> None:
        """Create the Lease, or take it over if it names this capture, nobody, or a holder whose Lease expired."""
        self.lease = None
        spec, annotations = self._content()
        body: JSON = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.lease_name, "namespace": self.namespace, "annotations": annotations},
            "spec": spec,
        }
        try:
            self.lease = await self.client.create(LEASES, self.namespace, body)
        except ApiError as exc:
            if not exc.already_exists:
                raise
        else:
            self.standing.last_renew = time.monotonic()
            return
        current = await self.client.get(LEASES, self.namespace, self.lease_name)
        holder = (current.get("spec") or {}).get("holderIdentity") or ""
        if holder not in ("", self.name) and not _expired(current.get("spec") or {}):
            raise LeaseLost(f"Lease {self.lease_name} is held by {holder!r} and has not expired")
        self.took_over_foreign = self.took_over_foreign or holder != self.name
        spec, annotations = self._content()
        taken = {**current, "spec": spec, "metadata": {**current["metadata"], "annotations": annotations}}
        self.lease = await self.client.replace(LEASES, self.namespace, self.lease_name, taken)
        self.standing.last_renew = time.monotonic()

    async def renew_once(self) -> None:
        """One renewal (``kube.lease.renew``); ``LeaseLost`` when the Lease is not ours any more."""
        assert self.lease is not None
        spec, annotations = self._content()
        self.lease = await renew(self.client, self.namespace, self.lease, spec, self._mine, annotations=annotations)

    async def release(self) -> None:
        """Holder cleared and duration 1 s (client-go's ReleaseOnCancel): the maintainer sees the capture gone within
        a second, not a lease duration. Only once every dispatcher here has stopped."""
        if self.lease is None:
            return
        spec, annotations = self._content(release=True)
        body = {**self.lease, "spec": spec, "metadata": {**self.lease["metadata"], "annotations": annotations}}
        await self.client.replace(LEASES, self.namespace, self.lease_name, body)

    # -- renewals, pause and resume ----------------------------------------------------------------------

    async def renew_loop(self) -> None:
        timeout = min(self.renew_deadline / 2, max(1.0, self.renew_interval))
        failed = 0
        checking: asyncio.Task[None] | None = None
        try:
            while True:
                await asyncio.sleep(min(self.renew_interval, RETRY_AFTER_FAILURE) if failed else self.renew_interval)
                sent = time.monotonic()
                try:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that arrives as
                    # the renewal fails (e.g. connection refused), and this loop would never end.
                    async with asyncio.timeout(timeout):
                        await self.renew_once()
                    self.standing.last_renew = sent
                    failed = 0
                except LeaseLost as exc:
                    self.fence(str(exc))
                    return
                except API_ERRORS as exc:
                    failed += 1
                    if failed == 1 or failed % 20 == 0:  # an outage: say so, not twice a second
                        log.warning(
                            "Lease renewal failed",
                            extra=fields(
                                error=repr(exc),
                                since_renew=round(time.monotonic() - self.standing.last_renew, 3),
                                attempts=failed,
                            ),
                        )
                    continue
                if self.standing.paused_at is not None and (checking is None or checking.done()):
                    # What to resume is read beside the renewals, not within one renew deadline: with thousands of
                    # dispatchers on an overloaded API the reads can take longer than that (a capture then stayed
                    # paused for good), and a renewal landing meanwhile keeps vouching for the result.
                    checking = asyncio.create_task(self._check_resume(self.standing.paused_at), name="resume-check")
        finally:
            if checking is not None:
                checking.cancel()

    async def watchdog(self) -> None:
        while True:
            late = time.monotonic() - self.standing.last_renew
            if late > self.renew_deadline and self.standing.paused_at is None:
                self._pause(
                    f"could not renew Lease {self.lease_name} for {late:.1f}s "
                    f"(renew deadline {self.renew_deadline}s, lease duration {self.duration}s)"
                )
            await asyncio.sleep(min(0.1, self.tick))

    def _pause(self, reason: str) -> None:
        """Stop delivering now, synchronously; every dispatcher keeps its position."""
        self.standing.paused_at = time.monotonic()
        self.dispatchers.pause_all(reason)

    async def _check_resume(self, pause: float) -> None:
        """A renewal just succeeded while paused (the pause that began at ``pause``): the Lease is still ours, so
        nothing was re-placed through it. Ask what may resume; if it is still that pause, nothing fenced, and the last
        renewal is younger than the renew deadline (renewals go on while it reads, and each one that lands proves the
        Lease was not taken), resume; otherwise stay paused, and the next renewal checks again."""
        dispatchers = self.dispatchers
        try:
            async with asyncio.timeout(RESUME_CHECK_TIMEOUT):
                plan = await dispatchers.resume_plan(pause)
                if self.standing.paused_at != pause or self.standing.fence_reason:
                    return  # resumed, fenced or paused again meanwhile
                if time.monotonic() - self.standing.last_renew >= self.renew_deadline:
                    return  # no renewal vouches for us now; wait for the next one
                dispatchers.resume(plan)
                self.standing.paused_at = None
                await dispatchers.report_dropped(plan)
        except API_ERRORS as exc:  # stay paused; the next renewal tries again
            log.warning("could not check what to resume", extra=fields(error=repr(exc)))
        except Exception as exc:  # a bug: fail loudly, as any background task that ends does (see Agent.run)
            self.fence(f"internal error: the resume check failed ({exc!r})")
