"""Applies a Decision's chains to the simulated API exactly as ``controller.engine.intents`` specifies.

Why it is separate from the API: this is the part production must get right too (``controller.kube``
will follow the same rules), so it is written as the rules read: a chain stops at its first failure;
Create AlreadyExists (unless the create is exclusive) and Delete NotFound count as success (a Delete
refused for another uid fails the chain); a finalizer edit patches the finalizers of the maintainer's view
with that view's resourceVersion as precondition; a status write uses the resourceVersion an earlier write
of the same chain returned for that object, else the one the decision read; successful responses are
written through into the maintainer's cache (only if newer than what it holds).

The maintainer may die between any two writes: ``kill`` is asked before every write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from controller.engine import intents as I
from controller.engine import teardown
from controller.engine.index import Index
from controller.engine.maintainer import REFUSAL_CODES, Decision, Refusal
from controller.model.records import Record
from controller.model.states import Kind
from controller.sim.api import KINDS, Api, ApiError, WatchEvent

#: The reason of a chain a consistent read stopped (as ``controller.kube.executor.STALE_VIEW``).
STALE_VIEW = "StaleView"


@dataclass
class Cache:
    """An informer-style cache: per kind, the newest version seen (by watch or write-through).

    Tombstones remember the resourceVersion at which an object was deleted, so that a late watch
    event of an older version cannot resurrect it. With ``changefeed`` set, it also keeps the engine's
    ``Index`` of that changefeed's records, per event, as the production informer does.
    """

    objects: dict[Kind, dict[str, Record]] = field(default_factory=lambda: {k: {} for k in KINDS})
    tombstones: dict[tuple[Kind, str], int] = field(default_factory=dict)
    changefeed: str = ""
    index: Index | None = None

    @staticmethod
    def _rv(obj: Record) -> int:
        return int(obj.resource_version or 0)

    def _mine(self, obj: Record) -> bool:
        if obj.kind is Kind.CHANGEFEED:
            return obj.name == self.changefeed
        return getattr(obj, "changefeed", None) == self.changefeed

    def offer(self, obj: Record) -> None:
        rv = self._rv(obj)
        if rv <= self.tombstones.get((obj.kind, obj.name), 0):
            return
        cur = self.objects[obj.kind].get(obj.name)
        if cur is None or self._rv(cur) < rv:
            self.objects[obj.kind][obj.name] = obj
            if self.index is not None:
                if self._mine(obj):
                    self.index.put(obj)
                elif cur is not None and self._mine(cur):
                    self.index.remove(obj.kind, obj.name)

    def remove(self, kind: Kind, name: str, rv: int) -> None:
        cur = self.objects[kind].get(name)
        if cur is not None and self._rv(cur) <= rv:
            del self.objects[kind][name]
            if self.index is not None and self._mine(cur):
                self.index.remove(kind, name)
        self.tombstones[(kind, name)] = max(rv, self.tombstones.get((kind, name), 0))

    def relist(self, api: Api, kind: Kind) -> None:
        """A LIST of ``kind`` (after its watch broke): what the API holds now replaces what the view held."""
        now = api.list(kind)
        for name in [n for n in self.objects[kind] if n not in now]:
            gone = self.objects[kind].pop(name)
            if self.index is not None and self._mine(gone):
                self.index.remove(kind, name)
        for obj in now.values():
            cur = self.objects[kind].get(obj.name)
            if cur is not None and self._rv(cur) >= self._rv(obj):
                continue
            self.objects[kind][obj.name] = obj
            if self.index is not None:
                if self._mine(obj):
                    self.index.put(obj)
                elif cur is not None and self._mine(cur):
                    self.index.remove(kind, obj.name)

    def apply(self, ev: WatchEvent) -> None:
        if ev.obj is None:
            self.remove(ev.kind, ev.name, ev.rv)
        else:
            self.offer(ev.obj)

    @classmethod
    def listed(cls, api: Api, changefeed: str = "", skip: tuple[Kind, ...] = ()) -> Cache:
        """A cache filled by a LIST of every kind (``skip``: kinds not listed yet, the mutant
        ``taker-decides-before-listed``: a replica deciding before its caches are synced)."""
        c = cls(changefeed=changefeed)
        for kind in KINDS:
            c.objects[kind] = {} if kind in skip else api.list(kind)
        if changefeed:
            c.index = Index.build(changefeed, [o for kind in KINDS for o in c.objects[kind].values() if c._mine(o)])
        return c


@dataclass
class Outcome:
    writes: int = 0
    failed_chains: int = 0
    stale_views: int = 0  # chains a consistent read (ConfirmNoneLeft, ConfirmPresent, ConfirmGone) stopped
    #: Which read stopped each of them ("ConfirmGone", "ConfirmPresent", "ConfirmPresent unchanged", ...): where the
    #: read saved the decision from its view, the histories a mutant without it would fail (``--find``).
    stale_reads: list[str] = field(default_factory=list)
    killed: bool = False
    log: list[str] = field(default_factory=list)
    #: Creates that landed (AlreadyExists included) and creates the API refused (for ``maintainer.observed``).
    created: int = 0
    refusals: list[Refusal] = field(default_factory=list)


def apply(
    api: Api,
    cache: Cache,
    decision: Decision,
    kill: Callable[[], bool],
    events: list[str] | None = None,
    log: Callable[[str], None] | None = None,
    client: str = "",
    guard: Callable[[I.Write], None] | None = None,
) -> Outcome:
    """Apply ``decision``'s chains in order. Stops everything once ``kill()`` says the process died.

    ``client``: who writes (a write fails when it cannot reach the API); ``guard``: called before each
    write that reaches the API (the simulator's checks of what may be written)."""
    out = Outcome()
    note = log or out.log.append
    #: The fences this decision ran, by (capture, version judged): their outcome (None: success), so that a
    #: fence in a later chain of the same decision is not written again (as ``controller.kube.executor``).
    fences: dict[tuple[str, str], ApiError | None] = {}
    for chain in decision.chains:
        local: dict[tuple[Kind, str], str] = {}
        done = 0
        error = ""
        for w in chain.writes:
            if isinstance(w, I.Event):
                if events is not None:
                    events.append(f"{w.reason} {w.kind}/{w.name}: {w.message}")
                done += 1
                continue
            if kill():
                out.killed = True
                note(f"  KILLED before write {done + 1}/{len(chain.writes)} of [{chain.why}]")
                return out
            try:
                api.connect(client)
                if guard is not None:
                    guard(w)
                if isinstance(w, I.FenceCapture):
                    _fence_once(api, cache, w, fences)
                else:
                    _one(api, cache, w, local)
            except ApiError as e:
                error = f"{w.describe()} -> {e.code} {e.reason}"
                if e.reason == STALE_VIEW:
                    out.stale_views += 1
                    unchanged = isinstance(w, I.ConfirmPresent) and bool(w.resource_version)
                    out.stale_reads.append(type(w).__name__ + (" unchanged" if unchanged else ""))
                if isinstance(w, I.Create) and e.code in REFUSAL_CODES:
                    out.refusals.append(Refusal(w.describe(), e.reason, e.message))
                break
            done += 1
            out.created += isinstance(w, I.Create)
            if not isinstance(w, I.READS):
                out.writes += 1
        if error:
            out.failed_chains += 1
            note(f"  chain [{chain.why}] stopped after {done}/{len(chain.writes)}: {error}")
        else:
            note(f"  chain [{chain.why}] {len(chain.writes)} writes")
    return out


def _one(api: Api, cache: Cache, w: I.Write, local: dict[tuple[Kind, str], str]) -> None:
    if isinstance(w, I.Create):
        try:
            new = api.create(w.obj)
        except ApiError as e:
            if e.reason == "AlreadyExists" and not w.exclusive:
                # Success for the create; but a later status write in this chain must not land blindly
                # on an object this chain did not make (another maintainer's, from the same snapshot):
                # it gets a precondition that cannot match, so the chain stops and the next decision
                # reads the object first (simulator seed 61).
                local[(w.obj.kind, w.obj.name)] = "AlreadyExists"
                return
            raise
        local[(new.kind, new.name)] = new.resource_version
        cache.offer(new)
    elif isinstance(w, I.WriteStatus):
        key = (w.obj.kind, w.obj.name)
        new = api.write_status(w.obj, local.get(key, w.obj.resource_version))
        local[key] = new.resource_version
        cache.offer(new)
    elif isinstance(w, I.Delete):
        try:
            left = api.delete(w.kind, w.name, w.uid)
        except ApiError as e:
            if e.code == 404:
                return
            raise  # 409: another incarnation has the name; the chain stops (its next writes name it too)
        _after(api, cache, w.kind, w.name, left, local)
    elif isinstance(w, I.AddFinalizer | I.RemoveFinalizer):
        _finalizer(api, cache, w, local)
    elif isinstance(w, I.ConfirmPresent):
        # A consistent read (a GET): the API's own state. Gone, or another incarnation: out of the view, and the
        # chain stops (the production executor's Informer.gone).
        cur = api.get(w.kind, w.name)
        if cur is None or (w.uid and cur.uid != w.uid):
            cache.remove(w.kind, w.name, api.rv if cur is None else Cache._rv(cur) - 1)
            if cur is not None:
                cache.offer(cur)
            raise ApiError(409, STALE_VIEW, f"{w.kind} {w.name} is gone")
        cache.offer(cur)
        if w.resource_version and cur.resource_version != w.resource_version:
            raise ApiError(409, STALE_VIEW, f"{w.kind} {w.name} changed since this view")
    elif isinstance(w, I.ConfirmGone):
        # A consistent read (a GET): found, any incarnation, it enters the view and the chain stops.
        cur = api.get(w.kind, w.name)
        if cur is not None:
            cache.offer(cur)
            if not w.uid or cur.uid == w.uid:
                raise ApiError(409, STALE_VIEW, f"{w.kind} {w.name} is still there")
    elif isinstance(w, I.ConfirmNoneLeft):
        # A consistent read: the API's own state, not the cache (what a LIST without resourceVersion is).
        found = teardown.left_behind(
            (o for kind in teardown.LEFT_BEHIND_KINDS for o in api.list(kind).values()), w.changefeed
        )
        if found:
            for o in found:
                cache.offer(o)
            raise ApiError(409, STALE_VIEW, f"{len(found)} object(s) of {w.changefeed} left, e.g. {found[0].name}")


def _fence_once(api: Api, cache: Cache, w: I.FenceCapture, fences: dict[tuple[str, str], ApiError | None]) -> None:
    key = (w.capture, w.lease_version)
    if key not in fences:
        try:
            taken = api.fence_capture(w.capture, w.lease_version)
        except ApiError as e:
            fences[key] = e
            raise
        fences[key] = None
        if taken is not None:
            cache.offer(taken)
    failed = fences[key]
    if failed is not None:
        raise failed


def _finalizer(
    api: Api, cache: Cache, w: I.AddFinalizer | I.RemoveFinalizer, local: dict[tuple[Kind, str], str]
) -> None:
    """As ``controller.kube.executor``: the finalizers the maintainer's view holds, changed, written with the
    resourceVersion of that view (or of this chain's last write) as precondition; no-op if already so."""
    current = cache.objects[w.kind].get(w.name)
    if current is None:
        if isinstance(w, I.RemoveFinalizer):
            return
        raise ApiError(404, "NotFound", f"{w.kind} {w.name} not in cache")
    have = current.finalizers
    if isinstance(w, I.AddFinalizer):
        if w.finalizer in have:
            return
        want = (*have, w.finalizer)
    else:
        if w.finalizer not in have:
            return
        want = tuple(f for f in have if f != w.finalizer)
    try:
        left = api.patch_finalizers(w.kind, w.name, want, local.get((w.kind, w.name), current.resource_version))
    except ApiError as e:
        if e.code == 404 and isinstance(w, I.RemoveFinalizer):
            cache.remove(w.kind, w.name, api.rv)
            return
        raise
    _after(api, cache, w.kind, w.name, left, local)


def _after(
    api: Api, cache: Cache, kind: Kind, name: str, left: Record | None, local: dict[tuple[Kind, str], str]
) -> None:
    if left is None:
        cache.remove(kind, name, api.rv)
    else:
        local[(kind, name)] = left.resource_version
        cache.offer(left)
