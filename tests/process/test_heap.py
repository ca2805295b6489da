"""The heap reserve (controller/process/heap.py): free memory paged in ahead of time by a thread of its own, so that
a table that grows in the event loop is carved out of resident pages instead of faulting thousands of them in.

Page faults are counted, not timed: a count does not wobble on a shared machine."""

from __future__ import annotations

import asyncio
import ctypes
import subprocess
import sys
import textwrap
from pathlib import Path

import prometheus_client
import pytest

from controller.apiserver import ApiServerHandle
from controller.kube.client import Client, Config
from controller.maintainer import __main__ as cli
from controller.maintainer.runner import Maintainer, Settings
from controller.process import heap
from tests.kube.conftest import namespace, until

glibc = pytest.mark.skipif(not heap.available(), reason="the heap reserve needs glibc 2.33 or later")


def _huge_pages_always() -> bool:
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


# With transparent huge pages on for every mapping, 16 MiB fault in as a few 2 MiB pages: nothing to count.
small_pages = pytest.mark.skipif(_huge_pages_always(), reason="transparent huge pages are always on")

# In a process of its own: glibc's settings are process-wide, and the count must be this one's alone. The main
# thread allocates a 16 MiB block (what four dicts of 2^18 slots take when they grow on one insert) and writes it,
# as a table's growth does, and counts its own page faults.
PROBE = textwrap.dedent(
    """
    import ctypes, resource, sys
    from controller.process import heap
    assert heap.configure(48 * heap.MiB)
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
@small_pages
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
    """mallinfo2, malloc, free and sbrk over Python buffers. ``where``: the blocks come from the top of the main
    heap, which they extend and which grows by what is freed ("top"); from a free chunk below the top, which stays
    as it is ("below"); or from another arena, above the main heap's end ("foreign")."""

    def __init__(self, top: int, where: str) -> None:
        self.info = heap._MallInfo2()
        self.info.keepcost = top
        self.info.uordblks = 16 * heap.MiB  # wants the floor, 4 MiB
        self.where = where
        self.end = 0  # the main heap's end, past every block it gave
        self.blocks: dict[int, ctypes.Array[ctypes.c_char]] = {}

    def mallinfo2(self) -> heap._MallInfo2:
        return self.info

    def sbrk(self, increment: int) -> int:
        assert increment == 0
        if self.where == "top":
            # Before the refill's blocks, the top starts below any of them; once one is carved, the heap ends past it.
            return self.end if self.blocks else 0
        return 1 << 62 if self.where == "below" else 0

    def malloc(self, size: int) -> int:
        block = ctypes.create_string_buffer(size)
        address = ctypes.addressof(block)
        self.blocks[address] = block
        self.end = max(self.end, address + size)
        return address

    def free(self, address: int) -> None:
        block = self.blocks.pop(address)
        if self.where == "top":
            self.info.keepcost = max(self.info.keepcost, ctypes.sizeof(block))


def test_a_free_chunk_below_the_top_is_written_once_then_only_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeGlibc(top=0, where="below")
    monkeypatch.setattr(heap, "_libc", lambda: fake)
    r = heap.HeapReserve()
    assert r.refill() == heap.FLOOR  # from a free chunk below the top: written (some of it may be untouched)
    assert (r.futile, r.refills) == (1, 1)
    for _ in range(5):
        assert r.refill() == 0  # the same chunk again: allocated and freed, not written
    assert (r.futile, r.refills, r.written) == (6, 1, heap.FLOOR)
    assert not fake.blocks  # every block freed
    fake.where = "top"  # the chunk was used up: the block comes from the top, which grows
    assert r.refill() == heap.FLOOR  # the top was empty: what is wanted
    assert (r.top, r.futile, r.refills) == (heap.FLOOR, 0, 2)
    assert r.refill() == 0  # full
    assert r.refills == 2
    assert not r.off


def test_a_refill_adds_what_is_wanted_to_what_is_left_at_the_top(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block takes the old top and then extends the heap by what is wanted: the top is then 1 to 1.75 times the
    reserve wanted (below the trim threshold, which is at least twice the ceiling: see configure)."""
    fake = FakeGlibc(top=2 * heap.MiB, where="top")  # below three quarters of the 4 MiB wanted
    monkeypatch.setattr(heap, "_libc", lambda: fake)
    r = heap.HeapReserve()
    assert r.refill() == heap.FLOOR + 2 * heap.MiB
    assert r.top == heap.FLOOR + 2 * heap.MiB
    assert r.top <= 1.75 * heap.FLOOR
    assert heap.trim_threshold(heap.MAX_CEILING) > 1.75 * heap.MAX_CEILING


def test_a_reserve_whose_blocks_are_not_the_main_heaps_turns_itself_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread allocated before configure(): the reserve's thread may share that thread's arena, whose memory no
    table of the loop comes from. Refilling it would write megabytes at every check for nothing."""
    fake = FakeGlibc(top=0, where="foreign")
    monkeypatch.setattr(heap, "_libc", lambda: fake)
    r = heap.HeapReserve()
    assert r.refill() == 0
    assert "main heap" in r.off
    assert (r.refills, r.written) == (0, 0)
    assert not fake.blocks


def test_the_heap_is_read_less_often_when_reading_it_is_slow() -> None:
    r = heap.HeapReserve(period=0.25)
    assert r.wait() == 0.25
    r.check_s = 0.02  # mallinfo2 walked many free chunks, holding the heap's lock
    assert r.wait() == pytest.approx(0.02 * heap.DUTY)
    r.check_s = 0.5  # never so far apart that the reserve runs dry while tables grow
    assert r.wait() == heap.MAX_WAIT


def test_its_settings_are_checked() -> None:
    # The top is trimmed only well past the largest reserve: a refill is never given back as it is freed.
    assert heap.trim_threshold(heap.CEILING) >= 2 * heap.CEILING + heap.BLOCK
    assert heap.trim_threshold(heap.MAX_CEILING) >= 2 * heap.MAX_CEILING + heap.BLOCK
    with pytest.raises(ValueError, match="4 to 1024 MiB"):
        heap.HeapReserve(ceiling=heap.MiB)
    with pytest.raises(ValueError, match="4 to 1024 MiB"):
        heap.HeapReserve(ceiling=2 * heap.MAX_CEILING)
    with pytest.raises(ValueError, match="positive"):
        heap.HeapReserve(period=0)
    assert cli.parse([]).heap_reserve == 0  # an opt-in (issue 37): it rewires glibc's allocator in-process
    assert cli.parse(["--heap-reserve", "0"]).heap_reserve == 0
    assert cli.parse(["--heap-reserve", "64"]).heap_reserve == 64
    for bad in ("2", "-1", "1025"):
        with pytest.raises(SystemExit):
            cli.parse(["--heap-reserve", bad])


@glibc
def test_the_maintainer_runs_the_reserve_and_stops_it(server: ApiServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    # glibc's settings are not changed in the test process (they are process-wide and would outlive the test).
    # (So the reserve's thread may get an arena of its own here and turn itself off: that is not what is tested.)
    monkeypatch.setattr(heap, "configure", lambda ceiling=heap.CEILING: True)

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
                await until(lambda: reserve.longest_check_s > 0, "the reserve read the heap")
                text = prometheus_client.generate_latest(m.metrics.registry).decode()
                assert "changefeed_maintainer_heap_reserve_refills_total" in text
                assert "changefeed_maintainer_heap_reserve_bytes" in text
            finally:
                await m.stop()
            assert not thread.is_alive()
            assert reserve._thread is None

    asyncio.run(main())
