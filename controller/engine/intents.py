"""Intended writes: the engine's only output besides its next memory.

A decision is a list of :class:`Chain`\\ s. A chain is an ordered list of writes that the executor
(``controller.kube`` in production, ``controller.sim`` in the simulator) applies one by one, stopping at
the first failure; the next decision then starts from a fresh snapshot. Chains are independent of one
another and may be applied concurrently.

Ordering inside a chain is how "record before act" is expressed: an operator's chain always starts
with the status write that records its new stage, followed by the actions of that stage. A process
killed between any two writes leaves a state from which the next decision re-issues what is missing.

Every write is idempotent when re-issued from the same or a later snapshot:

- ``Create``: AlreadyExists is success (names are deterministic), except for an ``exclusive`` create: one
  whose object records an intent the rest of the chain acts on (a Span created with its placement), where
  AlreadyExists fails the chain: the object there is not the one this chain made, and its own record
  (e.g. a deposed maintainer's placement of that span elsewhere) is what the next decision must read.
- ``Delete``: NotFound is success; a ``uid`` precondition keeps a late delete from removing a
  re-created object of the same name, and its refusal (409) fails the chain (what follows in it, a
  finalizer's release, would name that other object too).
- ``WriteStatus``: carries the resourceVersion the decision was based on; a 409 aborts the chain and
  the next decision re-reads. For an object created earlier in the same chain, the executor uses the
  resourceVersion that create returned; if that create found the object already there, the status
  write fails as a conflict (it would otherwise land, unconditioned, on an object this chain did not
  make, e.g. a concurrent maintainer's operator of the same deterministic name).
- ``AddFinalizer`` / ``RemoveFinalizer``: no-ops when already in the wanted state (as the decision's view
  shows it); otherwise the finalizers of that view, changed, with its resourceVersion (or the one an
  earlier write of the chain returned) as precondition: a 409 fails the chain.
- ``FenceCapture``: takes a lost capture's Lease (holder cleared; already cleared: written again) with the
  version the decision judged as its precondition; success if the Lease is gone; a conflict (the capture
  renewed, or a restarted process of it acquired the Lease, since that version) fails the chain. Within one
  decision, the first fence of a (capture, version) is written and the others share its outcome.
- ``Event``: best effort, never fails a chain.
- ``ConfirmNoneLeft``: a read, not a write: a consistent LIST; fails the chain when the API still holds
  something of the changefeed that its teardown has to remove first.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.model.records import Record
from controller.model.states import Kind


@dataclass(frozen=True, slots=True)
class Create:
    obj: Record
    #: AlreadyExists fails the chain instead of counting as success (see the module's rules).
    exclusive: bool = False

    def describe(self) -> str:
        return f"create {self.obj.kind} {self.obj.name}"


@dataclass(frozen=True, slots=True)
class WriteStatus:
    """Replace ``obj``'s status part; precondition: ``obj.resource_version`` (unless created in-chain)."""

    obj: Record

    def describe(self) -> str:
        return f"status {self.obj.kind} {self.obj.name}"


@dataclass(frozen=True, slots=True)
class Delete:
    kind: Kind
    name: str
    uid: str = ""  # precondition: delete only this incarnation ("" for none)

    def describe(self) -> str:
        return f"delete {self.kind} {self.name}"


@dataclass(frozen=True, slots=True)
class AddFinalizer:
    kind: Kind
    name: str
    finalizer: str

    def describe(self) -> str:
        return f"add finalizer {self.kind} {self.name}"


@dataclass(frozen=True, slots=True)
class RemoveFinalizer:
    kind: Kind
    name: str
    finalizer: str

    def describe(self) -> str:
        return f"release finalizer {self.kind} {self.name}"


@dataclass(frozen=True, slots=True)
class FenceCapture:
    """Take the Lease ``capture-<capture>`` (holder cleared), precondition ``lease_version``.

    The durable token of the capture fencing argument (docs/architecture.md, Fencing): a capture renews
    its Lease by compare-and-swap and resumes its paused dispatchers only after such a renewal, so once
    this write lands nothing that capture process holds can run again, and only then does the engine
    release its dispatchers' finalizers, in the same chain. Written even when the view shows the Lease
    taken already: that view may be older than the dispatchers it releases (a restarted process of the
    capture may hold the Lease again and run one created since); a write that lands came after the view.
    Issued only for a Lease taken or not renewed for a lease duration of the maintainer's current view (the
    capture stopped delivering by then)."""

    capture: str
    lease_version: str

    def describe(self) -> str:
        return f"take the Lease of capture {self.capture}"


@dataclass(frozen=True, slots=True)
class Event:
    """A Kubernetes Event on an object: only for what a person should know or act on."""

    kind: Kind
    name: str
    reason: str
    message: str
    warning: bool = False

    def describe(self) -> str:
        return f"event {self.reason} on {self.kind} {self.name}"


@dataclass(frozen=True, slots=True)
class ConfirmNoneLeft:
    """Not a write: a consistent read of the API (a LIST without a resourceVersion, served from etcd, not
    from a watch cache) that fails the chain if anything of ``changefeed`` is still there that its teardown
    must remove first (``controller.engine.teardown.left_behind``). The executor offers what it found to
    its cache, so the next decision sees it.

    Why: the maintainer's view is one watch per kind, and the watches are independent (as in Kubernetes),
    so a view that shows nothing left can lag on one kind: a Span a person created as the Changefeed was
    deleted, an operator another maintainer created from its own stale view. The teardown's last step,
    releasing the Changefeed's finalizer, comes after this read in the same chain."""

    changefeed: str

    def describe(self) -> str:
        return f"confirm nothing of changefeed {self.changefeed} is left"


@dataclass(frozen=True, slots=True)
class ConfirmPresent:
    """Not a write: a consistent read (a GET, served from etcd) that fails the chain unless ``name`` is still there as
    incarnation ``uid``. The executor takes what is gone out of its view at once, so the next decision sees it.

    Why: a rule that removes something because of another object (an overlap no operator explains removes the newer
    span because of the older one) must not act on a view that still shows that object after it was deleted: a
    person's ``kubectl delete``, or another maintainer's, delivered late by its watch (else a Merge's new span is
    removed as overlapping a source a person had deleted, its DELETED 3 s late).

    With ``resource_version``: also unchanged since this view (``record_unchanged``). A dispatcher created from a
    record the chain does not write itself (an operator's recorded target, a placement's recorded name) rests on
    that record still naming it: a zombie's write of the record (its own new target after the first was refused)
    that the view has not seen yet would otherwise have it create a dispatcher nothing names, which the next
    process closes as unclaimed."""

    kind: Kind
    name: str
    uid: str = ""
    resource_version: str = ""

    def describe(self) -> str:
        if self.resource_version:
            return f"confirm {self.kind} {self.name} is unchanged"
        return f"confirm {self.kind} {self.name} is still there"


@dataclass(frozen=True, slots=True)
class ConfirmGone:
    """Not a write: a consistent read (a GET, served from etcd) that fails the chain if ``name`` exists (any
    incarnation, or only ``uid``'s when given); the executor offers what it found to its view, so the next decision
    sees it.

    Why: a rule that concludes from an object's absence that a person deleted it (an operator's target span
    "deleted by hand mid-way", then given up and its keys left to the safety net) must not conclude it from a view
    that has not seen the object yet: a span another maintainer created (a deposed one finishing the same Split
    from its own view, the create answered AlreadyExists here), its ADDED event still on the way (else a Split
    records its children deleted by hand and the hole fill re-creates the parent's range)."""

    kind: Kind
    name: str
    #: Only this incarnation counts as there ("": any): a Table re-created under the name is not the one a
    #: Changefeed's join named.
    uid: str = ""

    def describe(self) -> str:
        return f"confirm {self.kind} {self.name} is gone"


def record_unchanged(record: Record) -> ConfirmPresent:
    """The consistent read a create resting on ``record`` (as this view has it) comes after."""
    return ConfirmPresent(record.kind, record.name, record.uid, record.resource_version)


Write = (
    Create
    | WriteStatus
    | Delete
    | AddFinalizer
    | RemoveFinalizer
    | FenceCapture
    | Event
    | ConfirmNoneLeft
    | ConfirmPresent
    | ConfirmGone
)
#: Intents that read, not write (not counted as writes).
READS = (ConfirmNoneLeft, ConfirmPresent, ConfirmGone)


@dataclass(frozen=True, slots=True)
class Chain:
    """Writes applied in order; the first failure abandons the rest."""

    writes: tuple[Write, ...]
    why: str = ""
    #: False: once these writes land, the next decision would do nothing they call for (the Changefeed's
    #: progress: checkpoint and counts), so their landing need not wake it; the next event or due time does.
    #: A decision whose every chain says so is checked by the simulator: decided again on its landed writes,
    #: it must write nothing (``controller.sim.maintainer``).
    wake: bool = True

    def describe(self) -> str:
        return f"{self.why}: " + "; ".join(w.describe() for w in self.writes)
