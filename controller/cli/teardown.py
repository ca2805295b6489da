"""A forced teardown: what finishes deleting a Changefeed when no maintainer and no capture is left. Pure.

The maintainer's teardown (``controller/engine/teardown.py``) is what normally ends a Changefeed's deletion;
its finalizers exist so that replication stops before the objects go. With every maintainer and capture of
the namespace gone (``helm uninstall``, pods SIGKILLed, a namespace being deleted after its processes were
killed; a maintainer stopped *with* its namespace releases them itself, ``controller.kube.namespace``),
nobody is left to honour them and ``kubectl delete`` waits for ever. This module decides, from one reading
of the namespace, whether that is the case and what releasing them takes:

* **Proof that nothing runs.** No maintainer leads the changefeed (its Lease ``cfm-<changefeed>`` names
  nobody, or was not renewed for its duration), and no capture that holds a Dispatcher of it is alive (its
  Lease ``capture-<name>`` names nobody, or was not renewed for its duration). Liveness is judged on this
  machine's clock, as ``kubectl changefeed status`` judges it (a clock far ahead makes a live process look
  lapsed: the fences below keep even that safe).
* **Fences.** Every lapsed Lease that still names its holder is taken first (holder cleared, with the
  resourceVersion read as precondition), as the maintainer takes a lost capture's: a paused process that
  reaches the API again then finds its Lease gone and can never resume, so the proof stays true. A renewal
  that lands in between makes the take fail (409): the command stops and says so.
* **Releases.** Each Dispatcher of the changefeed is deleted and its finalizer removed; each Table of it
  still holding the maintainer's finalizer is detached (status ``Detached``, no spans counted, as the
  maintainer's teardown writes it) and released; then the Changefeed's finalizer goes. What the Changefeed
  owns (Spans, SpanOperators, the Lease, Dispatchers) the garbage collector removes once it is gone.

Refused: a Changefeed that is not being deleted (delete it first: this command finishes a deletion, it does
not start one), and one whose maintainer or any of whose captures still runs (they finish it themselves;
``--wait`` waits for that or for their Leases to lapse).

**A namespace being deleted** marks its Changefeeds for deletion itself, but not at once: its namespace
controller comes a few seconds after the namespace's DELETE (about 5 s on a v1.36 cluster). So
``teardown --wait`` right after ``kubectl delete namespace`` finds the namespace Terminating and its
Changefeeds not yet marked: it waits until every one of them (or the ``-c`` one) is marked
(:func:`awaiting_marks`), then tears down as usual. A namespace that is not being deleted never marks
anything: there, as without ``--wait``, a Changefeed not being deleted is refused at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controller.engine.teardown import detached
from controller.model import resources as conv
from controller.model.records import Table
from controller.model.states import CHANGEFEED_FINALIZER, DISPATCHER_FINALIZER, TABLE_FINALIZER

JSON = dict[str, Any]

#: The Lease of the maintainer that leads a changefeed (``controller.maintainer.runner``).
MAINTAINER_LEASE_PREFIX = "cfm-"
#: Who a fence names as the Lease's holder: nobody (as the maintainer's fence of a lost capture).
NOBODY = ""


def maintainer_lease_name(changefeed: str) -> str:
    return f"{MAINTAINER_LEASE_PREFIX}{changefeed}"[:253]


@dataclass(frozen=True)
class LeaseState:
    """A Lease as this one-shot reading judges it."""

    name: str
    holder: str
    #: Seconds since its last renewal (None: never renewed), on this machine's clock.
    age: float | None
    duration: float
    version: str

    @property
    def current(self) -> bool:
        return bool(self.holder) and self.age is not None and self.age < self.duration

    @property
    def lapsed_but_held(self) -> bool:
        return bool(self.holder) and not self.current


def lease_state(obj: Mapping[str, Any], now: float) -> LeaseState:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    renew = spec.get("renewTime") or spec.get("acquireTime")
    age: float | None = None
    if isinstance(renew, str):
        try:
            age = now - conv.parse_time(renew)
        except ValueError:
            age = None
    return LeaseState(
        name=str(meta.get("name", "")),
        holder=str(spec.get("holderIdentity") or ""),
        age=age,
        duration=float(spec.get("leaseDurationSeconds") or 0),
        version=str(meta.get("resourceVersion", "")),
    )


@dataclass(frozen=True)
class Plan:
    changefeed: str
    #: Why the teardown cannot be forced now (empty: it can).
    blockers: tuple[str, ...] = ()
    #: Leases to take (name, resourceVersion read): lapsed, but still naming their holder.
    fences: tuple[LeaseState, ...] = ()
    #: Dispatchers to delete and release (name, uid, deleting).
    dispatchers: tuple[tuple[str, str, bool], ...] = ()
    #: Tables to detach and release (name, deleting).
    tables: tuple[tuple[str, bool], ...] = ()
    #: Whether the Changefeed still carries the teardown finalizer.
    release_changefeed: bool = False


def not_being_deleted(name: str) -> str:
    return (
        f"changefeed {name} is not being deleted: this command only finishes a deletion "
        f"(kubectl delete changefeed {name} --wait=false, then run it again)"
    )


def awaiting_marks(changefeeds: list[JSON], wanted: str | None, namespace: Mapping[str, Any] | None) -> str:
    """What a ``--wait`` teardown waits for before anything else ("" for nothing): in a namespace being deleted
    (``namespace``, the Namespace as read; None if it could not be read), the Changefeeds (``wanted``, else every
    one) that its namespace controller has not yet marked for deletion."""
    if not namespace or not (namespace.get("metadata") or {}).get("deletionTimestamp"):
        return ""
    unmarked = sorted(
        _name(c)
        for c in changefeeds
        if not (c.get("metadata") or {}).get("deletionTimestamp") and (wanted is None or _name(c) == wanted)
    )
    if not unmarked:
        return ""
    what = f"changefeed {unmarked[0]}" if len(unmarked) == 1 else "changefeeds " + ", ".join(unmarked)
    return (
        f"namespace {_name(namespace)} is being deleted; its namespace controller has not yet marked {what} "
        "for deletion"
    )


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def _of(obj: Mapping[str, Any], changefeed: str) -> bool:
    """``obj`` belongs to ``changefeed``: its spec says so, or (a spec that does not) its label."""
    spec = obj.get("spec") or {}
    if isinstance(spec, Mapping) and spec.get("changefeed") is not None:
        return spec.get("changefeed") == changefeed
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(conv.CHANGEFEED_LABEL) == changefeed


def describe_age(lease: LeaseState) -> str:
    return "never renewed" if lease.age is None else f"renewed {max(lease.age, 0.0):.0f}s ago"


def plan(
    changefeed: Mapping[str, Any],
    dispatchers: list[JSON],
    tables: list[JSON],
    leases: list[JSON],
    now: float,
) -> Plan:
    """What a forced teardown of ``changefeed`` (a raw Changefeed) must do, or why it must not."""
    name = _name(changefeed)
    meta = changefeed.get("metadata") or {}
    if not meta.get("deletionTimestamp"):
        return Plan(name, blockers=(not_being_deleted(name),))
    by_name = {_name(lease): lease_state(lease, now) for lease in leases}
    blockers: list[str] = []
    fences: dict[str, LeaseState] = {}

    def judge(lease: LeaseState | None, what: str) -> None:
        if lease is None or not lease.holder:
            return
        if lease.current:
            blockers.append(
                f"{what} is alive (Lease {lease.name} held by {lease.holder}, {describe_age(lease)}, "
                f"duration {lease.duration:g}s)"
            )
        else:
            fences[lease.name] = lease

    judge(by_name.get(maintainer_lease_name(name)), f"the maintainer of changefeed {name}")
    mine = sorted((d for d in dispatchers if _of(d, name)), key=_name)
    held: dict[str, int] = {}
    for d in mine:
        capture = str((d.get("spec") or {}).get("capture") or "")
        if capture:
            held[capture] = held.get(capture, 0) + 1
    for capture, count in sorted(held.items()):
        judge(by_name.get(conv.lease_name(capture)), f"capture {capture}, which holds {count} dispatcher(s) of it,")
    if blockers:
        return Plan(name, blockers=tuple(blockers))

    out_dispatchers = tuple(
        (
            _name(d),
            str((d.get("metadata") or {}).get("uid", "")),
            bool((d.get("metadata") or {}).get("deletionTimestamp")),
        )
        for d in mine
    )
    out_tables = tuple(
        (_name(t), bool((t.get("metadata") or {}).get("deletionTimestamp")))
        for t in sorted(tables, key=_name)
        if _of(t, name) and TABLE_FINALIZER in ((t.get("metadata") or {}).get("finalizers") or [])
    )
    return Plan(
        name,
        fences=tuple(fences[k] for k in sorted(fences)),
        dispatchers=out_dispatchers,
        tables=out_tables,
        release_changefeed=CHANGEFEED_FINALIZER in (meta.get("finalizers") or []),
    )


def fenced_lease(lease: Mapping[str, Any]) -> JSON:
    """The body that takes ``lease``: holder cleared, its resourceVersion kept (the precondition)."""
    return {**lease, "spec": {**(lease.get("spec") or {}), "holderIdentity": NOBODY}}


def detached_status(table: Mapping[str, Any]) -> JSON:
    """The status merge patch that detaches raw ``table``, as the maintainer's teardown writes it."""
    try:
        record = conv.from_resource(dict(table))
    except conv.InvalidResource:  # a Table the maintainer could not read either: its status all the same
        spec = table.get("spec") or {}
        record = Table(name=_name(table), changefeed=str(spec.get("changefeed", "")), table_id=0)
    assert isinstance(record, Table)
    return {"status": {k: v for k, v in conv.status_merge_patch(detached(record))["status"].items() if v is not None}}


FINALIZERS = {"dispatchers": DISPATCHER_FINALIZER, "tables": TABLE_FINALIZER, "changefeeds": CHANGEFEED_FINALIZER}
