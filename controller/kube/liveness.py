"""Liveness from Leases: the Leases as the informer's watch shows them, how long each has stayed unchanged on *our*
clock, and from them each capture's record (a Capture with its Lease).

A capture is alive while the renewTime of its Lease keeps changing, whatever its clock says, and only time during
which our view of the Leases was current counts (``engine.liveness``: the informer's Lease stream drives ``view``).
An API outage is then nobody's silence. The member and changefeed Leases of the maintainers are read the same way
(``seen``, ``unchanged_for``: the balance policy and leader election).

A capture Lease that vanishes while it still names its capture (deleted by hand while the capture runs) is
remembered with its silence; one never seen is stood in for (``_missing``): the capture counts as holding it until a
lease duration passes unrenewed on our clock, never as released.

The store (``controller.kube.store``) owns one and hands it the Leases and Capture objects it admits (newer than
what it holds, not buried, not tombstoned).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from controller.engine.liveness import Silence, ViewClock
from controller.engine.shards import Seen
from controller.model import resources as conv
from controller.model.progress import PROGRESS_ANNOTATION, ProgressEntry
from controller.model.records import Capture

JSON = dict[str, Any]
LEASE = "Lease"
#: Seconds a Lease stream may stay quiet and still count as current (the maintainer's own renewals and
#: the captures' keep it busy every ~2 s while it leads).
LEASE_FRESH = 5.0
#: Lease names that are captures' (``capture-<name>``); the maintainers' own are ``cfm-<changefeed>``.
CAPTURE_LEASE_PREFIX = conv.lease_name("")
#: The renewTime of the stand-in for a capture Lease never seen (``LeaseLiveness._missing``): what counts is when it
#: was first missed, on our clock.
_EPOCH = "1970-01-01T00:00:00.000000Z"
_ABSENT = ("absent",)


def _report(lease: JSON | None) -> tuple[ProgressEntry, ...] | None:
    """The entries of the progress report a Lease carries (() if none; None if it does not parse). Only
    the entries matter to a decision, not when the report was made."""
    annotations = ((lease or {}).get("metadata") or {}).get("annotations") or {}
    text = annotations.get(PROGRESS_ANNOTATION) if isinstance(annotations, dict) else None
    if not text:
        return ()
    report = conv.progress_from_json(text)
    return None if report is None else report.entries


def _report_changefeeds(
    before: tuple[ProgressEntry, ...] | None, after: tuple[ProgressEntry, ...] | None
) -> set[str] | None:
    """The changefeeds whose entries differ between two reports (None, every changefeed, if one of them
    does not parse)."""
    if before is None or after is None:
        return None
    old = {(e.changefeed, e.mode): e for e in before}
    new = {(e.changefeed, e.mode): e for e in after}
    return {key[0] for key in old.keys() | new.keys() if old.get(key) != new.get(key)}


def _capture_of(lease_name: str) -> str:
    """The capture whose Lease ``lease_name`` is ("" for another Lease)."""
    return lease_name[len(CAPTURE_LEASE_PREFIX) :] if lease_name.startswith(CAPTURE_LEASE_PREFIX) else ""


class LeaseLiveness:
    """The Leases by name as last seen, their silence on our clock, and the captures' records computed with them."""

    def __init__(self, fresh: float = LEASE_FRESH) -> None:
        #: The Leases by name, as last seen (read-only here: they change through ``put``, ``remove``, ``replace``).
        self.objects: dict[str, JSON] = {}
        #: The health of our view of Leases (driven by the informer's Lease stream), on the monotonic clock.
        self.view = ViewClock(fresh=fresh)
        #: Per Lease: when its renewTime last changed, on ``view``.
        self.silence = Silence(self.view)
        #: Capture records as converted with their Lease (memo; ``renew_time`` is put on our clock on reads).
        self._memo: dict[str, Capture] = {}
        #: Per capture Lease that vanished while it named its capture (deleted by hand): the last object seen of
        #: it. Its silence is kept: the capture counts as holding it until a lease duration passes unrenewed
        #: (``_missing``).
        self._vanished: dict[str, JSON] = {}
        #: Capture Leases seen released (holder emptied) and then gone: nothing of their captures runs.
        self._let_go: set[str] = set()

    # -- the Leases in -------------------------------------------------------------------------------

    def put(self, obj: JSON) -> set[str] | None:
        """Lease ``obj`` arrived, newer than the one held. Returns which changefeeds' decisions could see a difference
        (``Store.last_change``'s convention; ``_observe``): none for a Lease that is not a capture's."""
        name = obj["metadata"]["name"]
        if self._vanished.pop(name, None) is not None:
            self.silence.forget(name)  # a new Lease (the capture's next process): seen for the first time
        self._let_go.discard(name)
        concerned = self._observe(obj, time.monotonic())
        self.objects[name] = obj
        capture = _capture_of(name)
        self._memo.pop(capture, None)
        return concerned if capture else set()

    def remove(self, name: str) -> set[str] | None:
        """Lease ``name`` is gone (deleted). Every changefeed (None) for a capture's, none for another."""
        self._gone(name, self.objects.pop(name, None))
        capture = _capture_of(name)
        self._memo.pop(capture, None)
        return None if capture else set()

    def replace(self, items: list[JSON]) -> None:
        """A LIST says ``items`` are every Lease there is."""
        before = self.objects
        self.objects = {o["metadata"]["name"]: o for o in items}
        now = time.monotonic()
        for gone in set(self.silence.seen) - set(self.objects) - set(self._vanished):
            self._gone(gone, before.get(gone))
        for name in set(self._vanished) & set(self.objects):
            del self._vanished[name]
        self._let_go -= set(self.objects)
        for o in items:
            self._observe(o, now)
        self._memo.clear()

    def capture_changed(self, name: str) -> None:
        """Capture object ``name`` changed or went: its record is converted again."""
        self._memo.pop(name, None)

    def captures_changed(self) -> None:
        """Every Capture object may have changed (a LIST): every record is converted again."""
        self._memo.clear()

    def _observe(self, obj: JSON, now: float) -> set[str] | None:
        """Liveness is judged on *our* clock, as client-go does: a capture is alive while the renewTime
        of its Lease keeps changing, whatever its clock says, and only time during which our view of the
        Leases was current counts (``engine.liveness``). Skew can then delay the verdict "lost" (after a
        restart, by one lease duration) but never make a live capture look lost.

        Returns which changefeeds' decisions could see a difference (``Store.last_change``'s convention): every
        one (None) for a new Lease, a new holder (a Lease taken or released: ``Capture.lease_taken``), a
        new duration, or a renewal of a Lease that had run out on our clock; the changefeeds named in the
        old or new progress report when the report changed (the checkpoint may move); none for a live
        capture's plain renewal (it only moves the time its Lease would run out, which
        ``Decision.next_due`` follows). ``now`` is monotonic."""
        name = obj["metadata"]["name"]
        spec = obj.get("spec") or {}
        renew = str(spec.get("renewTime") or "")
        old = self.objects.get(name)
        old_spec = (old or {}).get("spec") or {}
        silent = self.silence.of(name, now)
        concerned: set[str] | None = set()
        if (
            silent is None
            or old is None
            or old_spec.get("holderIdentity") != spec.get("holderIdentity")
            or old_spec.get("leaseDurationSeconds") != spec.get("leaseDurationSeconds")
        ):
            concerned = None
        elif str(old_spec.get("renewTime") or "") != renew:
            try:
                duration = float(spec.get("leaseDurationSeconds") or 0)
            except (TypeError, ValueError):
                duration = 0.0
            if silent >= duration:
                concerned = None  # it had run out on our clock: alive again
        if concerned is not None:
            before, after = _report(old), _report(obj)
            if before != after:
                concerned = _report_changefeeds(before, after)
        self.silence.observe(name, renew, now)
        return concerned

    def _gone(self, name: str, last: JSON | None) -> None:
        """Lease ``name`` is gone (deleted, or not named by a LIST). A capture's that still named its capture
        (deleted by hand while the capture runs) is remembered with its silence: that capture may deliver until
        its renew deadline, and its dispatchers may be released only once it could not have renewed for a lease
        duration, as for a Lease that lapsed. One it had released (its holder emptied at a graceful stop) is
        forgotten: that capture stopped everything first."""
        if last is None:
            return  # already gone (a second removal): as it was
        capture = name.removeprefix(CAPTURE_LEASE_PREFIX)
        if name.startswith(CAPTURE_LEASE_PREFIX) and capture:
            if (last.get("spec") or {}).get("holderIdentity") == capture:
                self._vanished[name] = last
                return
            self._let_go.add(name)
        self.silence.forget(name)

    def _missing(self, capture: str) -> JSON | None:
        """What stands for capture ``capture``'s Lease when there is none: the last one seen if it vanished while
        it named the capture, else (a Lease never seen: a maintainer started after it was deleted) one renewed
        when the capture was first seen without it, of the default duration. None when the Lease was released."""
        name = conv.lease_name(capture)
        last = self._vanished.get(name)
        if last is not None:
            return last
        if name in self._let_go:
            return None  # seen released, then gone: nothing of it runs
        self.silence.observe(name, _ABSENT, time.monotonic())
        self._vanished[name] = last = {
            "metadata": {"name": name},
            "spec": {
                "holderIdentity": capture,
                "leaseDurationSeconds": int(Capture(name=capture).lease_duration),
                "renewTime": _EPOCH,
            },
        }
        return last

    # -- the captures --------------------------------------------------------------------------------

    def capture(self, obj: JSON) -> Capture:
        """The Capture ``obj`` with its Lease; without one, with what stands for it (``_missing``), as a
        capture being deleted: never scheduled on, its dispatchers released only once that Lease ran out. Raises
        ``InvalidResource`` if the object does not convert."""
        name = obj["metadata"]["name"]
        lease = self.objects.get(conv.lease_name(name))
        if lease is not None:
            return self._capture(obj, lease)
        stand_in = self._missing(name)
        if stand_in is None:
            return self._capture(obj, None)
        return self._capture(obj, stand_in, memo=False).evolve(deleting=True)

    def _capture(self, obj: JSON, lease: JSON | None, memo: bool = True) -> Capture:
        """The Capture with its Lease, ``renew_time`` on our clock: now minus its silence as we count it.
        The conversion is kept (``memo``) until the Capture or its Lease changes; the clock is read on every
        call, since silence grows with time."""
        name = obj["metadata"]["name"]
        rec = self._memo.get(name) if memo else None
        if rec is None:
            rec = conv.capture_from_resources(obj, lease)
            if memo:
                self._memo[name] = rec
        silent = self.silence.of(conv.lease_name(rec.name), time.monotonic()) if lease is not None else None
        if silent is not None and rec.renew_time is not None:
            rec = rec.evolve(renew_time=time.time() - silent)
        return rec

    def captures(self, records: dict[str, Capture], objects: Collection[str]) -> dict[str, Capture]:
        """``records`` (every Capture object's record with its Lease), plus a record for each capture Lease whose
        Capture object is gone (marked deleting: never scheduled on, but its Lease still says whether its
        dispatchers may run). ``objects``: the names of every Capture object, valid or not (an invalid one's Lease
        is ignored with it)."""
        out = dict(records)
        for lease_name, lease in self.objects.items():
            name = lease_name.removeprefix(CAPTURE_LEASE_PREFIX)
            if not lease_name.startswith(CAPTURE_LEASE_PREFIX) or not name or name in out:
                continue
            if name in objects:
                continue  # an invalid Capture object: ignored like any invalid object
            meta = {"name": name}
            if lease["metadata"].get("namespace"):
                meta["namespace"] = lease["metadata"]["namespace"]
            stub = {"kind": "Capture", "metadata": meta}
            try:
                out[name] = self._capture(stub, lease, memo=False).evolve(deleting=True)
            except conv.InvalidResource:
                continue
        # A capture whose Capture object and Lease are both gone, the Lease while it named the capture (deleted by
        # hand in either order): its process may still run until its renew deadline, so what stood for its Lease
        # still says when its dispatchers may go. Forgotten ten lease durations after it ran out.
        for lease_name, last in list(self._vanished.items()):
            name = lease_name.removeprefix(CAPTURE_LEASE_PREFIX)
            if name in out or name in objects:
                continue
            try:
                rec = self._capture({"kind": "Capture", "metadata": {"name": name}}, last, memo=False)
            except conv.InvalidResource:
                continue
            if rec.renew_time is None or time.time() > rec.renew_time + 11 * rec.lease_duration:
                del self._vanished[lease_name]
                self.silence.forget(lease_name)
                continue
            out[name] = rec.evolve(deleting=True)
        return out

    # -- the Leases, typed ---------------------------------------------------------------------------

    def seen(self, name: str, now: float) -> Seen | None:
        """Lease ``name`` as our watch shows it (``shards.Seen``: holder, duration, how long it has been seen
        unchanged on our clock, transitions), or None if there is none. ``now`` is monotonic."""
        lease = self.objects.get(name)
        if lease is None:
            return None
        spec = lease.get("spec") or {}
        try:
            duration = float(spec.get("leaseDurationSeconds") or 0)
        except (TypeError, ValueError):
            duration = 0.0
        try:
            transitions = int(spec.get("leaseTransitions") or 0)
        except (TypeError, ValueError):
            transitions = 0
        return Seen(str(spec.get("holderIdentity") or ""), duration, self.silence.of(name, now), transitions)

    def names(self, prefix: str) -> list[str]:
        """The names of the Leases held that start with ``prefix``."""
        return [n for n in self.objects if n.startswith(prefix)]

    def uid(self, name: str) -> str:
        """The uid of Lease ``name`` as held ("" if none)."""
        return str(((self.objects.get(name) or {}).get("metadata") or {}).get("uid") or "")

    def unchanged_for(self, name: str, holder: str, renew: str, now: float) -> float:
        """How long our watch has seen Lease ``name`` unchanged with ``holder`` and ``renew`` (its renewTime as
        written): 0 if it shows another holder or renewal. Counted on our clock, only while our view of Leases was
        current (``silence``). ``now`` is monotonic."""
        spec = (self.objects.get(name) or {}).get("spec") or {}
        if str(spec.get("holderIdentity") or "") != holder or str(spec.get("renewTime") or "") != renew:
            return 0.0
        return self.silence.of(name, now) or 0.0
