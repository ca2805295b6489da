"""The state of a simulated capture and of the dispatchers it really runs (the simulator's ground truth), apart from
what the captures do with it (``controller.sim.captures``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.model import progress
from controller.model.records import Changefeed, Dispatcher
from controller.model.states import DispatcherState
from controller.sim.api import Watcher
from controller.sim.context import Frontier
from controller.sim.executor import Cache


@dataclass
class Run:
    """A dispatcher this capture really runs (ground truth)."""

    d: Dispatcher
    state: DispatcherState
    cp: int
    next_at: float  # when the next transition / report is due
    paused: bool = False  # not delivering (its capture could not renew its Lease); position kept
    #: The highest checkpoint delivered on any of its keys when it paused (by anyone).
    frontier_at_pause: int = 0
    written: DispatcherState | None = None  # the state its last successful status write carried
    traffic: tuple[float, int] = (0.0, 0)  # the write rate and region count last written
    #: The ground truth of the table incarnation it delivers for: the frontier of its table when it started.
    #: A Table deleted and its ID taken by a queued duplicate gets a new frontier; a dispatcher of the old
    #: one still running (a paused capture's) delivers, reports and resumes against its own (seed 89912).
    fr: Frontier | None = None
    #: Why its runtime stopped it for good ("" while it runs): it delivers nothing more, and every status
    #: write says so (``Dispatcher.failure``), until the quiet phase, where a person has repaired its source.
    failure: str = ""


@dataclass
class ResumeCheck:
    """What a paused capture read to decide what to resume (reconciler.py ``resume_plan``): its Dispatchers and the
    published epoch, read right after a renewal succeeded, judged when the reads are done (``ready_at``).
    The reads of thousands of dispatchers on a loaded API can take longer than the renew deadline; renewals
    go on meanwhile, and the result is used only if it is still the same pause and a renewal younger than
    the renew deadline vouches for it then."""

    pause: float
    reads: dict[str, Dispatcher | None]
    cf: Changefeed | None
    ready_at: float


@dataclass
class SimCapture:
    name: str
    watcher: Watcher
    cache: Cache = field(default_factory=Cache)
    alive: bool = True
    renew_ok: bool = True
    last_renew: float = 0.0
    next_renew: float = 0.0
    lease_rv: str = ""  # the version of its last renewal, as it knows it
    acquiring: bool = False  # a restarted process that has not taken its Lease over yet
    paused_at: float | None = None
    check: ResumeCheck | None = None  # what to resume, being read (at most one at a time)
    epoch_seen: int = 0  # the highest published epoch it read before pausing
    #: A fault of its own ever hit it (crash, cut off alone, renewals failing): the maintainer may then
    #: take its Lease. Without one, only API outages silenced it, and taking its Lease is a violation.
    own_fault: bool = False
    runs: dict[str, Run] = field(default_factory=dict)
    pending_since: dict[str, float] = field(default_factory=dict)
    #: Dispatchers being closed: final checkpoint, and whether Stopped was written.
    closing: dict[str, tuple[int, bool]] = field(default_factory=dict)
    closing_uid: dict[str, str] = field(default_factory=dict)
    #: Dispatchers refused at the Working transition (stale epoch): reported Rejected until deleted.
    rejected: set[str] = field(default_factory=set)
    #: hook -> table ids it applies to (empty tuple: all tables)
    hooks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: The process: restarts under the same name get a new incarnation (and run nothing of the old one).
    incarnation: str = ""
    restarts: int = 0
    #: The report its Lease carried when this process started (only the mutation check looks at it).
    previous: progress.Progress | None = None
    #: SIGTERM with a drain timeout (agent.py ``request_stop``, drainer.py): it marked its Capture draining and exits
    #: once it holds nothing or at this time, whichever comes first; None while not stopping.
    stopping_until: float | None = None
    #: After a graceful exit, when its next process starts (a StatefulSet recreating the pod); None: never.
    respawn_at: float | None = None
    #: How long after a graceful exit its next process starts (set by ``Captures.stop``).
    respawn_delay: float = 0.0
    #: This process took over a Lease that did not name it (released, or taken by the maintainer): the Pending
    #: dispatchers assigned to it when its acquisition landed are reported Stopped, not started
    #: (lease_keeper.py ``took_over_foreign``, reconciler.py ``inherited``).
    foreign: bool = False
    inherited: set[str] = field(default_factory=set)

    def hooked(self, hook: str, table_id: int) -> bool:
        scope = self.hooks.get(hook)
        return scope is not None and (not scope or table_id in scope)
