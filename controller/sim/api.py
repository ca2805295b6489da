"""A simulated Kubernetes API server holding model records, with the semantics the engine relies on.

Why simulate the server instead of a dict: the promises the engine makes (idempotent creates,
resourceVersion preconditions, finalizers, uid-preconditioned deletes) only mean something against a
server that enforces them, and the interesting failures come from what a real server does that a dict
does not: it strips status on create, it fails writes transiently, and it delivers watch events late
and interleaved across kinds (order is only guaranteed per kind stream).

Everything is driven by the simulator's single ``random.Random`` and its logical clock, so a history
is reproducible from its seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from controller.model.records import Capture, Record, Span
from controller.model.states import Kind

KINDS: tuple[Kind, ...] = (
    Kind.CHANGEFEED,
    Kind.TABLE,
    Kind.SPAN,
    Kind.DISPATCHER,
    Kind.OPERATOR,
    Kind.CAPTURE,
)


class ApiError(Exception):
    """An API failure: ``code`` 404 NotFound, 409 Conflict/AlreadyExists, 422 Invalid, 500 transient,
    0 no connection (the client is cut off from the API)."""

    def __init__(self, code: int, reason: str, message: str = "") -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Kind
    name: str
    obj: Record | None  # None: deleted
    rv: int


_STATUS_DEFAULTS: dict[type[Record], dict[str, Any]] = {}


def _status_defaults(cls: type[Record]) -> dict[str, Any]:
    """Default values of ``cls``'s status fields: what a freshly created object carries."""
    found = _STATUS_DEFAULTS.get(cls)
    if found is None:
        found = {}
        for f in fields(cls):
            if f.name in cls.STATUS_FIELDS:
                if f.default is not MISSING:
                    found[f.name] = f.default
                elif f.default_factory is not MISSING:
                    found[f.name] = f.default_factory()
        _STATUS_DEFAULTS[cls] = found
    return found


@dataclass
class Watcher:
    """One watch client (a maintainer, a capture): per-kind FIFO queues of timed events.

    ``accept`` filters what this client watches (a capture only its own Dispatchers).
    """

    name: str
    accept: Callable[[WatchEvent], bool]
    queues: dict[Kind, list[tuple[float, WatchEvent]]] = field(default_factory=dict)
    last_due: dict[Kind, float] = field(default_factory=dict)

    def due(self, now: float) -> list[WatchEvent]:
        """Events whose delivery time has come, interleaved across kinds in delivery-time order."""
        out: list[tuple[float, int, WatchEvent]] = []
        for kind in KINDS:
            q = self.queues.get(kind)
            if not q:
                continue
            i = 0
            while i < len(q) and q[i][0] <= now:
                out.append((q[i][0], q[i][1].rv, q[i][1]))
                i += 1
            del q[:i]
        out.sort(key=lambda x: (x[0], x[1]))
        return [e for _, _, e in out]


@dataclass
class Faults:
    p500: float = 0.0
    p409: float = 0.0
    watch_delay: float = 0.5  # maximum delay of a watch event, seconds
    counts: dict[str, int] = field(default_factory=dict)

    def bump(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


class Api:
    """The store and its server-side rules. ``clock()`` gives the simulated time."""

    def __init__(self, rng: random.Random, clock: Callable[[], float]) -> None:
        self.rng = rng
        self.clock = clock
        self.store: dict[Kind, dict[str, Record]] = {k: {} for k in KINDS}
        self.rv = 0
        self.uids = 0
        self.watchers: list[Watcher] = []
        self.faults = Faults()
        #: An outage of the API: until then, no client gets through (requests fail, watches deliver nothing).
        self.outage_until = 0.0
        #: Clients cut off alone (a network partition of one process), until when.
        self.cut_until: dict[str, float] = {}
        #: Spans of these tables are refused on create (422) until when: an admission policy (a webhook, a quota)
        #: that no retry gets past; the maintainer must say so (``WritesRefused``) rather than retry silently.
        self.refusing: dict[int, float] = {}
        #: Called with (old, new) after every successful change (new None: deleted).
        self.observers: list[Callable[[Record | None, Record | None], None]] = []

    # -- reachability ------------------------------------------------------------------------------

    def outage(self) -> bool:
        return self.clock() < self.outage_until

    def reachable(self, client: str) -> bool:
        now = self.clock()
        return now >= self.outage_until and now >= self.cut_until.get(client, 0.0)

    def connect(self, client: str) -> None:
        """Raise what a client gets from an API it cannot reach."""
        if not self.reachable(client):
            raise ApiError(0, "Unreachable", f"{client} cannot reach the API server")

    # -- reads (strong) ----------------------------------------------------------------------------

    def get(self, kind: Kind, name: str) -> Record | None:
        return self.store[kind].get(name)

    def list(self, kind: Kind) -> dict[str, Record]:
        return dict(self.store[kind])

    # -- watches -----------------------------------------------------------------------------------

    def watch(self, name: str, accept: Callable[[WatchEvent], bool] | None = None) -> Watcher:
        w = Watcher(name, accept or (lambda e: True))
        self.watchers.append(w)
        return w

    def unwatch(self, w: Watcher) -> None:
        if w in self.watchers:
            self.watchers.remove(w)

    def _emit(self, old: Record | None, new: Record | None, kind: Kind, name: str) -> None:
        ev = WatchEvent(kind, name, new, self.rv)
        now = self.clock()
        for w in self.watchers:
            if not w.accept(ev):
                continue
            due = max(w.last_due.get(kind, 0.0), now + self.rng.uniform(0.0, self.faults.watch_delay))
            w.last_due[kind] = due
            w.queues.setdefault(kind, []).append((due, ev))
        for ob in self.observers:
            ob(old, new)

    # -- faults ------------------------------------------------------------------------------------

    def _maybe_fail(self, faulty: bool) -> None:
        if not faulty:
            return
        r = self.rng.random()
        if r < self.faults.p500:
            self.faults.bump("500")
            raise ApiError(500, "InternalError", "injected")
        if r < self.faults.p500 + self.faults.p409:
            self.faults.bump("409")
            raise ApiError(409, "Conflict", "injected")

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _put(self, old: Record | None, new: Record) -> Record:
        new = new.evolve(resource_version=self._next_rv())
        self.store[new.kind][new.name] = new
        self._emit(old, new, new.kind, new.name)
        return new

    def _remove(self, old: Record) -> None:
        del self.store[old.kind][old.name]
        self._next_rv()
        self._emit(old, None, old.kind, old.name)

    # -- writes ------------------------------------------------------------------------------------

    def create(self, obj: Record, faulty: bool = True) -> Record:
        self._maybe_fail(faulty)
        if faulty and isinstance(obj, Span) and self.refusing.get(obj.table_id, 0.0) > self.clock():
            # Admission runs before storage: refused even where the name exists. (Only the maintainer's creates:
            # the workload's own, faulty=False, stand for a person's, which the policy lets through.)
            raise ApiError(422, "Invalid", f"Span {obj.name}: admission refuses spans of table {obj.table_id}")
        if obj.name in self.store[obj.kind]:
            raise ApiError(409, "AlreadyExists", f"{obj.kind} {obj.name}")
        self.uids += 1
        # A CRD with a status subresource ignores status on create.
        new = replace(
            obj,
            uid=f"uid-{self.uids}",
            generation=1,
            created=self.clock(),
            deleting=False,
            **_status_defaults(type(obj)),
        )
        if isinstance(new, Span):
            new = new.with_recorded_placement()  # a create keeps the annotation that records a placement
        return self._put(None, new)

    def create_with_status(self, obj: Record) -> Record:
        """Create keeping ``obj``'s status: for agents that create then immediately write status."""
        created = self.create(obj, faulty=False)
        return self.write_status(obj, created.resource_version, faulty=False)

    def write_status(self, obj: Record, precondition: str, faulty: bool = True) -> Record:
        self._maybe_fail(faulty)
        cur = self.store[obj.kind].get(obj.name)
        if cur is None:
            raise ApiError(404, "NotFound", f"{obj.kind} {obj.name}")
        if precondition and cur.resource_version != precondition:
            raise ApiError(409, "Conflict", f"{obj.kind} {obj.name} rv {precondition} != {cur.resource_version}")
        new = cur.with_status_of(obj)
        if new == cur:
            return cur
        return self._put(cur, new)

    def update_spec(self, obj: Record, faulty: bool = False) -> Record:
        """A spec update by a user (kubectl apply): bumps generation when the spec changes."""
        self._maybe_fail(faulty)
        cur = self.store[obj.kind].get(obj.name)
        if cur is None:
            raise ApiError(404, "NotFound", f"{obj.kind} {obj.name}")
        spec = {f: getattr(obj, f) for f in cur.SPEC_FIELDS}
        new = replace(cur, **spec)
        if new == cur:
            return cur
        return self._put(cur, replace(new, generation=cur.generation + 1))

    def delete(self, kind: Kind, name: str, uid: str = "", faulty: bool = True) -> Record | None:
        """Delete; returns the object marked deleting, or None if it is gone."""
        self._maybe_fail(faulty)
        cur = self.store[kind].get(name)
        if cur is None:
            raise ApiError(404, "NotFound", f"{kind} {name}")
        if uid and cur.uid != uid:
            raise ApiError(409, "Conflict", f"{kind} {name} uid {uid} != {cur.uid}")
        if cur.finalizers:
            if cur.deleting:
                return cur
            return self._put(cur, replace(cur, deleting=True))
        self._remove(cur)
        return None

    def add_finalizer(self, kind: Kind, name: str, finalizer: str, faulty: bool = True) -> Record:
        self._maybe_fail(faulty)
        cur = self.store[kind].get(name)
        if cur is None:
            raise ApiError(404, "NotFound", f"{kind} {name}")
        if finalizer in cur.finalizers:
            return cur
        if cur.deleting:
            raise ApiError(422, "Invalid", f"{kind} {name} is being deleted: no new finalizers")
        return self._put(cur, replace(cur, finalizers=(*cur.finalizers, finalizer)))

    def fence_capture(self, name: str, version: str, faulty: bool = True) -> Record | None:
        """Take capture ``name``'s Lease (modelled on its Capture record: ``lease_taken``), precondition
        ``version``, by a write even when it is already taken (as the production executor does: the write
        must land after the decision's view). Returns the updated record; None if there is none."""
        self._maybe_fail(faulty)
        cur = self.store[Kind.CAPTURE].get(name)
        if not isinstance(cur, Capture):
            return None
        if cur.resource_version != version:
            raise ApiError(409, "Conflict", f"Lease of {name}: version {version} != {cur.resource_version}")
        return self._put(cur, cur.evolve(lease_taken=True))

    def patch_finalizers(
        self, kind: Kind, name: str, finalizers: tuple[str, ...], precondition: str, faulty: bool = True
    ) -> Record | None:
        """A merge patch of ``metadata.finalizers`` with a resourceVersion precondition (what the production
        executor sends). Returns the updated object, or None if removing the last finalizer made it vanish."""
        self._maybe_fail(faulty)
        cur = self.store[kind].get(name)
        if cur is None:
            raise ApiError(404, "NotFound", f"{kind} {name}")
        if precondition and cur.resource_version != precondition:
            raise ApiError(409, "Conflict", f"{kind} {name}: version {precondition} != {cur.resource_version}")
        if cur.deleting and set(finalizers) - set(cur.finalizers):
            raise ApiError(422, "Invalid", f"{kind} {name} is being deleted: no new finalizers")
        new = replace(cur, finalizers=tuple(finalizers))
        if new.deleting and not new.finalizers:
            self._remove(cur)
            return None
        return self._put(cur, new)

    def remove_finalizer(self, kind: Kind, name: str, finalizer: str, faulty: bool = True) -> Record | None:
        """Returns the updated object, or None if removing the last finalizer made it vanish."""
        self._maybe_fail(faulty)
        cur = self.store[kind].get(name)
        if cur is None:
            raise ApiError(404, "NotFound", f"{kind} {name}")
        if finalizer not in cur.finalizers:
            return cur
        new = replace(cur, finalizers=tuple(f for f in cur.finalizers if f != finalizer))
        if new.deleting and not new.finalizers:
            self._remove(cur)
            return None
        return self._put(cur, new)
