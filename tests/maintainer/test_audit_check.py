"""A full audit is compared with the incremental decision of the same world in the decision's thread, not
on the event loop (controller/maintainer/changefeeds.py: ``decide_and_compare``, ``AuditCheck``)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, cast

import pytest

from controller.engine import intents as I
from controller.engine.maintainer import Decision, Memory, Options, World
from controller.maintainer import changefeeds
from controller.maintainer.changefeeds import AuditCheck, Changefeeds
from controller.maintainer.stats import Stats
from controller.model.states import Kind

MEMORY = Memory(epoch=1, identity="m", bootstrapped=True)


def event(name: str) -> I.Chain:
    return I.Chain((I.Event(Kind.SPAN, name, "Test", "m"),), f"chain {name}")


class FakeWorld:
    index = object()


def deciding(audit: tuple[I.Chain, ...], incremental: tuple[I.Chain, ...]) -> Any:
    def decide(world: World, memory: Memory, options: Options | None = None) -> Decision:
        assert options is not None
        if options.audit_interval == float("inf"):
            return Decision(incremental, memory)
        return Decision(audit, memory, full=True)

    return decide


@pytest.mark.parametrize(
    ("audit", "incremental", "check"),
    [
        ((event("a"), event("b")), (event("a"), event("b")), AuditCheck(agreed=True)),
        ((event("a"), event("b")), (event("b"), event("a")), AuditCheck(agreed=False)),  # another order
        ((event("a"), event("b")), (event("a"),), AuditCheck(agreed=False, missed=("chain b: event Test on Span b",))),
    ],
)
def test_the_audit_is_compared_where_it_is_decided(
    monkeypatch: pytest.MonkeyPatch, audit: Any, incremental: Any, check: AuditCheck
) -> None:
    monkeypatch.setattr(changefeeds, "decide", deciding(audit, incremental))
    decision, got = changefeeds.decide_and_compare(cast(World, FakeWorld()), MEMORY, Options(audit_interval=1.0))
    assert decision.chains == audit
    assert got == check


def test_no_comparison_for_an_incremental_decision_or_before_the_bootstrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(changefeeds, "decide", lambda world, memory, options=None: Decision((), memory))
    assert changefeeds.decide_and_compare(cast(World, FakeWorld()), MEMORY, Options())[1] is None
    monkeypatch.setattr(changefeeds, "decide", deciding((event("a"),), ()))
    unbooted = replace(MEMORY, bootstrapped=False)
    assert changefeeds.decide_and_compare(cast(World, FakeWorld()), unbooted, Options())[1] is None


def test_a_disagreement_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    m = Changefeeds.__new__(Changefeeds)
    m.stats = Stats()
    with caplog.at_level(logging.ERROR, logger="controller.maintainer"):
        m._audited("cf", MEMORY, AuditCheck(agreed=True))
        m._audited("cf", MEMORY, AuditCheck(agreed=False, missed=("chain b: x",)))
        m._audited("cf", MEMORY, AuditCheck(agreed=False))
    assert (m.stats.audits, m.stats.audit_disagreements) == (3, 2)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert messages[0].endswith(": chain b: x")
    assert messages[1].endswith("(same writes in another order)")
