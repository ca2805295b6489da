"""The pacer keeps a turn of the event loop to one slice of paced work, loses and reorders nothing, and
lets the loop poll between slices (controller/process/pacing.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controller.process.pacing import Pacer


class CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts its turns (one epoll, then the callbacks that were ready)."""

    turns = 0

    def _run_once(self) -> None:
        self.turns += 1
        super()._run_once()  # type: ignore[misc]


def run(main: Any) -> Any:
    loop = CountingLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_is_cut_into_slices_in_order() -> None:
    """Three sources (as three watch streams), 40 units each, every unit about 2 ms of (fake) work, a slice of
    five units' work: no turn runs more than 5 units (the one that opens the window and those until the slice
    is spent), all 120 run, and each source's units run in its order."""
    unit = 2**-9  # about 2 ms, exact in binary: the sums below are exact
    clock = Clock()
    pacer = Pacer(5 * unit, clock=clock)
    done: list[tuple[int, int, int]] = []  # (turn, source, unit)

    async def source(k: int) -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, CountingLoop)
        for i in range(40):
            await pacer.pace()
            done.append((loop.turns, k, i))
            clock.now += unit

    async def main() -> None:
        await asyncio.gather(*(source(k) for k in range(3)))

    run(main())
    assert len(done) == 120
    for k in range(3):
        assert [i for _, s, i in done if s == k] == list(range(40))
    per_turn: dict[int, int] = {}
    for turn, _, _ in done:
        per_turn[turn] = per_turn.get(turn, 0) + 1
    assert max(per_turn.values()) == 5
    assert pacer.yields > 0


def test_cheap_units_do_not_yield() -> None:
    """Units that cost nothing never wait: a quiet loop is not slowed by pacing."""
    clock = Clock()
    pacer = Pacer(0.010, clock=clock)

    async def main() -> None:
        for _ in range(1000):
            await pacer.pace()

    asyncio.run(main())
    assert pacer.yields == 0


def test_io_is_polled_between_slices() -> None:
    """While a long burst runs, a reader whose data is ready gets it before the burst ends (the loop polls
    between slices; a burst counted in units, all in one turn, would starve it)."""
    clock = Clock()
    pacer = Pacer(0.010, clock=clock)
    order: list[str] = []

    async def burst() -> None:
        for i in range(100):
            await pacer.pace()
            clock.now += 0.004
            if i == 99:
                order.append("burst done")

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(await r.readline())
        await w.drain()
        w.close()
        await w.wait_closed()

    async def main() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        async with server:
            r, w = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
            w.write(b"x\n")
            await w.drain()
            task = asyncio.create_task(burst())
            await r.readline()
            order.append("read")
            await task
            w.close()
            await w.wait_closed()

    asyncio.run(main())
    assert order == ["read", "burst done"]


def test_one_pacer_serves_loop_after_loop() -> None:
    """A window opened in a loop that ended does not hold units of the next one back."""
    clock = Clock()
    pacer = Pacer(0.010, clock=clock)

    async def spend() -> None:
        await pacer.pace()
        clock.now += 1.0  # far past the slice; the loop ends before its next turn

    run(spend())

    async def main() -> int:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, CountingLoop)
        began = loop.turns
        await pacer.pace()
        return loop.turns - began

    assert run(main()) == 0  # no wait for a later turn
    assert pacer.yields == 0


def test_the_slice_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Pacer(0)
