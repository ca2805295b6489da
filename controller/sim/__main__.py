"""``python -m controller.sim`` / ``changefeed-sim``: run seeded histories, or the mutation check.

Why a CLI of its own: a failing seed must be replayable by anyone with one command, and the sweep
must be cheap enough to run in CI (several processes, a time budget). Exit status 1 on any
violation, or on a mutant the sweep does not catch.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections.abc import Iterable, Iterator

from controller.engine.world import DIRECT_MUTANTS, MUTANTS
from controller.sim import maintainer as sim_maintainer
from controller.sim.history import DEFAULT_STEPS, Result, run_history

MUTANT_SEEDS = 1500


def _run(args: tuple[int, tuple[str, ...], int]) -> Result:
    seed, mutants, steps = args
    return run_history(seed, frozenset(mutants), steps)


def replay_line(seed: int, mutants: Iterable[str] = (), steps: int = DEFAULT_STEPS) -> str:
    extra = "".join(f" --mutant {m}" for m in sorted(mutants))
    if steps != DEFAULT_STEPS:
        extra += f" --steps {steps}"
    checks, default = sim_maintainer.CHECKS, sim_maintainer.Checks()
    if checks.agree_every != default.agree_every:
        extra += f" --agree-every {checks.agree_every}"
    if checks.verify_every != default.verify_every:
        extra += f" --verify-every {checks.verify_every}"
    return f"python -m controller.sim --seed {seed}{extra}"


def report(r: Result, mutants: Iterable[str] = (), steps: int = DEFAULT_STEPS) -> str:
    return (
        f"VIOLATION seed={r.seed} (step {r.steps}): {r.violation}\n"
        f"replay: {replay_line(r.seed, mutants, steps)}\n"
        f"trace of the last steps:\n{r.trace}\n"
    )


def _results(seeds: list[int], mutants: tuple[str, ...], steps: int, jobs: int) -> Iterator[Result]:
    work = [(s, mutants, steps) for s in seeds]
    if jobs <= 1:
        for w in work:
            yield _run(w)
        return
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        yield from pool.imap(_run, work, chunksize=4)


#: How many seeds ``--find`` lists per count (the candidates a long run offers a rare mutant).
FIND_SHOWN = 2000


def sweep(
    seeds: list[int], mutants: tuple[str, ...], steps: int, jobs: int, budget: float | None, find: tuple[str, ...] = ()
) -> int:
    t0 = time.perf_counter()
    done = failed = total_steps = 0
    counts: dict[str, int] = {}
    found: dict[str, list[int]] = {what: [] for what in find}
    for r in _results(seeds, mutants, steps, jobs):
        done += 1
        total_steps += r.steps
        for k, v in r.counts.items():
            counts[k] = counts.get(k, 0) + v
        for what in find:
            if r.counts.get(what, 0) > 0:
                found[what].append(r.seed)
        if not r.ok:
            failed += 1
            print(report(r, mutants, steps))
        if budget is not None and time.perf_counter() - t0 > budget:
            print(f"budget of {budget:.0f}s reached")
            break
    dt = max(time.perf_counter() - t0, 1e-9)
    print(
        f"{done} histories, {failed} with violations, {dt:.1f}s: "
        f"{done / dt:.1f} histories/s, {total_steps / dt:.0f} steps/s"
    )
    print("injected: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    for what, at in found.items():
        print(f"seeds with {what!r} ({len(at)}): {' '.join(map(str, at[:FIND_SHOWN]))}")
    return 1 if failed else 0


#: Seeds tried first for a mutant, each with the mutant and (if it fails) without; should one no longer catch its
#: mutant, the sweep from 0 goes on. Mutants whose race the sweep does not reach at all are killed by tests of the
#: engine instead (``engine.world.DIRECT_MUTANTS``).
PINNED: dict[str, tuple[int, ...]] = {
    # A race too rare for the sweep: a Split records a new span as deleted by hand that another maintainer had
    # created, unseen by its view.
    "gives-up-a-span-unseen": (900494,),
    # The rest: the first seeds of the sweep that catch a mutant it otherwise reaches only after 30 to 260
    # histories (without them most of the mutation check's time went to those).
    "failures-not-reported": (262,),
    "capture-resumes-after-takeover": (181,),
    "reshape-without-capture-skips-new-spans": (161,),
    "bootstrap-skips-orphan-dispatchers": (37,),
    "capture-resume-check-trusts-an-old-renewal": (42,),
    "outage-counts-as-silence": (27,),
    "restore-forgets-move-destination": (34,),
}


def mutation_check(start: int, limit: int, steps: int, jobs: int) -> int:
    survived = []
    for name in sorted(MUTANTS):
        if name in DIRECT_MUTANTS:
            print(f"direct   {name}: killed by a test of the engine, not the sweep (engine.world.DIRECT_MUTANTS)")
            continue
        t0 = time.perf_counter()
        caught: Result | None = None
        tried = 0
        pinned = list(PINNED.get(name, ()))
        for r in _results(pinned + [s for s in range(start, start + limit) if s not in pinned], (name,), steps, jobs):
            tried += 1
            if not r.ok:
                if not run_history(r.seed, frozenset(), steps).ok:
                    print(f"         seed {r.seed} fails without the mutant too: not counted")
                    continue
                caught = r
                break
        dt = time.perf_counter() - t0
        if caught is not None:
            print(f"caught   {name}: seed {caught.seed} after {tried} histories ({dt:.1f}s): {caught.violation[:160]}")
            print(f"         replay: {replay_line(caught.seed, (name,), steps)}")
        else:
            survived.append(name)
            print(f"SURVIVED {name}: {limit} histories without a violation")
    return 1 if survived else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="changefeed-sim", description=__doc__)
    p.add_argument("--seeds", type=int, default=100, help="run seeds START..START+N-1")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--seed", type=int, help="run one seed with a verbose trace")
    p.add_argument("--budget", type=float, help="stop starting new histories after this many seconds")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="random steps per history")
    p.add_argument("--mutants", action="store_true", help="mutation check: every mutant must be caught")
    p.add_argument("--mutant", action="append", default=[], help="run with this mutant switched on")
    p.add_argument(
        "--find",
        action="append",
        default=[],
        help="list the seeds of the sweep whose histories count this (e.g. 'teardown stale view'), for tests",
    )
    default = sim_maintainer.Checks()
    p.add_argument(
        "--agree-every",
        type=int,
        default=default.agree_every,
        help="compare the incremental decision with the full one every N decisions (1: all; 0: never; "
        f"default {default.agree_every})",
    )
    p.add_argument(
        "--verify-every",
        type=int,
        default=default.verify_every,
        help=f"rebuild the index and compare it every N decisions (0: never; default {default.verify_every})",
    )
    a = p.parse_args(argv)
    # Set before the worker processes fork, so they inherit it.
    sim_maintainer.CHECKS = sim_maintainer.Checks(agree_every=a.agree_every, verify_every=a.verify_every)
    mutants = tuple(sorted(a.mutant))
    if a.mutants:
        return mutation_check(a.start, min(a.seeds, MUTANT_SEEDS) if a.seeds != 100 else MUTANT_SEEDS, a.steps, a.jobs)
    if a.seed is not None:
        t0 = time.perf_counter()
        r = run_history(a.seed, frozenset(mutants), a.steps, verbose=True)
        dt = time.perf_counter() - t0
        print(f"seed {a.seed}: {'ok' if r.ok else 'VIOLATION'} in {r.steps} steps, {dt:.2f}s")
        print("injected: " + ", ".join(f"{k}={v}" for k, v in sorted(r.counts.items())))
        if not r.ok:
            print(report(r, mutants, a.steps))
            return 1
        return 0
    return sweep(list(range(a.start, a.start + a.seeds)), mutants, a.steps, a.jobs, a.budget, tuple(a.find))


if __name__ == "__main__":
    sys.exit(main())
