"""Key ranges: table ranges, split_at validation, even splits, gaps and overlaps."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.model.keys import MAX_TABLE_ID, KeyError_, KeyRange, gaps, overlapping_pairs, regions_touched, table_key


def k(*bs: int) -> bytes:
    return bytes(bs)


R = KeyRange(k(0x10), k(0x20))


def test_table_range_is_t_plus_big_endian_id():
    rng = KeyRange.of_table(1)
    assert rng.start == b"t" + b"\x00" * 7 + b"\x01"
    assert rng.end == b"t" + b"\x00" * 7 + b"\x02"
    assert KeyRange.of_table(1).end == KeyRange.of_table(2).start
    assert not KeyRange.of_table(1).overlaps(KeyRange.of_table(2))
    assert KeyRange.of_table(255).contains_key(table_key(255) + b"\xff" * 10)
    assert not KeyRange.of_table(255).contains_key(table_key(256))


@pytest.mark.parametrize("table_id", [-1, MAX_TABLE_ID + 2])
def test_table_id_out_of_range(table_id):
    with pytest.raises(KeyError_):
        table_key(table_id)


def test_empty_range_refused():
    with pytest.raises(KeyError_):
        KeyRange(k(1), k(1))
    with pytest.raises(KeyError_):
        KeyRange(k(2), k(1))


def test_from_hex_and_bad_hex():
    assert KeyRange.from_hex("10", "20") == R
    assert R.hex() == ("10", "20")
    with pytest.raises(KeyError_):
        KeyRange.from_hex("zz", "20")


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ([k(0x18)], [(k(0x10), k(0x18)), (k(0x18), k(0x20))]),
        ([k(0x11), k(0x12)], [(k(0x10), k(0x11)), (k(0x11), k(0x12)), (k(0x12), k(0x20))]),
        ([k(0x10, 0)], [(k(0x10), k(0x10, 0)), (k(0x10, 0), k(0x20))]),
    ],
)
def test_split_at_valid(keys, expected):
    assert [(r.start, r.end) for r in R.split_at(keys)] == expected


@pytest.mark.parametrize(
    "keys",
    [
        [k(0x10)],  # equal to start
        [k(0x20)],  # equal to end
        [k(0x05)],  # below
        [k(0x30)],  # above
        [k(0x18), k(0x12)],  # not increasing
        [k(0x18), k(0x18)],  # duplicate
    ],
)
def test_split_at_invalid(keys):
    with pytest.raises(KeyError_, match="strictly increasing and strictly inside"):
        R.split_at(keys)


def test_even_split_too_narrow_and_bad_count():
    with pytest.raises(KeyError_):
        KeyRange(k(1), k(1, 0)).even_split_keys(2)
    with pytest.raises(KeyError_):
        R.even_split_keys(0)
    assert R.even_split_keys(1) == ()


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**12), st.integers(2, 128))
def test_even_split_keys_ordered_inside_and_partition(table_id, n):
    rng = KeyRange.of_table(table_id)
    keys = rng.even_split_keys(n)
    assert len(keys) == n - 1
    assert list(keys) == sorted(set(keys))
    assert all(rng.start < key < rng.end for key in keys)
    parts = rng.split_at(keys)
    assert (parts[0].start, parts[-1].end) == (rng.start, rng.end)
    assert all(a.end == b.start for a, b in itertools.pairwise(parts))
    assert gaps(rng, list(parts)) == []
    assert overlapping_pairs([(str(i), p) for i, p in enumerate(parts)]) == []


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=6), st.binary(min_size=1, max_size=6), st.integers(2, 16))
def test_even_split_keys_arbitrary_bounds(a, b, n):
    if a == b:
        return
    rng = KeyRange(min(a, b), max(a, b))
    try:
        keys = rng.even_split_keys(n)
    except KeyError_:
        return  # too narrow is a clean refusal
    assert all(rng.start < key < rng.end for key in keys)
    assert list(keys) == sorted(set(keys))


@pytest.mark.parametrize(
    ("parts", "holes"),
    [
        ([], [(0x10, 0x20)]),
        ([(0x10, 0x20)], []),
        ([(0x10, 0x14), (0x16, 0x20)], [(0x14, 0x16)]),
        ([(0x12, 0x14)], [(0x10, 0x12), (0x14, 0x20)]),
        ([(0x00, 0x12), (0x11, 0x30)], []),  # overlaps and overhang cover everything
        ([(0x30, 0x40)], [(0x10, 0x20)]),  # outside
        ([(0x14, 0x16), (0x10, 0x12)], [(0x12, 0x14), (0x16, 0x20)]),  # unsorted input
    ],
)
def test_gaps(parts, holes):
    got = gaps(R, [KeyRange(k(a), k(b)) for a, b in parts])
    assert got == [KeyRange(k(a), k(b)) for a, b in holes]


@pytest.mark.parametrize(
    ("parts", "pairs"),
    [
        ([("a", 0x10, 0x14), ("b", 0x14, 0x20)], []),
        ([("a", 0x10, 0x15), ("b", 0x14, 0x20)], [("a", "b")]),
        ([("a", 0x10, 0x20), ("b", 0x12, 0x13), ("c", 0x18, 0x19)], [("a", "b"), ("a", "c")]),
        ([("x", 0x10, 0x20), ("y", 0x10, 0x20)], [("x", "y")]),
        ([("b", 0x14, 0x20), ("a", 0x10, 0x15)], [("a", "b")]),
    ],
)
def test_overlapping_pairs(parts, pairs):
    assert overlapping_pairs([(n, KeyRange(k(a), k(b))) for n, a, b in parts]) == pairs


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), max_size=25), st.integers(0, 70), st.integers(1, 20))
def test_overlapping_dispatchers_index_agrees_with_a_scan(ranges: list[tuple[int, int]], qs: int, ql: int) -> None:
    """Tick.overlapping_dispatchers bisects a sorted index; it must find exactly what a full scan finds."""
    from controller.engine.world import Options, Tick, World
    from controller.model.records import Changefeed, Dispatcher
    from controller.model.states import Mode

    def key(i: int) -> bytes:
        return b"t" + i.to_bytes(2, "big")

    ds = {
        f"d{n}": Dispatcher(
            name=f"d{n}", changefeed="cf", span=f"s{n}", table_id=1, key_range=KeyRange(key(a), key(a + w)),
            capture="c", start_ts=0, epoch=1,
        )
        for n, (a, w) in enumerate(ranges)
    }  # fmt: skip
    tick = Tick(World(now=0.0, changefeed=Changefeed(name="cf"), dispatchers=ds), 1, Options())
    q = KeyRange(key(qs), key(qs + ql))
    got = [d.name for d in tick.overlapping_dispatchers(1, Mode.DEFAULT, q)]
    assert got == sorted(n for n, d in ds.items() if d.key_range.overlaps(q))


@settings(max_examples=300, deadline=None)
@given(
    regions=st.integers(min_value=1, max_value=100_000),
    pieces=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=6),
    run=st.tuples(st.integers(min_value=0, max_value=40), st.integers(min_value=1, max_value=40)),
)
def test_the_regions_of_adjacent_spans_add_up_to_at_least_those_of_their_merge(
    regions: int, pieces: list[int], run: tuple[int, int]
) -> None:
    """A table cut unevenly (splits of splits), and any run of adjacent spans: the regions the spans touch
    add up to at least the regions their merge touches, so a merge of spans judged under the split
    threshold never makes one above it (simulator seed 20626: with counts rounded to nearest, five spans
    of 10 regions each merged into one of 51, which was split again, forever)."""
    table = KeyRange.of_table(7)
    spans = [table]
    for n in pieces:  # cut the widest span in n + 1 even pieces, again and again
        widest = max(range(len(spans)), key=lambda i: spans[i].share_of(table))
        spans[widest : widest + 1] = spans[widest].split_at(spans[widest].even_split_keys(n + 1))
    first = run[0] % len(spans)
    chosen = spans[first : first + run[1]]
    merged = KeyRange(chosen[0].start, chosen[-1].end)
    parts = sum(regions_touched(regions, s, table) for s in chosen)
    assert parts >= regions_touched(regions, merged, table)
    assert regions_touched(regions, table, table) == regions
    # Each span touches at least the regions its share covers, and at most two more (one at each end).
    for s in chosen:
        share = regions * s.share_of(table)
        assert share - 1e-6 <= regions_touched(regions, s, table) <= share + 2


def test_float_noise_in_the_shares_adds_no_region() -> None:
    """Found by the property test above: a table cut in 3 (keys truncated, so the last third is a hair over a
    third), the last third cut in 2; with counts from float shares (rounded to 9 decimals) each half of 6
    regions counted 1 and their merge 3, above the parts. Counted exactly from the keys' offsets."""
    table = KeyRange.of_table(7)
    thirds = table.split_at(table.even_split_keys(3))
    halves = thirds[2].split_at(thirds[2].even_split_keys(2))
    parts = [regions_touched(6, h, table) for h in halves]
    assert sum(parts) >= regions_touched(6, thirds[2], table) == 3
    assert parts == [2, 2]  # each half crosses a region boundary (at 2/3 + a hair, and at 5/6 + a hair)


def test_a_span_counts_every_region_it_touches() -> None:
    whole = KeyRange(b"t\x00", b"t\x01")  # a width of 2**(8*6) in offsets: the fractions below are exact

    def part(lo: float, hi: float) -> KeyRange:
        def key(x: float) -> bytes:
            return b"t" + round(x * 2**40).to_bytes(6, "big").rstrip(b"\0")

        return KeyRange(key(lo), key(hi) if hi < 1 else whole.end)

    shares = (1 / 1024, 1 / 16, 1 / 16 + 1 / 1024, 1 / 4, 1.0)  # binary fractions: exact keys
    assert [regions_touched(256, part(0, s), whole) for s in shares] == [1, 16, 17, 64, 256]
    assert regions_touched(256, part(1 / 2, 1 / 2 + 1 / 1024), whole) == 1  # inside region 128
    assert regions_touched(256, part(1 / 2 + 1 / 1024, 1 / 2 + 5 / 1024), whole) == 2  # across 128 | 129
    assert regions_touched(0, part(0, 0.5), whole) == 0
    assert regions_touched(256, KeyRange(b"u", b"v"), whole) == 0  # outside the table
    # Five fifths of 254 regions: 50.8 each, so 51 or 52 each (a fifth starts inside a region); the whole is
    # 254, never more than the parts.
    fifths = whole.split_at(whole.even_split_keys(5))
    assert sum(regions_touched(254, f, whole) for f in fifths) >= regions_touched(254, whole, whole) == 254
