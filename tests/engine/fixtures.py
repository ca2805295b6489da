"""Fixtures for the engine's unit tests: record builders, a World builder, a Decision flattener, and a tiny
in-memory applier (the API server plus captures) to drive several decisions in a row.

Conventions: the changefeed is ``cf`` at epoch ``EPOCH`` held by ``IDENTITY`` (so ``decide`` does not start by
publishing the epoch); ``memory()`` is already bootstrapped unless asked otherwise; captures are alive when their
Lease was renewed at ``NOW`` and lost when it lapsed long ago; tables carry the maintainer's finalizer already.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from controller.engine import intents as I
from controller.engine.index import Index
from controller.engine.maintainer import Decision, Memory, decide
from controller.engine.teardown import left_behind
from controller.engine.world import World
from controller.model.keys import KeyRange
from controller.model.records import (
    Capture,
    Changefeed,
    Condition,
    Dispatcher,
    Join,
    Origin,
    Record,
    SchedulerConfig,
    Span,
    SpanOperator,
    Table,
    Target,
)
from controller.model.states import (
    CHANGEFEED_FINALIZER,
    DISPATCHER_FINALIZER,
    TABLE_FINALIZER,
    DispatcherState,
    Kind,
    Mode,
    OpPhase,
    OpSource,
    OpType,
    SpanState,
    Stage,
)

NOW = 1000.0
EPOCH = 3
IDENTITY = "m1"
CF = "cf"

__all__ = [
    "CF",
    "EPOCH",
    "IDENTITY",
    "NOW",
    "Origin",
    "Store",
    "Target",
    "capture",
    "changefeed",
    "dispatcher",
    "flat",
    "memory",
    "operator",
    "pieces",
    "span",
    "table",
    "trange",
    "world",
]


# -- records ---------------------------------------------------------------------------------------


def changefeed(**kw: object) -> Changefeed:
    base: dict[str, object] = dict(
        name=CF,
        uid="uid-cf",
        resource_version="1",
        start_ts=100,
        epoch=EPOCH,
        holder=IDENTITY,
        checkpoint_ts=100,
        finalizers=(CHANGEFEED_FINALIZER,),  # a live changefeed carries the teardown finalizer
    )
    base.update(kw)
    return Changefeed(**base)  # type: ignore[arg-type]


def memory(epoch: int = EPOCH, identity: str = IDENTITY, bootstrapped: bool = True) -> Memory:
    return Memory(epoch=epoch, identity=identity, bootstrapped=bootstrapped)


def capture(name: str, alive: bool = True, draining: bool = False, taken: bool | None = None) -> Capture:
    """A capture; a lost one (``alive=False``) has had its Lease taken unless ``taken=False`` (it lapsed,
    still naming the capture: the maintainer must take it before releasing anything)."""
    return Capture(
        name=name,
        uid=f"uid-{name}",
        resource_version="1",
        draining=draining,
        renew_time=NOW if alive else NOW - 1000.0,
        lease_duration=15.0,
        lease_taken=(not alive) if taken is None else taken,
        lease_version=f"lease-{name}-1",
    )


def trange(table_id: int) -> KeyRange:
    return KeyRange.of_table(table_id)


def pieces(table_id: int, n: int) -> tuple[KeyRange, ...]:
    """Table ``table_id``'s range cut into ``n`` even pieces, in key order."""
    rng = trange(table_id)
    return rng.split_at(rng.even_split_keys(n)) if n > 1 else (rng,)


def table(table_id: int, name: str = "", **kw: object) -> Table:
    name = name or f"t{table_id}"
    base: dict[str, object] = dict(
        name=name,
        uid=f"uid-{name}",
        resource_version="1",
        changefeed=CF,
        table_id=table_id,
        finalizers=(TABLE_FINALIZER,),
        state="Active",
    )
    base.update(kw)
    return Table(**base)  # type: ignore[arg-type]


def span(
    name: str,
    table_id: int = 1,
    key_range: KeyRange | None = None,
    state: SpanState | None = SpanState.REPLICATING,
    capture: str = "",
    dispatcher: str = "",
    checkpoint_ts: int = 100,
    **kw: object,
) -> Span:
    base: dict[str, object] = dict(
        name=name,
        uid=f"uid-{name}",
        resource_version="5",
        changefeed=CF,
        table_id=table_id,
        key_range=key_range or trange(table_id),
        start_ts=100,
        state=state,
        capture=capture,
        dispatcher=dispatcher,
        checkpoint_ts=checkpoint_ts,
        created=NOW - 100,
    )
    base.update(kw)
    return Span(**base)  # type: ignore[arg-type]


def dispatcher(
    name: str,
    sp: Span,
    capture: str,
    state: DispatcherState = DispatcherState.WORKING,
    checkpoint_ts: int = 100,
    **kw: object,
) -> Dispatcher:
    base: dict[str, object] = dict(
        name=name,
        uid=f"uid-{name}",
        resource_version="7",
        changefeed=CF,
        span=sp.name,
        table_id=sp.table_id,
        mode=sp.mode,
        key_range=sp.key_range,
        capture=capture,
        start_ts=100,
        epoch=EPOCH,
        state=state,
        checkpoint_ts=checkpoint_ts,
        finalizers=(DISPATCHER_FINALIZER,),
        created=NOW - 50,
    )
    base.update(kw)
    return Dispatcher(**base)  # type: ignore[arg-type]


def operator(
    name: str,
    type_: OpType,
    spans: tuple[str, ...],
    phase: OpPhase = OpPhase.PENDING,
    stage: Stage = Stage.NONE,
    **kw: object,
) -> SpanOperator:
    base: dict[str, object] = dict(
        name=name,
        uid=f"uid-{name}",
        resource_version="9",
        changefeed=CF,
        type=type_,
        spans=spans,
        phase=phase,
        stage=stage,
        source=OpSource.USER,
        created=NOW - 10,
        epoch=EPOCH if phase is not OpPhase.PENDING else 0,
    )
    base.update(kw)
    return SpanOperator(**base)  # type: ignore[arg-type]


def world(*records: Record, now: float = NOW, cf: Changefeed | None = None, joined: bool = True) -> World:
    """``joined``: the Changefeed records every live table with no span yet as joining (what the decision before
    this one wrote, engine/tables.py), so that its first spans can be created now."""
    by: dict[Kind, dict[str, Record]] = {k: {} for k in Kind}
    feed = cf or changefeed()
    for r in records:
        if isinstance(r, Changefeed):
            feed = r
            continue
        by[r.kind][r.name] = r
    if joined:
        with_spans = {getattr(s, "table_id", None) for s in by[Kind.SPAN].values()}
        new = [
            Join(table=t.name, uid=t.uid, start_ts=max(feed.checkpoint_ts, feed.start_ts, t.start_ts))
            for t in by[Kind.TABLE].values()
            if isinstance(t, Table)
            and not t.deleting
            and t.table_id not in with_spans
            and all(j.table != t.name for j in feed.joining)
        ]
        feed = replace(feed, joining=(*feed.joining, *new))
    return World(
        now=now,
        changefeed=feed,
        tables=by[Kind.TABLE],  # type: ignore[arg-type]
        spans=by[Kind.SPAN],  # type: ignore[arg-type]
        dispatchers=by[Kind.DISPATCHER],  # type: ignore[arg-type]
        operators=by[Kind.OPERATOR],  # type: ignore[arg-type]
        captures=by[Kind.CAPTURE],  # type: ignore[arg-type]
    )


def indexed_world(cf: Changefeed, records: Iterable[Record], captures: Iterable[Capture], now: float = NOW) -> World:
    """A world with the engine's Index of ``cf``'s records (what an incremental decision reads)."""
    index = Index.build(cf.name, [cf, *records])
    return World(
        now=now,
        changefeed=cf,
        tables=index.tables,
        spans=index.spans,
        dispatchers=index.dispatchers,
        operators=index.operators,
        captures={c.name: c for c in captures},
        index=index,
    )


# -- decisions -------------------------------------------------------------------------------------

BOOKKEEPING = (Kind.CHANGEFEED, Kind.TABLE)


def flat(decision: Decision, keep_bookkeeping: bool = False) -> list[tuple[str, ...]]:
    """Every write of ``decision`` as a short tuple, chains in order.

    ``("create"|"status"|"delete"|"unfinalize"|"finalize", kind, name)`` or ``("event", kind, name, reason)``.
    Status writes on the Changefeed and Tables (counts, checkpoint) and the CaptureLost Events that
    go with the Changefeed's status are left out unless asked for (test_schedulers.py checks those).
    """
    out: list[tuple[str, ...]] = []
    for chain in decision.chains:
        for w in chain.writes:
            t = describe(w)
            if not keep_bookkeeping and t[0] == "status" and t[1] in BOOKKEEPING:
                continue
            if not keep_bookkeeping and t[0] == "event" and t[-1] == "CaptureLost":
                continue
            out.append(t)
    return out


def describe(w: I.Write) -> tuple[str, ...]:
    if isinstance(w, I.Create):
        return ("create", w.obj.kind.value, w.obj.name)
    if isinstance(w, I.WriteStatus):
        return ("status", w.obj.kind.value, w.obj.name)
    if isinstance(w, I.Delete):
        return ("delete", w.kind.value, w.name)
    if isinstance(w, I.RemoveFinalizer):
        return ("unfinalize", w.kind.value, w.name)
    if isinstance(w, I.AddFinalizer):
        return ("finalize", w.kind.value, w.name)
    if isinstance(w, I.FenceCapture):
        return ("fence", "Capture", w.capture)
    if isinstance(w, I.ConfirmNoneLeft):
        return ("confirm", "Changefeed", w.changefeed)
    if isinstance(w, I.ConfirmPresent):
        return ("confirm", w.kind.value, w.name)
    if isinstance(w, I.ConfirmGone):
        return ("confirm-gone", w.kind.value, w.name)
    return ("event", w.kind.value, w.name, w.reason)


def writes(decision: Decision) -> list[I.Write]:
    return [w for c in decision.chains for w in c.writes]


def statuses(decision: Decision, kind: Kind, name: str) -> list[Record]:
    """The records written by status writes on ``kind``/``name``, in order."""
    return [
        w.obj for w in writes(decision) if isinstance(w, I.WriteStatus) and w.obj.kind is kind and w.obj.name == name
    ]


def last_status(decision: Decision, kind: Kind, name: str) -> Record:
    found = statuses(decision, kind, name)
    assert found, f"no status write on {kind} {name}: {flat(decision)}"
    return found[-1]


def created(decision: Decision, kind: Kind) -> list[Record]:
    return [w.obj for w in writes(decision) if isinstance(w, I.Create) and w.obj.kind is kind]


def chain_of(decision: Decision, kind: Kind, name: str) -> list[tuple[str, ...]]:
    """The flattened chain containing the first write about ``kind``/``name``."""
    for chain in decision.chains:
        for w in chain.writes:
            d = describe(w)
            if d[1] == kind.value and d[2] == name:
                return [describe(x) for x in chain.writes]
    raise AssertionError(f"no chain about {kind} {name}")


# -- an in-memory API server and captures ---------------------------------------------------------


@dataclass
class Store:
    """A minimal API server and capture runtime (like /tmp/smoke/smoke.py), deterministic."""

    now: float = NOW
    objects: dict[tuple[Kind, str], Record] = field(default_factory=dict)
    rv: itertools.count = field(default_factory=lambda: itertools.count(100))
    events: list[tuple[str, str, str]] = field(default_factory=list)
    #: captures whose Lease is no longer renewed (the others renew at every step)
    lost: set[str] = field(default_factory=set)
    #: check resourceVersion preconditions on status writes
    strict: bool = False
    #: chains aborted by a 404 or 409
    aborted: int = 0

    def put(self, obj: Record) -> Record:
        obj = replace(obj, resource_version=str(next(self.rv)), uid=obj.uid or f"uid-{obj.name}")
        self.objects[(obj.kind, obj.name)] = obj
        return obj

    def add(self, *objs: Record) -> None:
        for o in objs:
            self.put(o)

    def get(self, kind: Kind, name: str) -> Record | None:
        return self.objects.get((kind, name))

    def of(self, kind: Kind) -> dict[str, Record]:
        return {n: o for (k, n), o in self.objects.items() if k is kind}

    @property
    def changefeed(self) -> Changefeed:
        cf = self.objects[(Kind.CHANGEFEED, CF)]
        assert isinstance(cf, Changefeed)
        return cf

    def world(self) -> World:
        return World(
            now=self.now,
            changefeed=self.changefeed,
            tables=self.of(Kind.TABLE),  # type: ignore[arg-type]
            spans=self.of(Kind.SPAN),  # type: ignore[arg-type]
            dispatchers=self.of(Kind.DISPATCHER),  # type: ignore[arg-type]
            operators=self.of(Kind.OPERATOR),  # type: ignore[arg-type]
            captures=self.of(Kind.CAPTURE),  # type: ignore[arg-type]
        )

    def apply(self, decision: Decision) -> list[Dispatcher]:
        """Apply every chain; returns the dispatchers created."""
        made: list[Dispatcher] = []
        for chain in decision.chains:
            made.extend(self.apply_chain(chain))
        return made

    def apply_chain(self, chain: I.Chain, limit: int | None = None) -> list[Dispatcher]:
        """Apply ``chain`` (its first ``limit`` writes). With ``strict``, status writes carry resourceVersion
        preconditions as the API server checks them (409 aborts the rest of the chain); an object written
        earlier in the chain is checked against the version that write returned."""
        made: list[Dispatcher] = []
        local: dict[tuple[Kind, str], str] = {}
        for w in chain.writes[:limit]:
            if isinstance(w, I.Create):
                key = (w.obj.kind, w.obj.name)
                if key in self.objects:
                    local[key] = "<already-existed>"
                    continue
                local[key] = self.put(replace(w.obj, created=self.now)).resource_version
                if isinstance(w.obj, Dispatcher):
                    made.append(w.obj)
            elif isinstance(w, I.WriteStatus):
                key = (w.obj.kind, w.obj.name)
                cur = self.get(*key)
                if cur is None:
                    self.aborted += 1
                    return made  # 404 aborts the chain
                if self.strict and cur.resource_version != local.get(key, w.obj.resource_version):
                    self.aborted += 1
                    return made  # 409 aborts the chain
                local[key] = self.put(cur.with_status_of(w.obj)).resource_version
            elif isinstance(w, I.Delete):
                cur = self.get(w.kind, w.name)
                if cur is None or (w.uid and cur.uid != w.uid):
                    continue
                if cur.finalizers:
                    local[(w.kind, w.name)] = self.put(replace(cur, deleting=True)).resource_version
                else:
                    del self.objects[(w.kind, w.name)]
            elif isinstance(w, I.RemoveFinalizer):
                cur = self.get(w.kind, w.name)
                if cur is None:
                    continue
                cur = replace(cur, finalizers=tuple(f for f in cur.finalizers if f != w.finalizer))
                if cur.deleting and not cur.finalizers:
                    del self.objects[(w.kind, w.name)]
                else:
                    local[(w.kind, w.name)] = self.put(cur).resource_version
            elif isinstance(w, I.AddFinalizer):
                cur = self.get(w.kind, w.name)
                if cur is not None and w.finalizer not in cur.finalizers:
                    self.put(replace(cur, finalizers=(*cur.finalizers, w.finalizer)))
            elif isinstance(w, I.FenceCapture):
                cur = self.get(Kind.CAPTURE, w.capture)
                if cur is None or not isinstance(cur, Capture):
                    continue
                if cur.lease_version != w.lease_version:
                    self.aborted += 1
                    return made  # the Lease changed since the decision's view: 409 aborts the chain
                self.put(replace(cur, lease_taken=True, lease_version=f"lease-{w.capture}-taken-{next(self.rv)}"))
            elif isinstance(w, I.Event):
                self.events.append((w.name, w.reason, w.message))
            elif isinstance(w, I.ConfirmNoneLeft) and left_behind(self.objects.values(), w.changefeed):
                self.aborted += 1
                return made  # the consistent read found something: the chain stops
            elif isinstance(w, I.ConfirmPresent) and getattr(self.get(w.kind, w.name), "uid", None) != w.uid:
                self.aborted += 1
                return made  # what the chain rests on is gone: it stops
            elif (
                isinstance(w, I.ConfirmGone)
                and (found := self.get(w.kind, w.name)) is not None
                and (not w.uid or found.uid == w.uid)
            ):
                self.aborted += 1
                return made  # what the chain concludes was deleted is there: it stops
        return made

    def captures_step(self, progress: int = 10) -> None:
        """Every live capture moves its dispatchers one step (create, work, close, refuse stale epochs)."""
        epoch = self.changefeed.epoch
        for (k, n), c in list(self.objects.items()):
            if k is Kind.CAPTURE and n not in self.lost:
                renewed = replace(c, renew_time=self.now, lease_version=f"lease-{n}-{self.now}")  # type: ignore[call-arg]
                self.objects[(k, n)] = renewed
        for (k, n), d in list(self.objects.items()):
            if k is not Kind.DISPATCHER:
                continue
            assert isinstance(d, Dispatcher)
            cap = self.get(Kind.CAPTURE, d.capture)
            if cap is None or not cap.alive(self.now):  # type: ignore[union-attr]
                continue  # a lost capture does nothing
            if d.deleting:
                if d.state not in (DispatcherState.STOPPED, DispatcherState.REJECTED):
                    self.put(replace(d, state=DispatcherState.STOPPED))
                else:
                    del self.objects[(k, n)]
                continue
            if d.state is DispatcherState.PENDING:
                if d.epoch < epoch:
                    self.put(replace(d, state=DispatcherState.REJECTED))
                else:
                    self.put(replace(d, state=DispatcherState.INITIALIZING, checkpoint_ts=d.start_ts))
            elif d.state is DispatcherState.INITIALIZING:
                self.put(replace(d, state=DispatcherState.WORKING))
            elif d.state is DispatcherState.WORKING:
                self.put(replace(d, checkpoint_ts=d.checkpoint_ts + progress))

    def live_dispatchers(self) -> list[Dispatcher]:
        out = []
        for d in self.of(Kind.DISPATCHER).values():
            assert isinstance(d, Dispatcher)
            cap = self.get(Kind.CAPTURE, d.capture)
            if d.state in (DispatcherState.INITIALIZING, DispatcherState.WORKING) and cap and cap.alive(self.now):  # type: ignore[union-attr]
                out.append(d)
        return out

    def step(self, mem: Memory) -> tuple[Decision, Memory]:
        dec = decide(self.world(), mem)
        self.apply(dec)
        self.captures_step()
        self.now += 0.5
        return dec, dec.memory


def by_state(records: Iterable[Record], state: object) -> list[Record]:
    return [r for r in records if getattr(r, "state", None) == state]


__all__ += ["BOOKKEEPING", "by_state", "chain_of", "created", "describe", "last_status", "statuses", "writes"]
__all__ += ["DispatcherState", "Kind", "Mode", "OpPhase", "OpSource", "OpType", "SchedulerConfig", "SpanState", "Stage"]


def written_condition(dec: object, cf: Changefeed, kind: str) -> Condition | None:
    """The Changefeed's condition ``kind`` as the decision leaves it (its last status write, else the view's)."""
    written = [w.obj for w in writes(dec) if isinstance(w, I.WriteStatus) and w.obj.kind is Kind.CHANGEFEED]  # type: ignore[arg-type]
    latest = written[-1] if written else cf
    assert isinstance(latest, Changefeed)
    return latest.condition(kind)


def written_events(dec: object, reason: str) -> list[I.Event]:
    """The decision's Events of ``reason``."""
    return [w for w in writes(dec) if isinstance(w, I.Event) and w.reason == reason]  # type: ignore[arg-type]
