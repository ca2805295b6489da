"""``python bench/scale_out.py``: C changefeeds x S spans x N maintainer replicas (issue 23), figures, not a test.

One embedded API server (``bench/apiserver_counting.py``), K capture agents, C changefeeds each with one Table of
S spans (applied without the ``cdc.maintainer.dev/changefeed`` label, as a plain manifest is: the leader labels
it). Then, in one run, side by side:

0. placement: one maintainer places every span (all Replicating), then stops gracefully (not measured here: the
   bench/run.py figures are about placement);
1. one replica leads all C (``--cache=warm``, what a single replica runs): a fresh process takes every
   changefeed over (cold: LIST, Lease, bootstrap), rests, and its peak RSS (VmHWM) and what its informer read
   (requests, objects listed, watches) are taken; it stops gracefully;
2. N replicas with ``--cache=sharded`` start together: the time until each leads floor(C/N) or ceil(C/N), and
   until every changefeed has bootstrapped; after a rest, each one's peak RSS and informer reads, as a ratio of
   phase 1's;
3. SIGKILL one of them: the time until each of its changefeeds is led again by a live replica (the Leases, as
   the API holds them) and bootstrapped there; a replica started in its place: the time until the counts are
   balanced again, and the handoffs it took (every replica's count).

Each maintainer is ``bench/maintainer_worker.py`` (the production runner, observed). See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as base  # noqa: E402  (bench/run.py: the embedded API, the captures and the worker processes)

from controller.kube.client import LEASES, RESOURCES, ApiError  # noqa: E402
from controller.model.states import Kind  # noqa: E402

API_VERSION = base.API_VERSION
NS = base.NS


def log(msg: str) -> None:
    base.log(msg)


def names(c: int) -> list[str]:
    return [f"cf{i:02d}" for i in range(c)]


async def create_changefeeds(system: base.System, c: int, s: int) -> None:
    assert system.client is not None
    for i, cf in enumerate(names(c)):
        spec = {"scheduler": {"maxInFlightOperators": 10000, "basicBatchSize": 512, "balanceIntervalSeconds": 0}}
        body = {"apiVersion": API_VERSION, "kind": "Changefeed", "metadata": {"name": cf}, "spec": spec}
        await system.client.create(RESOURCES[Kind.CHANGEFEED], NS, body)
        table = {
            "apiVersion": API_VERSION,
            "kind": "Table",
            "metadata": {"name": f"{cf}-t"},  # no changefeed label: the leader labels it
            "spec": {"changefeed": cf, "tableID": 1000 + i, "preSplit": {"spans": s}},
        }
        await system.client.create(RESOURCES[Kind.TABLE], NS, table)


async def holders(system: base.System, c: int) -> dict[str, str]:
    """changefeed -> the holder of its Lease, as the API holds it ("" if none)."""
    assert system.client is not None
    items, _ = await system.client.list(LEASES, NS)
    by_name = {x["metadata"]["name"]: x for x in items}
    return {
        cf: str(((by_name.get(f"cfm-{cf}") or {}).get("spec") or {}).get("holderIdentity") or "") for cf in names(c)
    }


async def states(workers: list[base.Worker]) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(w.ask("state ") for w in workers)))


def balanced(counts: dict[str, int], c: int) -> bool:
    n = len(counts)
    return all(c // n <= v <= -(-c // n) for v in counts.values())


async def wait(what: str, cond: Any, timeout: float, every: float = 0.25) -> float | None:  # noqa: ASYNC109
    began = time.monotonic()
    last = began
    while True:
        result = await cond()
        now = time.monotonic()
        if result is True:
            return now - began
        if now - last >= 10:
            last = now
            log(f"  waiting for {what} ({now - began:.0f}s): {result}")
        if now - began > timeout:
            log(f"  gave up waiting for {what} after {timeout:.0f}s: {result}")
            return None
        await asyncio.sleep(every)


def informer_reads(stats: dict[str, Any]) -> dict[str, int]:
    """What a replica's informer read: LIST requests (first pages and continuations), objects listed and watches
    started, over the big kinds (the per-changefeed ones) and all kinds."""
    big = ("tables", "spans", "dispatchers", "spanoperators")
    by = stats["by_resource"]
    out = {"lists": 0, "listed_objects": 0, "watches": 0, "lists_big": 0, "listed_big": 0, "watches_big": 0}
    for key, n in by.items():
        verb, _, res = key.partition(" ")
        res = res.split("/")[0]
        kind = {"list": "lists", "list/continue": "lists", "listed": "listed_objects", "watch": "watches"}.get(verb)
        if kind is None or res.endswith("<name>"):
            continue
        out[kind] += n
        if res in big:
            out[{"lists": "lists_big", "listed_objects": "listed_big", "watches": "watches_big"}[kind]] += n
    return out


async def bench(a: argparse.Namespace) -> dict[str, Any]:
    c, s, n = a.changefeeds, a.spans, a.replicas
    out: dict[str, Any] = {"changefeeds": c, "spans_each": s, "replicas": n, "captures": a.captures, "lease": a.lease}
    system = base.System(a, c * s)
    workers: list[base.Worker] = []

    baseline: dict[str, int] = {}

    async def start(identity: str, cache: str, expected: int = 1) -> base.Worker:
        w = await base.Worker.start(
            system.kubeconfig, identity, system.log_dir, a.lease, a.retry,
            "--cache", cache, "--tick", str(a.tick), "--expected-replicas", str(expected),
        )  # fmt: skip
        workers.append(w)
        # Its memory before it has listed anything: the interpreter, the imports, the client (the same for all).
        baseline[identity] = (await w.ask("stats"))["rss"].get("VmRSS", 0)
        return w

    try:
        system.start_server()
        assert system.client is not None
        log(f"embedded API at {system.url}; logs in {system.log_dir}")
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
        await system.client.request("create", "POST", "/api/v1/namespaces", body=ns)
        await create_changefeeds(system, c, s)
        system.start_captures()
        while len((await system.client.list(RESOURCES[Kind.CAPTURE], NS))[0]) < a.captures:  # noqa: ASYNC110
            await asyncio.sleep(0.2)

        # 0. placement
        placer = await start("placer", "warm")
        total = c * s

        async def placed() -> object:
            st = await placer.ask("state ")
            ok = st["span_total"] == total and st["spans"].get("Replicating", 0) == total
            return True if ok else st["spans"]

        took = await wait("every span placed", placed, a.timeout)
        out["placement_s"] = None if took is None else round(took, 1)
        log(f"0. placement of {total} spans in {c} changefeeds: {took}s")
        await placer.stop()
        workers.remove(placer)

        # 1. one replica leads all
        solo = await start("solo", "warm")
        began = time.monotonic()

        async def solo_done() -> object:
            st = await solo.ask("state ")
            return True if len(st["led_bootstrapped"]) == c else f"{len(st['led_bootstrapped'])} bootstrapped"

        took = await wait("one replica leading and bootstrapped everywhere", solo_done, a.timeout)
        out["solo_all_bootstrapped_s"] = None if took is None else round(time.monotonic() - began, 1)
        await asyncio.sleep(a.rest)
        st = await solo.ask("stats")
        out["solo"] = {
            "rss_kib": st["rss"],
            "baseline_kib": baseline["solo"],
            "reads": informer_reads(st),
            "cpu_s": round(st["cpu_s"], 1),
        }
        log(f"1. one replica: all bootstrapped {out['solo_all_bootstrapped_s']}s after start; {out['solo']}")
        await solo.stop()
        workers.remove(solo)

        # 2. N sharded replicas
        began = time.monotonic()
        replicas = list(await asyncio.gather(*(start(f"m{i + 1}", "sharded", n) for i in range(n))))

        async def spread() -> object:
            led = await holders(system, c)
            counts = {w.identity: sum(1 for h in led.values() if h == w.identity) for w in replicas}
            return True if balanced(counts, c) and sum(counts.values()) == c else counts

        await wait("the changefeeds spread", spread, 120)
        out["balanced_s"] = round(time.monotonic() - began, 1)

        async def all_bootstrapped() -> object:
            sts = await states(replicas)
            done = sum(len(x["led_bootstrapped"]) for x in sts)
            return True if done == c else f"{done} bootstrapped"

        await wait("every changefeed bootstrapped", all_bootstrapped, a.timeout)
        out["sharded_all_bootstrapped_s"] = round(time.monotonic() - began, 1)
        await asyncio.sleep(a.rest)
        solo_hwm = out["solo"]["rss_kib"].get("VmHWM", 0)
        solo_above = solo_hwm - baseline["solo"]
        solo_big = out["solo"]["reads"]["listed_big"] or 1
        per: dict[str, Any] = {}
        for w, stat, state in zip(
            replicas, await asyncio.gather(*(w.ask("stats") for w in replicas)), await states(replicas), strict=True
        ):
            hwm = stat["rss"].get("VmHWM", 0)
            reads = informer_reads(stat)
            per[w.identity] = {
                "leads": len(state["leading"]),
                "rss_kib": stat["rss"],
                "rss_vs_solo": round(hwm / solo_hwm, 3) if solo_hwm else None,
                "baseline_kib": baseline[w.identity],
                # What it holds for its changefeeds: the peak above its own baseline, against the solo replica's.
                "above_baseline_vs_solo": round((hwm - baseline[w.identity]) / solo_above, 3) if solo_above else None,
                "reads": reads,
                "listed_big_vs_solo": round(reads["listed_big"] / solo_big, 3),
                "handoffs": stat["handoffs"],
            }
        out["sharded"] = per
        log(f"2. {n} sharded replicas: balanced after {out['balanced_s']}s, all bootstrapped after "
            f"{out['sharded_all_bootstrapped_s']}s; {json.dumps(per)}")  # fmt: skip

        # 3. SIGKILL one; a new one in its place
        victim = replicas[1]
        theirs = [cf for cf, h in (await holders(system, c)).items() if h == victim.identity]
        handoffs_before = {w.identity: per[w.identity]["handoffs"] for w in replicas}
        victim.sigkill()
        killed = time.monotonic()
        alive = [w for w in replicas if w is not victim]

        async def led_again() -> object:
            led = await holders(system, c)
            live = {w.identity for w in alive}
            missing = [cf for cf in theirs if led[cf] not in live]
            return True if not missing else f"{len(missing)} of {len(theirs)} not led"

        took = await wait("the victim's changefeeds led again", led_again, a.lease * 4)
        out["kill"] = {"victim": victim.identity, "changefeeds": len(theirs), "led_again_s": took}

        async def rebootstrapped() -> object:
            sts = await states(alive)
            done = {cf for x in sts for cf in x["led_bootstrapped"]}
            left = [cf for cf in theirs if cf not in done]
            return True if not left else f"{len(left)} not bootstrapped"

        await wait("the victim's changefeeds bootstrapped again", rebootstrapped, a.timeout)
        out["kill"]["bootstrapped_again_s"] = round(time.monotonic() - killed, 1)
        log(f"3. {out['kill']}")
        await victim.proc.wait()
        workers.remove(victim)
        # Its member Lease lapses; the survivors rebalance among themselves (within [floor, ceil] of C/(N-1)).
        await wait(
            "the survivors balanced",
            lambda: _balanced_among(system, c, alive),
            a.lease * 6,
        )
        new = await start(f"m{n + 1}", "sharded", n)
        replicas = [*alive, new]
        added = time.monotonic()
        took = await wait("balanced again with the new replica", spread, 180)
        out["rejoin"] = {"balanced_again_s": took}

        async def settled() -> object:
            sts = await states(replicas)
            done = sum(len(x["led_bootstrapped"]) for x in sts)
            return True if done == c else f"{done} bootstrapped"

        await wait("every changefeed bootstrapped", settled, a.timeout)
        out["rejoin"]["all_bootstrapped_s"] = round(time.monotonic() - added, 1)
        stats = await asyncio.gather(*(w.ask("stats") for w in replicas))
        handed = sum(st["handoffs"] - handoffs_before.get(w.identity, 0) for w, st in zip(replicas, stats, strict=True))
        out["rejoin"]["handoffs"] = handed
        out["rejoin"]["handoff_bound"] = -(-c // n) + 2
        failed = [
            o["metadata"]["name"]
            for o in (await system.client.list(RESOURCES[Kind.OPERATOR], NS))[0]
            if (o.get("status") or {}).get("phase") == "Failed"
        ]
        out["failed_operators"] = len(failed)
        log(f"3. rejoin: {out['rejoin']}; Failed operators: {len(failed)}")
    except (ApiError, RuntimeError, OSError, TimeoutError) as exc:
        out["error"] = repr(exc)
        log(f"stopped by {exc!r}")
    finally:
        for w in workers:
            await w.stop()
        await system.close()
    return out


async def _balanced_among(system: base.System, c: int, workers: list[base.Worker]) -> object:
    led = await holders(system, c)
    counts = {w.identity: sum(1 for h in led.values() if h == w.identity) for w in workers}
    return True if balanced(counts, c) and sum(counts.values()) == c else counts


def print_table(r: dict[str, Any]) -> None:
    print()
    print(f"{r['changefeeds']} changefeeds x {r['spans_each']} spans, {r['replicas']} replicas, "
          f"{r['captures']} captures, Lease {r['lease']:g} s")  # fmt: skip
    if "error" in r:
        print(f"error: {r['error']}")
    solo = r.get("solo")
    if solo:
        print(f"one replica (warm) leading all: peak RSS {solo['rss_kib'].get('VmHWM')} KiB (baseline "
              f"{solo['baseline_kib']} KiB before it listed anything); informer "
              f"{solo['reads']}; all bootstrapped {r.get('solo_all_bootstrapped_s')} s after start")  # fmt: skip
    for ident, p in (r.get("sharded") or {}).items():
        print(f"  {ident} (sharded) leads {p['leads']}: peak RSS {p['rss_kib'].get('VmHWM')} KiB = "
              f"{p['rss_vs_solo']} of one leading all ({p['above_baseline_vs_solo']} above the baseline); "
              f"objects listed of the big kinds {p['reads']['listed_big']} = "
              f"{p['listed_big_vs_solo']} of it; lists {p['reads']['lists']}, watches {p['reads']['watches']}")  # fmt: skip
    if "balanced_s" in r:
        print(f"balanced {r['balanced_s']} s after the replicas started; all bootstrapped after "
              f"{r.get('sharded_all_bootstrapped_s')} s")  # fmt: skip
    if "kill" in r:
        print(f"SIGKILL: {r['kill']}")
    if "rejoin" in r:
        print(f"a replica back: {r['rejoin']}; Failed operators: {r.get('failed_operators')}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--changefeeds", type=int, default=30)
    p.add_argument("--spans", type=int, default=1000, help="spans per changefeed (one Table, at most 1000)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--captures", type=int, default=3)
    p.add_argument("--lease", type=float, default=15.0, help="maintainer Lease duration, s (default 15)")
    p.add_argument("--retry", type=float, default=2.0, help="maintainer Lease retry period, s (default 2)")
    p.add_argument("--tick", type=float, default=30.0, help="the maintainers' backstop tick, s (default 30)")
    p.add_argument("--rest", type=float, default=10.0, help="seconds at rest before the RSS is read")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one phase may take")
    p.add_argument("--report-interval", type=float, default=1.0)
    p.add_argument("--renew-interval", type=float, default=2.0)
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--log-dir", default=str(Path(base.tempfile.gettempdir()) / "cfm-bench-scale-out"))
    a = p.parse_args(argv)
    a.api_cost = False
    if a.spans > base.MAX_PRESPLIT:
        p.error(f"--spans {a.spans}: one Table per changefeed holds at most {base.MAX_PRESPLIT}")
    result = asyncio.run(bench(a))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    print_table(result)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
