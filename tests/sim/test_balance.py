"""The balance simulator (``controller.sim.balance``): several replicas over C changefeeds, joining, crashing,
stopping and rolled, each running the production balance policy (``controller.engine.balance_policy.step``) on its
own view of the Leases."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import TypeVar

import pytest

from controller.engine import balance_policy, shards
from controller.sim import balance


def _counts(seed: int) -> tuple[int, int, int]:
    """Kills, joins and handoffs of history ``seed``."""
    world = balance.World(seed, ())
    world.run()
    return len(world.kills), len(world.replicas) - world.expected, sum(r.handoffs for r in world.replicas)


T = TypeVar("T")


def _on_two_cores(work: Callable[[int], T], seeds: range) -> list[T]:
    """``work`` over ``seeds`` in two processes, as the crash simulator's sweep runs (CI has two cores)."""
    with multiprocessing.get_context("fork").Pool(2) as pool:
        return pool.map(work, seeds, chunksize=10)


def test_the_seed_sweep_finds_nothing() -> None:
    problems = [p for p in _on_two_cores(balance.run_history, range(300)) if p is not None]
    assert problems == [], problems[0]


@pytest.mark.parametrize("mutant", sorted(balance.MUTANTS))
def test_every_mutant_is_caught(mutant: str) -> None:
    assert balance.mutation_check_one(mutant) is not None, f"{mutant} not caught"


def test_histories_have_kills_joins_and_handoffs_and_the_checks_look_at_them() -> None:
    """Not a sweep of nothing: kills are judged (``led again``), replicas join and hand changefeeds over, and the
    end is judged balanced."""
    counts = _on_two_cores(_counts, range(60))
    kills, joins, handoffs = (sum(c[i] for c in counts) for i in range(3))
    assert kills >= 20, kills
    assert joins >= 20, joins
    assert handoffs >= 20, handoffs


def test_same_seed_same_history() -> None:
    a, b = balance.World(7, ()), balance.World(7, ())
    a.run()
    b.run()
    assert a.trace == b.trace


def test_the_simulator_runs_the_policy_the_runner_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: the simulator had a transcription of the runner's balance glue. Now every bid and every handoff of
    its replicas comes from ``balance_policy.step`` (the runner's): a step that decides nothing leaves them idle."""
    assert balance_policy.MUTANTS <= balance.MUTANTS
    assert shards.MUTANTS <= balance.MUTANTS
    calls = 0
    real = balance_policy.step

    def step(view: balance_policy.View, now: float, mutants: object = ()) -> balance_policy.Decision:
        nonlocal calls
        calls += 1
        return real(view, now, mutants)  # type: ignore[arg-type]

    monkeypatch.setattr(balance_policy, "step", step)
    world = balance.World(3, ())
    world.run()
    assert calls > 1000
    assert any(r.leading for r in world.live())
    nothing = balance_policy.Decision((), (), balance_policy.Memory())
    monkeypatch.setattr(balance_policy, "step", lambda view, now, mutants=(): nothing)
    idle = balance.World(3, ())
    idle.run()
    assert not any(r.leading for r in idle.replicas)
    assert balance.run_history(0) is not None  # and the checks say so


def test_a_regression_of_the_policys_round_spacing_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spacing of rounds changed in the policy (not a mutant: the constant itself, as a regression would): the
    transcribed copy had its own ``2 * DURATION`` and passed; the simulator now runs the policy and sees it."""
    assert balance.run_history(10) is None
    monkeypatch.setattr(balance_policy, "ROUND_DURATIONS", 0)
    problem = balance.run_history(10)
    assert problem is not None
    assert "hands over again" in problem


def test_a_sigkilled_replicas_changefeeds_are_led_again_within_the_bound_when_they_free_at_once() -> None:
    """Seed 6026569: three changefeeds of a SIGKILLed replica freed at once, three replicas with room for one each.
    The bids spread over them; in one order (the mutant) they were taken one per retry period, the last past lease
    duration + 5 s."""
    assert balance.run_history(6026569) is None
    problem = balance.run_history(6026569, {"bids-herd"})
    assert problem is not None
    assert "without a live holder" in problem, problem
