"""``python bench/audit_gil.py``: how long a full decision's thread keeps the main thread waiting (a figure
printer, not a test).

The maintainer decides in a thread beside its event loop, and the two share the GIL: Python code lets it go
every 5 ms (``sys.getswitchinterval``), a single C call (a sort) does not. This builds a changefeed of N
Replicating spans in memory (no API), freezes it out of the collector as the maintainer's tenure does, and
runs ``decide`` as a full audit in a thread while the main thread sleeps 1 ms at a time: the worst lateness of
those sleeps is the longest the GIL was kept from it. It alternates the engine's sorts in runs
(``controller.model.ordering.in_order``, the default) with one ``sorted`` call per pool (``RUN`` set above
N), side by side in one run, and names where the decision's thread was when a wait over 15 ms ended.
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controller.engine.maintainer import Options, decide
from controller.engine.world import World
from controller.model import ordering
from tests.engine import fixtures as F  # (the engine tests' record builders)

PER_TABLE = 1000


def build(spans: int) -> World:
    records: list[object] = [F.capture(f"c{i}") for i in range(3)]
    for t in range(1, spans // PER_TABLE + 1):
        records.append(F.table(t))
        for i, kr in enumerate(F.pieces(t, PER_TABLE)):
            cap = f"c{(t * PER_TABLE + i) % 3}"
            sp = F.span(f"s-{t}-{i}", table_id=t, key_range=kr, capture=cap, dispatcher=f"d-{t}-{i}",
                        created=F.NOW - 100 + i % 7)  # fmt: skip
            records += [sp, F.dispatcher(f"d-{t}-{i}", sp, cap, created=F.NOW - 50 + i % 5)]
    return F.world(*records)  # type: ignore[arg-type]


def one(world: World) -> tuple[float, float, list[tuple[float, str]]]:
    """(decide s, worst lateness ms, waits over 15 ms with where the decision's thread was)."""
    took: list[float] = []

    def run() -> None:
        began = time.perf_counter()
        decide(world, F.memory(), Options(audit_interval=0))
        took.append(time.perf_counter() - began)

    thread = threading.Thread(target=run)
    thread.start()
    worst, late = 0.0, []
    while thread.is_alive():
        began = time.perf_counter()
        time.sleep(0.001)
        lateness = time.perf_counter() - began - 0.001
        worst = max(worst, lateness)
        if lateness > 0.015:
            frame, where = sys._current_frames().get(thread.ident or 0), []
            while frame is not None and len(where) < 2:
                where.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}")
                frame = frame.f_back
            late.append((lateness * 1000, " < ".join(where)))
    thread.join()
    return took[0], worst * 1000, late


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spans", type=int, default=100_000)
    p.add_argument("--runs", type=int, default=3, help="runs of each, alternated")
    p.add_argument("--run", type=int, default=ordering.RUN, help="items sorted in one call (default: the engine's)")
    a = p.parse_args()
    world = build(a.spans)
    gc.collect()
    gc.freeze()
    print(f"{a.spans} spans built; a full decision in a thread, the main thread sleeping 1 ms at a time")
    default_run = ordering.RUN
    ordering.RUN = a.run
    for i in range(a.runs):
        for label, run in ((f"in runs of {a.run}", a.run), ("one sorted() per pool", 10**9)):
            ordering.RUN = run
            took, worst, late = one(world)
            waits = ", ".join(f"{ms:.0f} ms at {where}" for ms, where in sorted(late, reverse=True)[:3])
            print(f"run {i + 1}, {label:22}: decide {took:.2f} s, worst wait {worst:6.1f} ms  {waits}")
    ordering.RUN = default_run


if __name__ == "__main__":
    main()
