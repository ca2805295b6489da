"""Heap reserve: memory the event loop will need is paged in by another thread, ahead of time.

At 100,000 spans the maintainer's longest stalls of the event loop can be the kernel's, in page faults, not
Python's. A dict or a set keyed by span name grows its table in one step (past 87,381 entries a dict's table
doubles to 2^18 slots, about 4 MB with string keys). glibc serves a block that large with fresh pages (mmap, or
brk past what the process ever touched), and the first write to each 4 KiB page faults: about 940 faults for one
such table in one informer write-through, more when several maps cross that size on the same insert, at 20-34 us
a fault under load on a VM (about 3 us alone). That time is the event loop's: no Lease renewal, watch event or
decision runs meanwhile.

:class:`HeapReserve` keeps a reserve of free memory at the top of glibc's main heap that has already been
written to, so such a table is carved out of resident pages and its growth costs a copy, not thousands of
faults. A thread of its own checks the heap every ``period`` seconds (``mallinfo2``; less often when that is slow)
and, when the free memory at the top (``keepcost``) is below three quarters of the reserve wanted, allocates a
block of the old top plus that (the old top, then past it), writes it (``memset``) and frees it, so the top is
then 1 to 1.75 times the reserve wanted. Both calls go through ctypes, which releases the GIL, so the faults are
taken on the other core while the loop runs. (A block glibc serves from a free chunk below the top is written
once, then only probed while the top stays short: see ``refill``.) The reserve wanted is a quarter of the heap
in use, between FLOOR and the ``ceiling`` (``--heap-reserve``): the next table to grow is about as large as the
largest one now, and those grow with the heap.

For this to work, three of glibc's settings change (:func:`configure`, once, before any thread allocates):
- one arena (``M_ARENA_MAX``): every thread allocates from the main heap, which the reserve refills (a
  thread's own arena would take its blocks from memory the reserve never touched). Python's threads allocate
  holding the GIL, so they hardly ever wait on the arena's lock;
- blocks up to MMAP_THRESHOLD come from the heap, not from mmap (``M_MMAP_THRESHOLD``; glibc's own starts
  at 128 KiB and moves up only as blocks are freed): an mmap is fresh memory whatever the reserve holds;
- the top of the heap is given back to the system only past twice the ceiling plus a block (at least
  TRIM_THRESHOLD; ``M_TRIM_THRESHOLD``), so the reserve is not returned as soon as it is freed. Memory freed
  meanwhile stays with the process up to that much (and blocks up to 32 MiB are no longer unmapped when freed).

What it costs: the reserve is resident (a quarter of the heap, at most ``ceiling``, of which CEILING is a good
start; the top after a refill at most 1.75 times that: up to 0.56 KiB a span at 100,000 spans), and a refill's
faults are CPU time of the other core. It does nothing where the C library is not glibc (``available()`` is false:
musl, macOS) or with ``--heap-reserve 0``, the default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time

log = logging.getLogger(__name__)

MiB = 1 << 20
#: The reserve is at least this (when it is on) ...
FLOOR = 4 * MiB
#: ... and at most the ``ceiling``, by default this (``--heap-reserve`` in MiB; 0: off).
CEILING = 32 * MiB
#: The largest ceiling allowed.
MAX_CEILING = 1024 * MiB
#: The share of the heap in use kept in reserve.
FRACTION = 0.25
#: Blocks up to this size come from the heap (glibc's largest allowed M_MMAP_THRESHOLD on 64 bits).
MMAP_THRESHOLD = 32 * MiB
#: The top of the heap is trimmed only past this at least (``trim_threshold`` follows the ceiling).
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
#: Seconds between checks (at least; see ``HeapReserve.wait``).
PERIOD = 0.25
#: Reading the heap (``mallinfo2``) takes at most 1/DUTY of the time, unless that would space the checks more
#: than MAX_WAIT apart.
DUTY = 20
MAX_WAIT = 1.0
#: A refill is done in blocks below the mmap threshold (glibc's chunk header and page rounding).
BLOCK = MMAP_THRESHOLD - MiB

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class _Glibc:
    """The calls used, bound once (OSError where the C library is not glibc 2.33 or later: ``_libc`` is None)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        version = getattr(libc, "gnu_get_libc_version", None)
        if version is None or not hasattr(libc, "mallinfo2") or not hasattr(libc, "mallopt"):
            raise OSError("not glibc 2.33 or later")
        self.mallopt = libc.mallopt
        self.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        self.mallopt.restype = ctypes.c_int
        self.mallinfo2 = libc.mallinfo2
        self.mallinfo2.argtypes = []
        self.mallinfo2.restype = _MallInfo2
        self.malloc = libc.malloc
        self.malloc.argtypes = [ctypes.c_size_t]
        self.malloc.restype = ctypes.c_void_p
        self.free = libc.free
        self.free.argtypes = [ctypes.c_void_p]
        self.free.restype = None
        self.sbrk = libc.sbrk  # the end of the main heap: its top chunk ends there
        self.sbrk.argtypes = [ctypes.c_ssize_t]
        self.sbrk.restype = ctypes.c_void_p


_glibc: _Glibc | None = None
_configured = False
_lock = threading.Lock()


def _libc() -> _Glibc | None:
    global _glibc
    if _glibc is None:
        try:
            _glibc = _Glibc()
        except (OSError, AttributeError):
            return None
    return _glibc


def available() -> bool:
    """Whether the C library is glibc with the calls the reserve needs."""
    return _libc() is not None


def trim_threshold(ceiling: int) -> int:
    """The free memory at the top of the heap kept before trimming, for a reserve of at most ``ceiling``."""
    return max(TRIM_THRESHOLD, 2 * ceiling + BLOCK)


def configure(ceiling: int = CEILING) -> bool:
    """Set glibc's allocator for a reserve of at most ``ceiling`` (the first call decides; later ones do nothing).
    Call before any other thread allocates (:meth:`HeapReserve.refill` turns the reserve off if one did: its
    thread's blocks would not come from the main heap). False where unavailable."""
    global _configured
    libc = _libc()
    if libc is None:
        return False
    with _lock:
        if not _configured:
            ok = (
                libc.mallopt(_M_ARENA_MAX, 1)
                and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold(ceiling))
            )
            if not ok:
                log.warning("glibc refused the heap reserve's settings (mallopt): the reserve is off")
                return False
            _configured = True
    return True


def wanted(in_use: int, ceiling: int) -> int:
    """The reserve wanted for a heap with ``in_use`` bytes allocated."""
    return min(ceiling, max(FLOOR, int(in_use * FRACTION)))


class HeapReserve:
    """The refilling thread (:meth:`start`, :meth:`stop`) and its figures for the metrics and the bench."""

    def __init__(self, ceiling: int = CEILING, period: float = PERIOD) -> None:
        if not FLOOR <= ceiling <= MAX_CEILING:
            raise ValueError(f"the heap reserve's ceiling must be {FLOOR // MiB} to {MAX_CEILING // MiB} MiB")
        if period <= 0:
            raise ValueError("the heap reserve's period must be positive")
        self.ceiling = ceiling
        self.period = period
        self.refills = 0
        #: Bytes written by refills (resident already or faulted in by them).
        self.written = 0
        self.refill_s = 0.0
        #: The free memory at the top of the heap at the last check.
        self.top = 0
        #: Checks in a row whose blocks came from below the top, which stayed short (``refill``).
        self.futile = 0
        #: Seconds the last ``mallinfo2`` took, and the longest so far (``wait``).
        self.check_s = 0.0
        self.longest_check_s = 0.0
        #: Why the reserve turned itself off ("": on).
        self.off = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start the thread; false (and nothing started) where the reserve is unavailable."""
        if not configure(self.ceiling):
            log.info("heap reserve unavailable (the C library is not glibc 2.33 or later, or mallopt refused)")
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="heap-reserve", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _run(self) -> None:
        while not self.off and not self._stop.wait(self.wait()):
            try:
                self.refill()
            except Exception:  # an optimisation: never the end of the process
                log.exception("heap reserve refill failed")

    def wait(self) -> float:
        """Seconds until the next check: the period, or longer when reading the heap is slow. ``mallinfo2`` walks
        every free chunk holding the heap's lock, which every thread's allocations wait for: it is kept to at most
        1/DUTY of the time, but the checks are never more than MAX_WAIT apart (at 100,000 spans one call took up
        to 27 ms while spans were placed, and a reserve checked every 5 s ran dry: a stall of 127.5 ms)."""
        return max(self.period, min(MAX_WAIT, self.check_s * DUTY))

    def _info(self, libc: _Glibc) -> _MallInfo2:
        began = time.perf_counter()
        info: _MallInfo2 = libc.mallinfo2()
        self.check_s = time.perf_counter() - began
        self.longest_check_s = max(self.longest_check_s, self.check_s)
        return info

    def refill(self) -> int:
        """Top the reserve up if it is below three quarters of what is wanted; the bytes written (0: nothing to do).

        glibc serves a block from a free chunk large enough when there is one (a table freed by its growth, a full
        audit's lists) rather than from the top. Such a chunk is resident memory a growing table can be carved
        from as well, but the top does not grow, and the next check would write it again (at rest too: one run
        wrote 2 GB in 247 refills). A block from below the top is written only by the first refill that finds it
        (pages of it may never have been touched); while the top stays short, later checks only allocate and free
        it (``futile``) until a block comes from the top again.

        A block above the end of the main heap is not the main heap's: a thread allocated before
        :func:`configure` and this thread shares its arena, whose memory the loop's tables never come from. The
        reserve then turns itself off (``off`` says why)."""
        libc = _libc()
        if libc is None or self.off:
            return 0
        info = self._info(libc)
        self.top = info.keepcost
        want = wanted(info.uordblks, self.ceiling)
        if info.keepcost >= want * 3 // 4:
            self.futile = 0
            return 0
        began = time.perf_counter()
        # A block of the old top plus ``want`` is carved from the top of the heap, which it extends: only the part
        # past the old top is fresh, and the top is then up to 1.75 times ``want`` (asking for ``want`` alone left
        # it at 0.75-1 times: the reserve ran short when several tables grew at once, a stall of 127.5 ms). The
        # trim threshold is above that. Blocks stay below the mmap threshold: none is an mmap.
        need = want + info.keepcost
        top_start = (libc.sbrk(0) or 0) - info.keepcost
        blocks: list[int] = []
        allocated = written = 0
        try:
            while allocated < need:
                size = min(BLOCK, need - allocated)
                block = libc.malloc(size)
                if not block:
                    break
                blocks.append(block)
                allocated += size
                if block + size > (libc.sbrk(0) or 0):
                    self.off = "its thread does not allocate from the main heap (a thread allocated before configure())"
                    log.warning("heap reserve off: %s", self.off)
                    return 0
                if block + size > top_start or not self.futile:
                    ctypes.memset(block, 0, size)  # releases the GIL: the faults are this thread's
                    written += size
        finally:
            for block in blocks:
                libc.free(block)
        self.top = self._info(libc).keepcost
        self.futile = self.futile + 1 if self.top < want * 3 // 4 else 0
        if written:
            self.refills += 1
            self.written += written
            self.refill_s += time.perf_counter() - began
        return written
