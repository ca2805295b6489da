"""Key ranges over raw bytes.

Keys are compared as byte strings (lexicographically), as TiKV does. A table's key range is
``[t<id>, t<id+1>)`` where ``t<id>`` is the byte ``t`` followed by the table ID as an 8-byte big-endian
integer, so every key of table ``id`` sorts inside that range and tables never interleave.

Resources carry keys as lower-case hex strings (``startKey``/``endKey``), because keys are arbitrary bytes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from controller.model.ordering import in_order

TABLE_PREFIX = b"t"
MAX_TABLE_ID = 2**63 - 2


class KeyError_(ValueError):
    """A key or range that cannot be valid (bad hex, empty range)."""


def table_key(table_id: int) -> bytes:
    """The first key of table ``table_id``: ``t`` + 8-byte big-endian id."""
    if not 0 <= table_id <= MAX_TABLE_ID + 1:
        raise KeyError_(f"table id {table_id} is out of range 0..{MAX_TABLE_ID}")
    return TABLE_PREFIX + table_id.to_bytes(8, "big")


def table_id_of(key_range: KeyRange) -> int | None:
    """The table whose keys ``key_range`` starts in (None for a start key outside every table's range)."""
    start = key_range.start
    if len(start) < 9 or start[:1] != TABLE_PREFIX:
        return None
    return int.from_bytes(start[1:9], "big")


def key_to_hex(key: bytes) -> str:
    return key.hex()


def key_from_hex(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except (ValueError, TypeError) as exc:
        raise KeyError_(f"{text!r} is not a hex-encoded key: {exc}") from None


@dataclass(frozen=True, order=True, slots=True)
class KeyRange:
    """A half-open key range ``[start, end)``; ``start < end`` always holds."""

    start: bytes
    end: bytes

    def __post_init__(self) -> None:
        if not self.start < self.end:
            raise KeyError_(f"empty key range: start {self.start.hex()} is not below end {self.end.hex()}")

    @classmethod
    def of_table(cls, table_id: int) -> KeyRange:
        return cls(table_key(table_id), table_key(table_id + 1))

    @classmethod
    def from_hex(cls, start: str, end: str) -> KeyRange:
        return cls(key_from_hex(start), key_from_hex(end))

    def contains_range(self, other: KeyRange) -> bool:
        return self.start <= other.start and other.end <= self.end

    def contains_key(self, key: bytes) -> bool:
        return self.start <= key < self.end

    def overlaps(self, other: KeyRange) -> bool:
        return self.start < other.end and other.start < self.end

    def split_at(self, keys: list[bytes] | tuple[bytes, ...]) -> tuple[KeyRange, ...]:
        """Cut this range at ``keys``, which must be strictly increasing and strictly inside."""
        bounds = [self.start, *keys, self.end]
        for lo, hi in itertools.pairwise(bounds):
            if not lo < hi:
                raise KeyError_(
                    f"split keys must be strictly increasing and strictly inside "
                    f"[{self.start.hex()}, {self.end.hex()}): {[k.hex() for k in keys]}"
                )
        return tuple(KeyRange(lo, hi) for lo, hi in itertools.pairwise(bounds))

    def even_split_keys(self, pieces: int) -> tuple[bytes, ...]:
        """Keys that cut this range into ``pieces`` parts of about equal key-space width.

        Both bounds are padded with zero bytes to a common length and read as big integers; the cut
        points are interpolated and trailing zero bytes are dropped (which keeps order, see tests).
        """
        if pieces < 1:
            raise KeyError_(f"cannot split into {pieces} pieces")
        width = max(len(self.start), len(self.end)) + 4
        lo = int.from_bytes(self.start.ljust(width, b"\0"), "big")
        hi = int.from_bytes(self.end.ljust(width, b"\0"), "big")
        keys: list[bytes] = []
        for i in range(1, pieces):
            point = lo + (hi - lo) * i // pieces
            key = point.to_bytes(width, "big").rstrip(b"\0")
            if (keys and key <= keys[-1]) or key <= self.start or key >= self.end:
                raise KeyError_(f"range [{self.start.hex()}, {self.end.hex()}) is too narrow for {pieces} pieces")
            keys.append(key)
        return tuple(keys)

    def share_of(self, outer: KeyRange) -> float:
        """The fraction of ``outer``'s key space (as ``even_split_keys`` measures it) this range covers.

        Keys are read as big integers padded to a common width, so the shares of the pieces of an
        even split add up to 1. Parts of this range outside ``outer`` do not count.
        """
        where = self.offsets_in(outer)
        if where is None:
            return 0.0
        lo, hi, total = where
        return (hi - lo) / total

    def offsets_in(self, outer: KeyRange) -> tuple[int, int, int] | None:
        """Where the part of this range inside ``outer`` lies, exactly: (start, end, width of ``outer``) as
        integers measured from ``outer.start`` (keys read as big integers padded to a common width, as
        :meth:`share_of` measures); None if no part of it is inside."""
        lo_key, hi_key = max(self.start, outer.start), min(self.end, outer.end)
        if not lo_key < hi_key:
            return None
        width = max(len(outer.start), len(outer.end), len(lo_key), len(hi_key)) + 4

        def num(key: bytes) -> int:
            return int.from_bytes(key.ljust(width, b"\0"), "big")

        base = num(outer.start)
        return num(lo_key) - base, num(hi_key) - base, num(outer.end) - base

    def hex(self) -> tuple[str, str]:
        return key_to_hex(self.start), key_to_hex(self.end)

    def __str__(self) -> str:
        return f"[{self.start.hex()}, {self.end.hex()})"


def gaps(outer: KeyRange, parts: list[KeyRange]) -> list[KeyRange]:
    """The sub-ranges of ``outer`` that no range in ``parts`` covers, in key order."""
    holes: list[KeyRange] = []
    cursor = outer.start
    for part in in_order(parts, key=None):
        if part.end <= cursor or part.start >= outer.end:
            continue
        if part.start > cursor:
            holes.append(KeyRange(cursor, min(part.start, outer.end)))
        cursor = max(cursor, part.end)
        if cursor >= outer.end:
            break
    if cursor < outer.end:
        holes.append(KeyRange(cursor, outer.end))
    return holes


def overlapping_pairs(parts: list[tuple[str, KeyRange]]) -> list[tuple[str, str]]:
    """Pairs of named ranges that overlap (sweep over the ranges sorted by start)."""
    ordered = in_order(parts, key=lambda p: (p[1].start, p[1].end, p[0]))
    pairs: list[tuple[str, str]] = []
    active: list[tuple[str, KeyRange]] = []
    for name, rng in ordered:
        active = [(n, r) for n, r in active if r.end > rng.start]
        pairs.extend((n, name) for n, _ in active)
        active.append((name, rng))
    return pairs


def regions_touched(table_regions: int, span: KeyRange, table: KeyRange) -> int:
    """How many of a table's ``table_regions`` (spread evenly over its key space ``table``) the part of
    ``span`` inside it touches: every region overlapping the span counts, as TiKV reports every region
    overlapping a span, so a region crossing a span's boundary counts for the spans on both sides of it.
    So the counts of adjacent spans add up to at least the count of the span they would merge into: a
    merge of spans judged small enough never makes a span the split scheduler would cut again (rounding to
    nearest would, and the two schedulers would take turns on one table for ever). Counted
    exactly, in integers from the keys' offsets (a span ``[a, b)`` of a table of width ``w`` touches the
    regions ``floor(a*R/w)`` to ``ceil(b*R/w) - 1``): floats of the shares could put a merged span a hair
    over the sum of its parts and add a region (the property test found 6 regions, pieces [2, 1])."""
    where = span.offsets_in(table)
    if table_regions <= 0 or where is None:
        return 0
    lo, hi, width = where
    first = lo * table_regions // width
    end = -(-hi * table_regions // width)
    return end - first
