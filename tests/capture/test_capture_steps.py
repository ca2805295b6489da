"""Issue 37: a bug in a dispatcher's step is not a network error.

``ValueError`` used to count as one (the capture's ``API_ERRORS``): a step that raised it was retried at every pass
for ever, logged as "dispatcher step failed" with no traceback; any other unexpected error ended the reconcile pass,
cancelled every other dispatcher's step and fenced the whole capture. Now only transport errors and error statuses
are retried as the API's; an unexpected error is logged with its traceback, counted (``Reconciler.step_errors``), and
that dispatcher alone is tried again after a back-off while the others go on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from controller.capture.agent import Agent, Settings
from controller.capture.epochs import PassReads
from controller.capture.reconciler import Reconciler
from controller.kube.client import ApiError, Client, Config
from controller.model import resources as conv
from controller.model.keys import KeyRange
from controller.model.records import Dispatcher
from controller.model.states import Mode

JSON = dict[str, Any]


def disp(i: int) -> Dispatcher:
    return Dispatcher(
        name=f"d{i:03d}",
        uid=f"uid-{i}",
        changefeed="cf",
        span=f"s{i}",
        table_id=1,
        mode=Mode.DEFAULT,
        key_range=KeyRange.of_table(1),
        capture="c0",
        start_ts=1,
        epoch=1,
        resource_version=str(i + 1),
        namespace="ns",
    )


def agent_with(client: Client, n: int, step: Callable[[Dispatcher], None]) -> tuple[Reconciler, Counter[str]]:
    """The reconciler of an agent (never started) holding ``n`` assigned Dispatchers, whose step is ``step``
    (counted)."""
    a = Agent(client, Settings(name="c0", namespace="ns")).reconciler
    a.dispatchers.objects = {d.name: conv.to_resource(d) for d in map(disp, range(n))}
    a.capture.status, a.capture.status_at = {"dispatchers": 0, "pod": None, "address": None}, 1e18  # no write
    calls: Counter[str] = Counter()

    async def fake_step(d: Dispatcher, raw: JSON, epochs: PassReads) -> None:
        calls[d.name] += 1
        step(d)

    a._step = fake_step  # type: ignore[method-assign]
    return a, calls


def test_a_bug_in_a_step_is_loud_counted_and_retried_with_back_off(caplog: pytest.LogCaptureFixture) -> None:
    failing = {"d000"}

    def step(d: Dispatcher) -> None:
        if d.name in failing:
            raise ValueError("a bug in the step")

    async def main() -> None:
        async with Client(Config(url="http://127.0.0.1:1")) as client:
            a, calls = agent_with(client, 3, step)
            with caplog.at_level(logging.WARNING, logger="controller.capture"):
                await a.reconcile()  # a full pass: every dispatcher
            assert calls == {"d000": 1, "d001": 1, "d002": 1}
            assert not [r for r in caplog.records if r.getMessage() == "dispatcher step failed"]
            loud = [r for r in caplog.records if "unexpected error" in r.getMessage()]
            assert len(loud) == 1
            assert loud[0].levelno == logging.ERROR
            assert loud[0].exc_info is not None
            assert isinstance(loud[0].exc_info[1], ValueError)
            assert a.step_errors == 1
            failures, due = a.broken["d000"]
            assert failures == 1
            assert due > asyncio.get_running_loop().time()

            # Not at the next pass, even with its object changed: after its back-off.
            a.dispatchers.dirty = {"d000", "d001"}
            await a.reconcile()
            assert calls == {"d000": 1, "d001": 2, "d002": 1}
            a.broken["d000"] = (1, 0.0)  # its back-off over
            await a.reconcile()
            assert calls["d000"] == 2
            assert a.step_errors == 2
            failures, due = a.broken["d000"]
            assert failures == 2
            assert due - asyncio.get_running_loop().time() > 1.5  # doubled (STEP_ERROR_BACKOFF is 1 s)

            failing.clear()  # fixed (say, its object was repaired): it goes through, and is no longer held back
            a.broken["d000"] = (2, 0.0)
            await a.reconcile()
            assert calls["d000"] == 3
            assert a.broken == {}
            assert a.step_errors == 2

    asyncio.run(main())


def test_a_bug_in_one_step_does_not_stop_the_others_nor_the_capture() -> None:
    """Before, a ``RuntimeError`` in one step cancelled the pass's other steps and ended the main loop (the capture
    fenced itself and exited: every dispatcher stopped, and on the next capture the same bug did it again)."""

    def step(d: Dispatcher) -> None:
        if d.name == "d001":
            raise RuntimeError("a bug in the step")

    async def main() -> None:
        async with Client(Config(url="http://127.0.0.1:1")) as client:
            a, calls = agent_with(client, 4, step)
            await a.reconcile()
            assert calls == dict.fromkeys(("d000", "d001", "d002", "d003"), 1)
            assert set(a.broken) == {"d001"}
            assert a.lease.fence_reason == ""

    asyncio.run(main())


@pytest.mark.parametrize("error", [ConnectionResetError("reset"), ApiError(500, "InternalError", "restarting")])
def test_a_transport_error_is_retried_at_the_next_pass_as_before(
    error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    def step(d: Dispatcher) -> None:
        raise error

    async def main() -> None:
        async with Client(Config(url="http://127.0.0.1:1")) as client:
            a, calls = agent_with(client, 1, step)
            with caplog.at_level(logging.WARNING, logger="controller.capture"):
                await a.reconcile()
                await a.reconcile()
            assert calls == {"d000": 2}
            assert a.step_errors == 0
            assert a.broken == {}
            assert [r.getMessage() for r in caplog.records] == ["dispatcher step failed"] * 2

    asyncio.run(main())
