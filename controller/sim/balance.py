"""``python -m controller.sim.balance``: seeded histories of several maintainer replicas sharing C changefeeds.

The crash simulator (``controller.sim``) drives one changefeed through the engine; this one drives the scale-out
layer around it: replicas that start, join, crash (SIGKILL: their Leases lapse), stop gracefully (their Leases
released) and are rolled (a new one first, then the old one stopped), while each replica runs the production
balance policy, ``controller.engine.balance_policy.step`` (the one the maintainer's ``Membership`` runs: settle,
warm-up with the expected replica count, bids counted in flight against the share, one round of handoffs per two
lease durations, what was handed over held back; over ``controller.engine.shards``' rules), on a ``View`` built
from its own view of the Leases, and the elector's ``shards.lapsed``. Leases are compare-and-swap writes on one
API, as the real ones are. What the simulator models itself is the mechanism around the policy: the watch's view,
the elector's bids and renewals, and a handoff's term ending (its writes stop, then its Lease is released).

Checks, every step and at the end:
- *one writer*: every write of a changefeed is by the holder of its Lease at that moment (a handoff stops writing
  before it releases; a lost Lease is never written under);
- *maxLeases*: no replica leads more than its hard cap;
- *a start within the share*: until the first event, no replica leads more than its share of the replicas started
  together (the Deployment's, which the replicas are told: ``expected_replicas``);
- *led again*: no changefeed goes without a live holder (its holder SIGKILLed, stopped, or handing it over) for
  longer than the lease duration + 5 s, when nothing else happened meanwhile and the live replicas have room;
- *rounds land*: a replica's round of handoffs comes only once each changefeed of its last round is led again by a
  live replica that has bootstrapped it (``BOOTSTRAP``), unless an event came meanwhile;
- *converges*: after the quiet end of a history (no more events), every changefeed is led by a live replica, each
  replica leads floor(C/N) or ceil(C/N), and that took at most ceil(C/N) + 2 handoffs.

``shards.MUTANTS`` and ``balance_policy.MUTANTS`` are the bugs these checks must catch (``--mutants``).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from controller.engine import balance_policy, shards

STEP = 0.25
DURATION = 15.0
RETRY = 2.0
HISTORY = 420.0
#: Events happen in the first part of a history; the rest is quiet, for the balance to converge.
EVENTS_UNTIL = 200.0
MUTANT_SEEDS = 300
#: Seconds a taker takes to bootstrap a changefeed (a fresh process: 30 changefeeds x 1,000 spans in 4.9 s).
BOOTSTRAP = 5.0
#: Seconds past the lease duration by which a SIGKILLed replica's changefeeds must be taken over (lease
#: duration + 5 s): the survivors see its member Lease lapse, bid within a retry period, and may lose one race.
LED_AGAIN = 5.0
#: The bugs the checks must catch: the share's rules' and the policy's.
MUTANTS = shards.MUTANTS | balance_policy.MUTANTS
#: Mutants too rare for the first ``MUTANT_SEEDS`` histories, each with a seed whose history catches it, tried first.
PINNED = {
    "bid-past-a-shortfall": 11368,  # two replicas take turns with a Lease handed over for the one below floor
    "handed-over-held-back-long": 14152,  # a changefeed handed to a replica that dies meanwhile waits unled too long
    "bids-herd": 6026569,  # a SIGKILLed replica's changefeeds taken one per retry period, the last past lease + 5 s
}


@dataclass
class Lease:
    holder: str
    renew: float  # the renewTime, as a value that changes with each write (sim time of the write)
    duration: float
    transitions: int = 0
    version: int = 0


class Violation(Exception):
    """A check failed; the message says which and when."""


@dataclass
class Replica:
    identity: str
    started: float
    expected: int
    max_leases: int
    alive: bool = True
    #: changefeed -> epoch of the term it leads.
    leading: dict[str, int] = field(default_factory=dict)
    bids: set[str] = field(default_factory=set)
    next_try: dict[str, float] = field(default_factory=dict)
    handing: set[str] = field(default_factory=set)
    #: The balance policy's memory between this replica's steps (``balance_policy.Memory``).
    memory: balance_policy.Memory = field(default_factory=balance_policy.Memory)
    member_renewed: float = -math.inf
    #: The view of the Leases (one step late) and, per Lease, when the view saw it change (or first saw it).
    view: dict[str, Lease] = field(default_factory=dict)
    changed_at: dict[str, float] = field(default_factory=dict)
    #: The elector's first look at each Lease as it is: (holder, renew, when).
    first_look: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    handoffs: int = 0
    #: The last round of handoffs it decided: (when, the changefeeds).
    last_round: tuple[float, tuple[str, ...]] = (-math.inf, ())

    @property
    def config(self) -> balance_policy.Config:
        return balance_policy.Config(self.identity, self.started, DURATION, RETRY, True, self.max_leases, self.expected)

    def seen(self, name: str, now: float) -> shards.Seen | None:
        lease = self.view.get(name)
        if lease is None:
            return None
        return shards.Seen(lease.holder, lease.duration, now - self.changed_at[name], lease.transitions)


class World:
    def __init__(self, seed: int, mutants: Collection[str]) -> None:
        self.rng = random.Random(seed)
        self.mutants = frozenset(mutants)
        self.now = 0.0
        self.leases: dict[str, Lease] = {}
        rng = self.rng
        self.changefeeds = [f"cf{i}" for i in range(rng.randint(1, 12))]
        n = rng.randint(1, 4)
        self.expected = n
        self.max_leases = rng.choice([0, 0, 0, rng.randint(1, len(self.changefeeds))])
        self.replicas: list[Replica] = []
        self.serial = 0
        self.trace: list[str] = []
        #: (time of a SIGKILL, the changefeeds its replica held)
        self.kills: list[tuple[float, list[str]]] = []
        self.events: list[float] = []
        #: changefeed -> since when no live replica holds it.
        self.unled: dict[str, float] = {}
        #: changefeed -> when its current term began (its taker bootstraps for ``BOOTSTRAP`` seconds after).
        self.taken: dict[str, float] = {}
        #: How far apart the first replicas start: within 3 s, or (a quarter of the histories, drawn apart from the
        #: history's own draws so that the others stay as they were) within 8 s, longer than the settle time: the
        #: warm-up's ``expected`` is then what keeps the first up from taking everything.
        spread = 8.0 if random.Random(f"{seed}/spread").random() < 0.25 else 3.0
        for _ in range(n):
            self.join(rng.uniform(0.0, 1.0) * spread)
        #: A roll under way: the old replica, stopped at that time (its successor joined already).
        self.rolling: tuple[Replica, float] | None = None

    # -- the API -----------------------------------------------------------------------------------

    def write_lease(self, name: str, expect: int | None, lease: Lease) -> bool:
        """A compare-and-swap write (``expect``: the version read; None: create)."""
        cur = self.leases.get(name)
        if (cur is None) != (expect is None) or (cur is not None and cur.version != expect):
            return False
        lease.version = (cur.version if cur else 0) + 1
        self.leases[name] = lease
        return True

    def write(self, r: Replica, cf: str) -> None:
        lease = self.leases.get(shards.changefeed_lease(cf))
        if lease is None or lease.holder != r.identity:
            raise Violation(f"{r.identity} wrote for {cf} at {self.now:.2f}s while {lease and lease.holder!r} holds it")

    # -- events --------------------------------------------------------------------------------------

    def join(self, delay: float = 0.0) -> Replica:
        self.serial += 1
        r = Replica(f"m{self.serial}", self.now + delay, self.expected, self.max_leases)
        self.replicas.append(r)
        self.trace.append(f"{self.now:7.2f} join {r.identity} (starts at {r.started:.2f})")
        return r

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def kill(self, r: Replica) -> None:
        r.alive = False
        self.kills.append((self.now, sorted(r.leading)))
        self.trace.append(f"{self.now:7.2f} SIGKILL {r.identity} leading {sorted(r.leading)}")

    def stop(self, r: Replica) -> None:
        """Graceful: its terms end, its Leases are released, its member Lease deleted."""
        for cf in sorted(r.leading):
            self.release(r, cf)
        r.alive = False
        self.leases.pop(shards.member_lease(r.identity), None)
        self.trace.append(f"{self.now:7.2f} stop {r.identity}")

    def release(self, r: Replica, cf: str) -> None:
        name = shards.changefeed_lease(cf)
        cur = self.leases.get(name)
        epoch = r.leading.pop(cf)
        if cur is not None and cur.holder == r.identity:
            self.write_lease(name, cur.version, Lease("", self.now, 1.0, cur.transitions))
        self.trace.append(f"{self.now:7.2f} {r.identity} releases {cf} (epoch {epoch})")

    def event(self) -> None:
        rng, live = self.rng, [r for r in self.live() if r.started <= self.now]
        what = rng.choice(["kill", "stop", "join", "roll"])
        if what in ("kill", "stop", "roll") and not live:
            what = "join"
        self.events.append(self.now)
        if what == "kill":
            self.kill(rng.choice(live))
        elif what == "stop":
            self.stop(rng.choice(live))
        elif what == "join":
            self.join(rng.uniform(0.0, 2.0))
        else:
            old = rng.choice(live)
            self.join(0.0)
            self.rolling = (old, self.now + rng.uniform(3.0, 8.0))

    # -- a replica's step ---------------------------------------------------------------------------------

    def observe(self, r: Replica) -> None:
        for name, lease in list(self.leases.items()):
            before = r.view.get(name)
            if before is None or (before.holder, before.renew) != (lease.holder, lease.renew):
                r.changed_at[name] = self.now
            r.view[name] = Lease(lease.holder, lease.renew, lease.duration, lease.transitions, lease.version)
        for name in [n for n in r.view if n not in self.leases]:
            del r.view[name]
            r.changed_at.pop(name, None)

    def view(self, r: Replica, asking: Collection[str] = ()) -> balance_policy.View:
        """The replica's ``balance_policy.View``, from its view of the Leases (as ``Membership.view`` builds it)."""
        members = {n: s for n in r.view if n.startswith(shards.MEMBER_PREFIX) and (s := r.seen(n, self.now))}
        return balance_policy.View(
            config=r.config,
            members=members,
            changefeeds={cf: r.seen(shards.changefeed_lease(cf), self.now) for cf in self.changefeeds},
            leading=frozenset(r.leading),
            bids=frozenset(r.bids),
            asking=frozenset(asking),
            handing=frozenset(r.handing),
            memory=r.memory,
        )

    def counts(self, r: Replica) -> dict[str, int]:
        return balance_policy.counts(self.view(r), self.mutants)

    def try_acquire(self, r: Replica, cf: str) -> None:
        """The elector's ``try_acquire``, against the API (a fresh read, as its GET is)."""
        name = shards.changefeed_lease(cf)
        cur = self.leases.get(name)
        if cur is None:
            if self.write_lease(name, None, Lease(r.identity, self.now, DURATION, 1)):
                r.leading[cf] = 1
                self.taken[cf] = self.now
                self.trace.append(f"{self.now:7.2f} {r.identity} takes {cf} (epoch 1)")
            return
        look = r.first_look.get(name)
        if look is None or look[:2] != (cur.holder, cur.renew):
            look = r.first_look[name] = (cur.holder, cur.renew, self.now)
        watched = r.view.get(name)
        silent = 0.0
        if watched is not None and (watched.holder, watched.renew) == (cur.holder, cur.renew):
            silent = self.now - r.changed_at[name]
        seen = shards.Seen(cur.holder, cur.duration, silent)
        if cur.holder != r.identity and not shards.lapsed(seen, self.now - look[2], self.mutants):
            return
        epoch = cur.transitions + 1
        if self.write_lease(name, cur.version, Lease(r.identity, self.now, DURATION, epoch)):
            r.leading[cf] = epoch
            self.taken[cf] = self.now
            self.trace.append(f"{self.now:7.2f} {r.identity} takes {cf} (epoch {epoch}) from {cur.holder!r}")

    def renew(self, r: Replica) -> None:
        now = self.now
        member = shards.member_lease(r.identity)
        if now - r.member_renewed >= RETRY:
            cur = self.leases.get(member)
            lease = Lease(r.identity, now, DURATION, cur.transitions if cur else 0)
            if self.write_lease(member, cur.version if cur else None, lease):
                r.member_renewed = now
        for cf, epoch in sorted(r.leading.items()):
            name = shards.changefeed_lease(cf)
            cur = self.leases.get(name)
            if cur is None or cur.holder != r.identity:
                r.leading.pop(cf)
                self.trace.append(f"{now:7.2f} {r.identity} lost {cf}")
                continue
            if now - cur.renew >= RETRY:
                self.write_lease(name, cur.version, Lease(r.identity, now, DURATION, epoch))

    def step_replica(self, r: Replica) -> None:
        now = self.now
        self.observe(r)
        self.renew(r)
        # Handoffs decided last step end their terms now, between decisions: writes stop, then the Lease goes.
        for cf in sorted(r.handing):
            if cf in r.leading:
                epoch = r.leading[cf]
                early = "handoff-releases-before-writes-stop" in self.mutants
                if early:
                    self.release(r, cf)
                    self.write(r, cf)  # the decision in hand still writing
                else:
                    self.release(r, cf)
                r.handoffs += 1
                r.memory = balance_policy.handed(r.memory, cf, epoch, now, r.config, self.mutants)
        r.handing.clear()
        for cf in r.leading:
            self.write(r, cf)
        if r.max_leases and len(r.leading) > r.max_leases:
            raise Violation(f"{r.identity} leads {len(r.leading)} changefeeds, past maxLeases {r.max_leases}")
        # Bids answered (sent last step), then the policy's step: the loops whose turn it is ask whether to bid (every
        # loop asks at its own pace, all at once at start), and the balance is looked at.
        for cf in sorted(r.bids):
            r.bids.discard(cf)
            if cf not in r.leading:
                self.try_acquire(r, cf)
        asking = [cf for cf in self.changefeeds if cf not in r.leading and now >= r.next_try.get(cf, r.started)]
        for cf in asking:
            r.next_try[cf] = now + RETRY
        decision = balance_policy.step(self.view(r, asking), now, self.mutants)
        r.memory = decision.memory
        r.bids.update(decision.bids)
        if decision.hand_over:
            self.check_round(r)
            r.last_round = (now, decision.hand_over)
        r.handing.update(decision.hand_over)

    # -- checks ---------------------------------------------------------------------------------------

    def check_start(self) -> None:
        """Until the first event, no replica leads more than its share of the replicas the Deployment runs
        (``expected``): they start seconds apart, and the first up must not take everything (its memory that of one
        replica leading all) to hand most of it over once the others are seen (found by the scale-out bench)."""
        if self.events:
            return
        high = shards.share(len(self.changefeeds), self.expected)[1]
        for r in self.live():
            if len(r.leading) > high:
                raise Violation(
                    f"{r.identity} leads {len(r.leading)} changefeeds at {self.now:.2f}s, before any event, past "
                    f"the share {high} of the {self.expected} replicas started"
                )

    def check_round(self, r: Replica) -> None:
        """A replica's round of handoffs comes only once its last round has landed: each changefeed it handed over
        led again by a live replica that has bootstrapped it (``BOOTSTRAP``), unless an event came meanwhile (the
        membership changed: a new round may be due at once). The counts settle first; before (no spacing), a replica
        gave up another changefeed for a shortfall that the one in flight was about to fill."""
        at, handed = r.last_round
        if not handed or any(at < e <= self.now for e in self.events):
            return
        ids = {x.identity for x in self.live()}
        for cf in handed:
            lease = self.leases.get(shards.changefeed_lease(cf))
            landed = lease is not None and lease.holder in ids and self.now - self.taken.get(cf, -math.inf) >= BOOTSTRAP
            if not landed:
                raise Violation(
                    f"{r.identity} hands over again at {self.now:.2f}s while {cf}, handed over at {at:.2f}s, has not "
                    f"landed (holder {lease and lease.holder!r})"
                )

    def check_gaps(self) -> None:
        """No changefeed goes without a live holder for longer than the lease duration + ``LED_AGAIN`` (its holder
        SIGKILLed, stopped, or handing it over), unless something else happened meanwhile or the live replicas
        have no room for it."""
        live = [r for r in self.live() if r.started <= self.now]
        ids = {r.identity for r in live}
        for cf in self.changefeeds:
            lease = self.leases.get(shards.changefeed_lease(cf))
            if lease is not None and lease.holder in ids:
                self.unled.pop(cf, None)
                continue
            since = self.unled.setdefault(cf, self.now)
            if self.now - since <= DURATION + LED_AGAIN:
                continue
            if any(since < e <= self.now for e in self.events) or self.now < 30.0:
                continue  # something else happened meanwhile (or the replicas are still starting)
            if not live or sum(r.max_leases or len(self.changefeeds) for r in live) < len(self.changefeeds):
                continue
            raise Violation(
                f"{cf} without a live holder since {since:.2f}s ({self.now - since:.2f}s; holder "
                f"{lease and lease.holder!r})"
            )

    def check_end(self) -> None:
        live = self.live()
        if not live:
            return
        ids = {r.identity for r in live}
        for cf in self.changefeeds:
            lease = self.leases.get(shards.changefeed_lease(cf))
            holder = lease.holder if lease else ""
            if self.max_leases and self.max_leases * len(live) < len(self.changefeeds):
                continue
            if holder not in ids:
                raise Violation(f"{cf} not led by a live replica at the end (holder {holder!r})")
        if self.max_leases:
            return
        low, high = shards.share(len(self.changefeeds), len(live))
        got = {r.identity: len(r.leading) for r in live}
        if not all(low <= n <= high for n in got.values()):
            raise Violation(f"not balanced at the end: {got} (share [{low}, {high}])")

    # -- the history ------------------------------------------------------------------------------------

    def run(self) -> None:
        rng = self.rng
        next_event = rng.uniform(20.0, 60.0)
        handoffs_at_quiet: int | None = None
        while self.now < HISTORY:
            if self.now >= next_event and self.now < EVENTS_UNTIL:
                self.event()
                next_event = self.now + rng.uniform(5.0, 60.0)
            if self.rolling is not None and self.now >= self.rolling[1]:
                old, _ = self.rolling
                self.rolling = None
                if old.alive:
                    self.events.append(self.now)
                    self.stop(old)
            if handoffs_at_quiet is None and self.now >= EVENTS_UNTIL and self.rolling is None:
                handoffs_at_quiet = sum(r.handoffs for r in self.replicas)
            for r in self.replicas:
                if r.alive and self.now >= r.started:
                    self.step_replica(r)
            self.check_start()
            self.check_gaps()
            self.now += STEP
        self.check_end()
        live = self.live()
        if handoffs_at_quiet is not None and live and not self.max_leases:
            handed = sum(r.handoffs for r in self.replicas) - handoffs_at_quiet
            bound = -(-len(self.changefeeds) // len(live)) + 2
            if handed > bound:
                raise Violation(f"{handed} handoffs in the quiet end, more than ceil(C/N) + 2 = {bound}")


def run_history(seed: int, mutants: Collection[str] = ()) -> str | None:
    """None, or the violation with the trace's tail."""
    world = World(seed, mutants)
    try:
        world.run()
    except Violation as exc:
        tail = "\n".join(world.trace[-25:])
        return f"seed {seed}: {exc}\n{tail}"
    return None


def mutation_check_one(mutant: str, seeds: int = MUTANT_SEEDS) -> int | None:
    """The first seed that catches ``mutant`` (its pinned seed first), or None."""
    tries = [*([PINNED[mutant]] if mutant in PINNED else []), *range(seeds)]
    return next((s for s in tries if run_history(s, {mutant}) is not None), None)


def mutation_check(seeds: int = MUTANT_SEEDS) -> dict[str, int | None]:
    """The first seed that catches each mutant (None: not caught within ``seeds``)."""
    return {mutant: mutation_check_one(mutant, seeds) for mutant in sorted(MUTANTS)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m controller.sim.balance", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--seed", type=int, help="one seed, with its trace")
    p.add_argument("--mutant", action="append", default=[])
    p.add_argument("--mutants", action="store_true", help="every mutant must be caught")
    a = p.parse_args(argv)
    began = time.monotonic()
    if a.mutants:
        found = mutation_check()
        for mutant, seed in found.items():
            print(f"{mutant}: {'caught by seed ' + str(seed) if seed is not None else 'NOT CAUGHT'}")
        return 0 if all(s is not None for s in found.values()) else 1
    seeds = [a.seed] if a.seed is not None else list(range(a.start, a.start + a.seeds))
    bad = 0
    for seed in seeds:
        problem = run_history(seed, a.mutant)
        if problem is not None:
            bad += 1
            print(problem)
    print(f"{len(seeds)} histories, {bad} violations, {time.monotonic() - began:.1f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
