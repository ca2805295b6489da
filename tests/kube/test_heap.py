"""The heap reserve (controller/kube/heap.py): free memory paged in ahead of time by a thread of its own, so that
a table that grows in the event loop is carved out of resident pages instead of faulting thousands of them in.

Page faults are counted, not timed: a count does not wobble on a shared machine."""

from __future__ import annotations

import asyncio
import ctypes
import subprocess
import sys
import textwrap

import prometheus_client
import pytest

from controller.apiserver import ApiServerHandle
from controller.kube import heap
from controller.kube.client import Client, Config
from controller.maintainer import __main__ as cli
from controller.maintainer.runner import Maintainer, Settings
from tests.kube.conftest import namespace, until

glibc = pytest.mark.skipif(not heap.available(), reason="the heap reserve needs glibc 2.33 or later")

# In a process of its own: glibc's settings are process-wide, and the count must be this one's alone. The main
# thread allocates a 16 MiB block (what a dict of 350,000 slots takes when it grows) and writes it, as a table's
# growth does, and counts its own page faults.
PROBE = textwrap.dedent(
    """
    import ctypes, resource, sys
    from controller.kube import heap
    assert heap.configure()
    reserve = heap.HeapReserve(ceiling=48 * heap.MiB)
    if sys.argv[1] == "refill":
        heap.FLOOR = 40 * heap.MiB  # the reserve this small process would want is the floor: make it cover 16 MiB
        written = reserve.refill()
        assert written >= 40 * heap.MiB, written
        assert reserve.refill() == 0  # full: nothing to do
        assert reserve.top >= 20 * heap.MiB, reserve.top
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    table = bytearray(16 * heap.MiB)
    print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    """
)


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@glibc
def test_a_refilled_reserve_spares_the_loop_the_page_faults_of_a_growing_table() -> None:
    cold = faults("none")
    warm = faults("refill")
    assert cold >= 16 * heap.MiB // 4096 // 2, cold  # the block's pages faulted in by the thread that writes it
    assert warm < 100, warm  # carved out of pages the reserve had written


def test_the_reserve_wanted_is_a_quarter_of_the_heap_between_the_floor_and_the_ceiling() -> None:
    assert heap.wanted(0, heap.CEILING) == heap.FLOOR
    assert heap.wanted(64 * heap.MiB, heap.CEILING) == 16 * heap.MiB
    assert heap.wanted(1 << 40, heap.CEILING) == heap.CEILING
    assert heap.wanted(1 << 40, 8 * heap.MiB) == 8 * heap.MiB


class FakeGlibc:
    """mallinfo2, malloc, free and sbrk over Python buffers: a heap whose blocks come from its top, which grows by
    what is freed (``from_top``), or from a free chunk below it (the top stays as it is)."""

    def __init__(self, top: int, from_top: bool) -> None:
        self.info = heap._MallInfo2()
        self.info.keepcost = top
        self.info.uordblks = 16 * heap.MiB  # wants the floor, 4 MiB
        self.from_top = from_top
        self.blocks: dict[int, ctypes.Array[ctypes.c_char]] = {}

    def mallinfo2(self) -> heap._MallInfo2:
        return self.info

    def sbrk(self, increment: int) -> int:
        assert increment == 0
        # The top chunk ends here: above every block (they come from below it) or below them (from it).
        return (1 << 62) if not self.from_top else self.info.keepcost

    def malloc(self, size: int) -> int:
        block = ctypes.create_string_buffer(size)
        self.blocks[ctypes.addressof(block)] = block
        return ctypes.addressof(block)

    def free(self, address: int) -> None:
        block = self.blocks.pop(address)
        if self.from_top:
            self.info.keepcost = max(self.info.keepcost, ctypes.sizeof(block))


def test_a_free_chunk_below_the_top_is_written_once_then_only_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeGlibc(top=0, from_top=False)
    monkeypatch.setattr(heap, "_libc", lambda: fake)
    r = heap.HeapReserve()
    assert r.refill() == heap.FLOOR  # from a free chunk below the top: written (some of it may be untouched)
    assert (r.futile, r.refills) == (1, 1)
    for _ in range(5):
        assert r.refill() == 0  # the same chunk again: allocated and freed, not written
    assert (r.futile, r.refills, r.written) == (6, 1, heap.FLOOR)
    assert not fake.blocks  # every block freed
    fake.from_top = True  # the chunk was used up: the block comes from the top, which grows
    assert r.refill() == heap.FLOOR
    assert (r.top, r.futile, r.refills) == (heap.FLOOR, 0, 2)
    assert r.refill() == 0  # full
    assert r.refills == 2


def test_its_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="at least 4 MiB"):
        heap.HeapReserve(ceiling=heap.MiB)
    with pytest.raises(ValueError, match="positive"):
        heap.HeapReserve(period=0)
    assert cli.parse([]).heap_reserve == 32
    assert cli.parse(["--heap-reserve", "0"]).heap_reserve == 0
    assert cli.parse(["--heap-reserve", "64"]).heap_reserve == 64
    for bad in ("2", "-1"):
        with pytest.raises(SystemExit):
            cli.parse(["--heap-reserve", bad])


@glibc
def test_the_maintainer_runs_the_reserve_and_stops_it(server: ApiServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    # glibc's settings are not changed in the test process (they are process-wide and would outlive the test).
    monkeypatch.setattr(heap, "configure", lambda: True)

    async def main() -> None:
        async with Client(Config.load(str(server.kubeconfig_path))) as client:
            ns = await namespace(client)
            off = Maintainer(client, Settings(namespace=ns, identity="m0"))
            await off.start()
            await off.stop()
            assert off.heap is None
            m = Maintainer(client, Settings(namespace=ns, identity="m1", tick=0.1, heap_reserve=heap.FLOOR))
            await m.start()
            try:
                reserve = m.heap
                assert reserve is not None
                assert reserve._thread is not None
                thread = reserve._thread
                await until(lambda: reserve.refills > 0 or reserve.top >= heap.FLOOR // 2, "the reserve checked")
                text = prometheus_client.generate_latest(m.metrics.registry).decode()
                assert "changefeed_maintainer_heap_reserve_refills_total" in text
                assert "changefeed_maintainer_heap_reserve_bytes" in text
            finally:
                await m.stop()
            assert not thread.is_alive()
            assert reserve._thread is None

    asyncio.run(main())
