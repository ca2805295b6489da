"""The balance simulator (``controller.sim.balance``): several replicas over C changefeeds, joining, crashing,
stopping and rolled, each running ``controller.engine.shards``' decisions on its own view of the Leases."""

from __future__ import annotations

import pytest

from controller.engine import shards
from controller.sim import balance


def test_the_seed_sweep_finds_nothing() -> None:
    problems = [p for s in range(300) if (p := balance.run_history(s)) is not None]
    assert problems == [], problems[0]


@pytest.mark.parametrize("mutant", sorted(shards.MUTANTS))
def test_every_mutant_is_caught(mutant: str) -> None:
    assert balance.mutation_check_one(mutant) is not None, f"{mutant} not caught"


def test_histories_have_kills_joins_and_handoffs_and_the_checks_look_at_them() -> None:
    """Not a sweep of nothing: kills are judged (``led again``), replicas join and hand changefeeds over, and the
    end is judged balanced."""
    kills = handoffs = joins = 0
    for seed in range(60):
        world = balance.World(seed, ())
        world.run()
        kills += len(world.kills)
        joins += len(world.replicas) - world.expected
        handoffs += sum(r.handoffs for r in world.replicas)
    assert kills >= 20, kills
    assert joins >= 20, joins
    assert handoffs >= 20, handoffs


def test_same_seed_same_history() -> None:
    a, b = balance.World(7, ()), balance.World(7, ())
    a.run()
    b.run()
    assert a.trace == b.trace
