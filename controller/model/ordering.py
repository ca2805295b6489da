"""``in_order``: ``sorted`` for pools that can hold every record of a changefeed, in runs.

Why: a decision runs in a thread beside the maintainer's event loop (``controller.maintainer.runner``), and
the two share the GIL. Python code lets the GIL go every few milliseconds, but one C call never does, and
``sorted`` compares in C: at 100,000 spans one sort of every dispatcher by ``(created, name)`` held the GIL
(and so the loop: no Lease renewal, no watch event) for about 90 ms of the full audit (measured with
``py-spy record --gil``). Sorted in runs of ``RUN`` and merged by ``heapq.merge`` (Python code), no
one call compares more than ``RUN`` items, and the result is exactly ``sorted``'s: ``heapq.merge`` is
stable (equal keys come in run order, and the runs are in input order), as ``sorted`` is.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

#: The longest run sorted in one C call: about 4 ms of a core at 100,000 spans' scattered records.
RUN = 4096


def in_order(
    items: Iterable[T], key: Callable[[T], Any] | None, reverse: bool = False, run: int | None = None
) -> list[T]:
    """``sorted(items, key=key, reverse=reverse)``; above ``run`` items, sorted in runs and merged."""
    run = RUN if run is None else run
    seq = items if isinstance(items, list) else list(items)
    if len(seq) <= run:
        return sorted(seq, key=key, reverse=reverse)
    runs = [sorted(seq[i : i + run], key=key, reverse=reverse) for i in range(0, len(seq), run)]
    if _in_sequence(runs, key, reverse):
        # Already in order run to run (a cache listed in name order, sorted by name): no merge, no Python step
        # per item. Equal keys across a boundary keep their input order, as ``sorted``'s do.
        return list(itertools.chain.from_iterable(runs))
    return list(heapq.merge(*runs, key=key, reverse=reverse))


def _in_sequence(runs: list[list[T]], key: Callable[[T], Any] | None, reverse: bool) -> bool:
    def k(x: T) -> Any:
        return x if key is None else key(x)

    for before, after in itertools.pairwise(runs):
        a, b = k(before[-1]), k(after[0])
        if (b > a) if reverse else (b < a):
            return False
    return True
