"""Scale-out (issue 23, part): the changefeeds spread evenly over the live maintainer replicas.

Three maintainer processes and six changefeeds (each with a table of two spans on two captures). Each replica
announces itself with a member Lease ``cfmm-<identity>``, bids only below its share and hands changefeeds over
gracefully above it (engine/shards.py): the six end up two per replica. SIGKILL one: its changefeeds are led
again by the two others (three each); a replica started in its place gets its share back by handoffs, at most
ceil(C/N) + 2 of them, and every span stays Replicating with nothing Failed.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from controller.capture import ledger
from controller.model.records import Changefeed, Table
from controller.model.resources import from_resource
from controller.model.tso import physical_seconds, tso
from tests.integration.harness import Api, System, set_hooks

CHANGEFEEDS = [f"cf{i}" for i in range(6)]
CAPTURES = ["c0", "c1"]
LEASE = 3.0  # harness.MAINTAINER_FLAGS


def holders(api: Api) -> dict[str, str]:
    """changefeed -> who holds its Lease ("" if nobody)."""
    leases = {lease["metadata"]["name"]: lease for lease in api.list("leases")}
    return {
        cf: str(((leases.get(f"cfm-{cf}") or {}).get("spec") or {}).get("holderIdentity") or "") for cf in CHANGEFEEDS
    }


def counts(api: Api, members: list[str]) -> dict[str, int]:
    led = holders(api)
    return {m: sum(1 for h in led.values() if h == m) for m in members}


def wait(what: str, cond: Any, system: System, timeout: float) -> float:
    began = time.monotonic()
    while True:
        result = cond()
        if result is True:
            return time.monotonic() - began
        problems = system.check_running()
        assert not problems, f"{problems}\n{system.tails()}"
        if time.monotonic() - began > timeout:
            raise AssertionError(f"timed out waiting for {what}: {result!r}\n{system.tails()}")
        time.sleep(0.2)


def start(api: Api, system: System, changefeeds: list[str], spans: int, cache: str = "warm") -> list[str]:
    """The captures, the changefeeds (a table of ``spans`` spans each, unlabelled as a plain manifest's, no balance
    scheduler) and three maintainer replicas with ``--cache=cache``; returns the replicas' identities."""
    for c in CAPTURES:
        system.capture(c)
    for n, cf in enumerate(changefeeds):
        api.create("changefeeds", "Changefeed", cf, {"scheduler": {"balanceIntervalSeconds": 0}})
        api.create("tables", "Table", f"{cf}-t", {"changefeed": cf, "tableID": n + 1, "preSplit": {"spans": spans}})
    members = ["m1", "m2", "m3"]
    for m in members:
        system.maintainer(m, f"--cache={cache}")
    return members


def no_gap_in_any(api: Api, system: System, changefeeds: list[str]) -> None:
    """The captures' delivery ledger (controller/capture/ledger.py) has no gap in any changefeed: every key of every
    table delivered over (start, published checkpoint], the checkpoints having passed the moment of the call (so the
    range covers every handoff and takeover the test made)."""
    now = tso(int(time.time() * 1000))

    def records() -> tuple[dict[str, Changefeed], list[Table]]:
        cfs = {c.name: c for c in map(from_resource, api.list("changefeeds")) if isinstance(c, Changefeed)}
        return cfs, [t for t in map(from_resource, api.list("tables")) if isinstance(t, Table)]

    def passed() -> object:
        cfs, _ = records()
        behind = [n for n in changefeeds if n not in cfs or cfs[n].checkpoint_ts < now]
        return not behind or f"checkpoints not yet past the end of the test: {behind}"

    wait("every checkpoint past the end of the test", passed, system, 60)
    cfs, tables = records()
    required = [
        ledger.Required(t.changefeed, t.table_id, mode, max(cfs[t.changefeed].start_ts, t.start_ts),
                        cfs[t.changefeed].checkpoint_ts)
        for t in tables
        if t.changefeed in changefeeds and not t.deleting
        for mode in cfs[t.changefeed].modes
    ]  # fmt: skip
    assert len({r.changefeed for r in required}) == len(changefeeds)
    problems = ledger.check(ledger.read(system.ledger_dir), required)
    assert problems == [], "the delivery ledger has gaps:\n  " + "\n  ".join(problems[:10])


@pytest.mark.parametrize("cache", ["warm", "sharded"])
def test_changefeeds_spread_over_replicas_and_come_back_after_a_kill(api: Api, system: System, cache: str) -> None:
    """Sharded, each replica also lists a changefeed it takes (the victim's) before deciding for it."""
    members = start(api, system, CHANGEFEEDS, 2, cache)

    def balanced(ms: list[str]) -> object:
        got = counts(api, ms)
        share = len(CHANGEFEEDS) // len(ms)
        return all(v == share for v in got.values()) or got

    def replicating() -> object:
        spans = api.list("spans")
        states = sorted({str((s.get("status") or {}).get("state") or "") for s in spans})
        return (len(spans) == 2 * len(CHANGEFEEDS) and states == ["Replicating"]) or (len(spans), states)

    wait("two changefeeds per replica", lambda: balanced(members), system, 60)
    wait("every span Replicating", replicating, system, 60)

    victim = "m2"
    theirs = [cf for cf, h in holders(api).items() if h == victim]
    assert len(theirs) == 2
    system.signal(victim, signal.SIGKILL)
    took = wait(
        f"{victim}'s changefeeds led again",
        lambda: all(holders(api)[cf] in ("m1", "m3") for cf in theirs) or holders(api),
        system,
        LEASE + 25,
    )
    print(f"led again {took:.1f}s after the SIGKILL (Lease {LEASE:.0f}s)")
    wait("three changefeeds per replica", lambda: balanced(["m1", "m3"]), system, 30)

    def handoffs() -> int:
        return sum(system.procs[m].count("to balance the replicas") for m in system.procs if m.startswith("m"))

    before = handoffs()  # those of the first balancing (replicas that started together) are not this step's
    system.maintainer("m4", f"--cache={cache}")  # the replica's pod comes back (a new identity, as a new pod's)
    took = wait("two per replica again", lambda: balanced(["m1", "m3", "m4"]), system, 60)
    print(f"balanced again {took:.1f}s after the new replica started")
    handed = handoffs() - before
    assert 1 <= handed <= -(-len(CHANGEFEEDS) // 3) + 2, f"{handed} handoffs"
    wait("every span Replicating", replicating, system, 60)
    failed = [
        o["metadata"]["name"] for o in api.list("spanoperators") if (o.get("status") or {}).get("phase") == "Failed"
    ]
    assert failed == []
    for cf in CHANGEFEEDS:
        status = (api.get("changefeeds", cf) or {}).get("status") or {}
        assert status.get("checkpointTs"), cf
        assert time.time() - physical_seconds(int(status["checkpointTs"])) < 60, cf  # moving, not stuck
    no_gap_in_any(api, system, CHANGEFEEDS)
    member_leases = sorted(
        x["metadata"]["name"] for x in api.list("leases") if x["metadata"]["name"].startswith("cfmm-")
    )
    assert {"cfmm-m1", "cfmm-m3", "cfmm-m4"} <= set(member_leases)

    # A graceful stop deletes its own member Lease and hands its changefeeds to the others at once.
    system.signal("m4", signal.SIGTERM)
    wait("m4's member Lease deleted", lambda: api.get("leases", "cfmm-m4") is None or "still there", system, 20)
    wait("three per replica", lambda: balanced(["m1", "m3"]), system, 30)


class LeaderGaps:
    """Polls the changefeeds' Leases in a thread: per changefeed, the longest stretch without a live leader (no
    holder, or a holder whose process is gone)."""

    def __init__(self, api: Api, system: System, changefeeds: list[str]) -> None:
        import threading

        self.api, self.system, self.changefeeds = api, system, changefeeds
        self.longest = dict.fromkeys(changefeeds, 0.0)
        self._since: dict[str, float | None] = dict.fromkeys(changefeeds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            now = time.monotonic()
            try:
                led = holders(self.api)
            except Exception:  # a poll that failed says nothing either way
                continue
            live = {n for n, p in self.system.procs.items() if p.alive()}
            for cf in self.changefeeds:
                if led.get(cf) in live:
                    self._since[cf] = None
                    continue
                began = self._since[cf]
                if began is None:
                    self._since[cf] = began = now
                self.longest[cf] = max(self.longest[cf], now - began)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.longest


def test_a_rolling_restart_of_three_replicas_with_operators_in_flight(api: Api, system: System) -> None:
    """Issue 23: the three replicas rolled one at a time, as a Deployment rollout does (the new pod first, the
    old one SIGTERMed once the new one runs), with 100 Moves held in flight by the captures' hold-close hook:
    every Move Succeeds once released, and no changefeed is without a live leader for longer than the lease
    duration + 5 s. With the sharded cache (the chart's default for more than one replica): every taker lists
    the changefeed it takes before it restores its operators."""
    cfs = CHANGEFEEDS[:5]
    members = start(api, system, cfs, 20, "sharded")

    def replicating() -> object:
        spans = [s for s in api.list("spans") if (s["spec"] or {}).get("changefeed") in cfs]
        states = sorted({str((s.get("status") or {}).get("state") or "") for s in spans})
        return (len(spans) == 20 * len(cfs) and states == ["Replicating"]) or (len(spans), states)

    wait("every span Replicating", replicating, system, 120)
    set_hooks(api, system, CAPTURES, hold_close="*")
    moves = []
    for s in api.list("spans"):
        target = "c1" if (s.get("status") or {}).get("capture") == "c0" else "c0"
        name = f"roll-{s['metadata']['name']}"[:63]
        cf = s["spec"]["changefeed"]
        spec = {"changefeed": cf, "type": "Move", "spans": [s["metadata"]["name"]], "target": target}
        api.create("spanoperators", "SpanOperator", name, spec, labels={"cdc.maintainer.dev/changefeed": cf})
        moves.append(name)
    assert len(moves) == 100

    def phases() -> dict[str, int]:
        out: dict[str, int] = {}
        for o in api.list("spanoperators"):
            if o["metadata"]["name"] in moves:
                st = o.get("status") or {}
                key = f"{st.get('phase', '')}/{st.get('stage', '')}"
                out[key] = out.get(key, 0) + 1
        return out

    wait("every Move held in flight", lambda: phases().get("Running/RemoveOrigin", 0) == 100 or phases(), system, 90)
    gaps = LeaderGaps(api, system, cfs)
    try:
        for i, old in enumerate(members):
            new = f"m{4 + i}"
            system.maintainer(new, "--cache=sharded")
            joined = lambda n=new: api.get("leases", f"cfmm-{n}") is not None or "none"  # noqa: E731
            wait(f"{new}'s member Lease", joined, system, 30)
            system.signal(old, signal.SIGTERM)
            assert phases().get("Failed/", 0) == 0
        final = ["m4", "m5", "m6"]

        def led_by_new() -> object:
            led = {cf: h for cf, h in holders(api).items() if cf in cfs}
            return (set(led.values()) <= set(final) and all(led.values())) or led

        wait("every changefeed led by the new replicas", led_by_new, system, 60)
    finally:
        longest = gaps.stop()
    print(f"longest stretch without a live leader per changefeed: {longest}")
    assert max(longest.values()) <= LEASE + 5, longest
    set_hooks(api, system, CAPTURES, hold_close=None)

    def succeeded() -> object:
        got = phases()
        done = sum(v for k, v in got.items() if k.startswith("Succeeded"))
        return done == 100 or got

    wait("every Move Succeeded", succeeded, system, 120)
    wait("every span Replicating", replicating, system, 60)
