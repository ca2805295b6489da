"""A rollout of the capture StatefulSet (the chart's defaults: drainTimeout 45 s in a 60 s grace period) moves
every span off each capture before its pod exits (issue 24, item 3), on a kind cluster.

1,000 spans over three captures; ``kubectl rollout restart statefulset``, then ``kubectl rollout status`` until it
exits 0 (every pod on the new revision and ready); sampled every few seconds while it runs (and once after), no
span is Absent and single ownership holds; at the end every span is Replicating, the drain scheduler's Moves
account for what the captures held, and no Capture stays draining. (The old pods' logs, which say "drained", go
with them.)
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from controller.engine.invariants import single_owner
from tests.e2e.kube import Kube, wait_for
from tests.e2e.test_failover import CAPTURE, changefeed, live_dispatchers, table, world

pytestmark = pytest.mark.e2e

TABLES = 10
SPANS_PER_TABLE = 100
ROLLOUT_TIMEOUT = 900  # seconds: three pods, each drained (up to 45 s) and restarted in turn


def test_capture_rollout_moves_every_span_before_each_pod_exits(kube: Kube) -> None:
    cf = f"roll-{uuid.uuid4().hex[:5]}"
    base = 7_000_000 + int(uuid.uuid4().int % 1_000_000) * 100
    sts = kube.items("statefulsets", CAPTURE)[0]["metadata"]["name"]
    try:
        kube.apply(
            changefeed(cf, False),
            *(table(cf, f"{cf}-t{i}", base + i, SPANS_PER_TABLE) for i in range(TABLES)),
        )

        def replicating() -> Any:
            w = world(kube, cf)
            states = [s.state.value if s.state else "" for s in w.spans.values()]
            return len(states) == TABLES * SPANS_PER_TABLE and set(states) == {"Replicating"} and w

        before = wait_for("1,000 spans Replicating", replicating, timeout=600, every=3.0)
        held = {c: sum(1 for s in before.spans.values() if s.capture == c) for c in before.captures}
        ops_before = {o["metadata"]["name"] for o in kube.items("spanoperators")}

        kube.run("rollout", "restart", "statefulset", sts)
        # `rollout status` exits 0 once every pod runs the new revision and is ready (its first lines, "waiting
        # for ... to complete", are progress); the world is sampled all the while, and once more after it ended.
        samples = 0
        with kube.background("rollout", "status", f"statefulset/{sts}", f"--timeout={ROLLOUT_TIMEOUT}s") as rollout:
            deadline = time.monotonic() + ROLLOUT_TIMEOUT + 60  # kubectl's own timeout ends it first
            while True:
                ended = rollout.poll()
                w = world(kube, cf)
                samples += 1
                absent = [s.name for s in w.spans.values() if s.state is not None and s.state.value == "Absent"]
                assert not absent, f"{len(absent)} span(s) Absent during the rollout, e.g. {absent[:3]}"
                assert single_owner(live_dispatchers(w)) == [], "a key owned twice during the rollout"
                if ended is not None:
                    break
                assert time.monotonic() < deadline, f"kubectl rollout status still running: {rollout.output()}"
                time.sleep(2.0)
            assert ended == 0, f"rollout status exited {ended} after {samples} samples: {rollout.output()}"

        wait_for("every span Replicating again", replicating, timeout=300, every=3.0)
        moves = [
            o
            for o in kube.items("spanoperators")
            if o["metadata"]["name"] not in ops_before
            and o["spec"].get("changefeed") == cf
            and o["spec"].get("type") == "Move"
        ]
        assert len(moves) >= max(held.values()), f"{len(moves)} Moves for {json.dumps(held)}"
        assert not [c for c in kube.items("captures") if (c.get("spec") or {}).get("draining")]
    finally:
        kube.run("delete", "changefeeds.cdc.maintainer.dev", cf, "--wait=false", check=False)
        kube.run("delete", "tables.cdc.maintainer.dev", "-l", f"cdc.maintainer.dev/changefeed={cf}",
                 "--wait=false", check=False)  # fmt: skip
