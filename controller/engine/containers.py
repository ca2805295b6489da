"""General containers of the engine's index (engine/index.py): kept apart because they know nothing of its rules.

- ``MultiMap``: key -> names, a lone name stored as itself.
- ``MinTracker``: the lowest value over named entries, updated in O(log n).
- ``RecordView``: name -> record, read from a map of facts that each carry their record.
"""

from __future__ import annotations

from collections.abc import Collection, ItemsView, Iterator, Mapping, ValuesView
from typing import Any, TypeVar

from sortedcontainers import SortedList  # type: ignore[import-untyped]

from controller.model.records import Dispatcher, Span


class MultiMap:
    """key -> names, for indexes where almost every key has one name (a span's dispatchers, the spans
    naming a dispatcher): a lone name is stored as itself, not in a set of its own (a set costs ~200 bytes,
    twice per span at 50,000 spans)."""

    __slots__ = ("_d",)

    def __init__(self) -> None:
        self._d: dict[str, str | set[str]] = {}

    def add(self, key: str, name: str) -> None:
        cur = self._d.get(key)
        if cur is None:
            self._d[key] = name
        elif isinstance(cur, str):
            if cur != name:
                self._d[key] = {cur, name}
        else:
            cur.add(name)

    def discard(self, key: str, name: str) -> None:
        cur = self._d.get(key)
        if cur is None:
            return
        if isinstance(cur, str):
            if cur == name:
                del self._d[key]
            return
        cur.discard(name)
        if len(cur) == 1:
            self._d[key] = next(iter(cur))
        elif not cur:
            del self._d[key]

    def get(self, key: str, default: Collection[str] = ()) -> Collection[str]:
        cur = self._d.get(key)
        if cur is None:
            return default
        return (cur,) if isinstance(cur, str) else cur

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def normalized(self) -> dict[str, frozenset[str]]:
        return {k: frozenset(self.get(k)) for k in self._d}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MultiMap) and self.normalized() == other.normalized()

    __hash__ = None  # type: ignore[assignment]


class MinTracker:
    """The lowest value over named entries, with updates in O(log n): ``(value, name)`` pairs kept in order in
    a ``SortedList`` (sortedcontainers: short sublists, so no update moves or compares more than a few
    thousand entries). Not a heap with lazy deletion: one is rebuilt whole once its stale entries outnumber
    the live ones, and at 100,000 spans a ``heapify`` of 100,000 pairs is one C call that holds the GIL and
    the event loop up to 73 ms during a placement.

    It keeps no map of its own from name to value: the caller says what an entry was (``set(name, value, old)``),
    which the index has in the span's previous facts: a second name-keyed table of every span's checkpoint,
    beside ``span_facts``, would grow in step with it (see ``RecordView``)."""

    def __init__(self) -> None:
        self._ordered: SortedList = SortedList()

    def set(self, name: str, value: int | None, old: int | None) -> None:
        """Entry ``name`` goes from ``old`` (None: absent) to ``value`` (None: removed)."""
        if old == value:
            return
        if old is not None:
            self._ordered.remove((old, name))
        if value is not None:
            self._ordered.add((value, name))

    def __len__(self) -> int:
        return len(self._ordered)

    @property
    def values(self) -> dict[str, int]:
        """name -> value (built: for checks and tests)."""
        return {name: int(value) for value, name in self._ordered}

    def min_excluding(self, exclude: Collection[str] = ()) -> int | None:
        """The lowest value of an entry not in ``exclude`` (None if there is none)."""
        for value, name in self._ordered:
            if name not in exclude:
                return int(value)
        return None


R = TypeVar("R", Span, Dispatcher)


class RecordView(Mapping[str, R]):
    """name -> record, read from the index's facts (each carries its record): the spans and dispatchers are held
    once, in the map of their facts, not also in a second map by name growing in step with it: at 100,000
    dispatchers, maps by name that grow together double their tables in the same write-through (three such maps
    took 2,817 page faults in one event-loop callback)."""

    __slots__ = ("_facts",)

    def __init__(self, facts: dict[str, Any]) -> None:
        self._facts = facts

    def __getitem__(self, name: str) -> R:
        return self._facts[name].record  # type: ignore[no-any-return]

    def get(self, name: str, default: Any = None) -> Any:
        f = self._facts.get(name)
        return default if f is None else f.record

    def __contains__(self, name: object) -> bool:
        return name in self._facts

    def __iter__(self) -> Iterator[str]:
        return iter(self._facts)

    def __len__(self) -> int:
        return len(self._facts)

    def values(self) -> ValuesView[R]:
        return _Values(self)

    def items(self) -> ItemsView[str, R]:
        return _Items(self)

    def __repr__(self) -> str:
        return f"RecordView({dict(self.items())!r})"


class _Values(ValuesView[R]):
    _mapping: RecordView[R]

    def __iter__(self) -> Iterator[R]:
        return (f.record for f in self._mapping._facts.values())


class _Items(ItemsView[str, R]):
    _mapping: RecordView[R]

    def __iter__(self) -> Iterator[tuple[str, R]]:
        return ((n, f.record) for n, f in self._mapping._facts.items())
