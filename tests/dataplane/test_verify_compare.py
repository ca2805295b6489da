"""The comparison rules of ``verify`` over hand-made rows (controller/dataplane/verify.py, its docstring)."""

from __future__ import annotations

import base64

import pytest

from controller.cli import verify as cli_verify
from controller.cli.errors import Refused
from controller.dataplane.verify import COMPACTED, KV, DiffKind, Row, SpanResult, TableResult, compare, needs_point_read
from controller.model.keys import KeyRange, table_key
from controller.model.states import Mode

T = 7
SPAN = KeyRange.of_table(T)
R = 100


def k(name: str) -> bytes:
    return table_key(T) + name.encode()


def live(name: str, value: bytes, revision: int) -> Row:
    return Row(k(name), value, revision, False)


def tomb(name: str, revision: int) -> Row:
    return Row(k(name), None, revision, True)


def kv(name: str, value: bytes, revision: int) -> KV:
    return KV(k(name), value, revision)


def kinds(result: SpanResult) -> list[tuple[DiffKind, bytes]]:
    return [(d.kind, d.key) for d in result.differences]


def test_equal_rows_and_tombstones_are_no_difference() -> None:
    result = compare(SPAN, R, [live("a", b"1", 10), tomb("b", 20), live("c", b"3", R)],
                     [kv("a", b"1", 10), kv("c", b"3", R)])  # fmt: skip
    assert kinds(result) == []
    assert result.keys == 2
    assert (result.ahead, result.unverifiable) == (0, 0)


def test_a_value_that_differs_is_a_mismatch() -> None:
    result = compare(SPAN, R, [live("a", b"corrupt", 10)], [kv("a", b"1", 10)])
    assert kinds(result) == [(DiffKind.MISMATCH, k("a"))]
    d = result.differences[0]
    assert d.row == live("a", b"corrupt", 10)
    assert d.etcd == kv("a", b"1", 10)
    assert d.at == R


def test_a_revision_that_differs_is_a_mismatch() -> None:
    # Downstream holds an older put than etcd's last change at or before R: it missed an update.
    assert kinds(compare(SPAN, R, [live("a", b"1", 10)], [kv("a", b"1", 50)])) == [(DiffKind.MISMATCH, k("a"))]
    # Or claims a revision etcd never wrote the key at.
    assert kinds(compare(SPAN, R, [live("a", b"1", 60)], [kv("a", b"1", 50)])) == [(DiffKind.MISMATCH, k("a"))]


def test_a_key_etcd_holds_without_a_row_is_missing() -> None:
    result = compare(SPAN, R, [live("a", b"1", 10)], [kv("a", b"1", 10), kv("b", b"2", 11)])
    assert kinds(result) == [(DiffKind.MISSING, k("b"))]
    assert result.differences[0].etcd == kv("b", b"2", 11)


def test_a_live_row_etcd_does_not_hold_is_extra() -> None:
    result = compare(SPAN, R, [live("a", b"1", 10), live("z", b"?", 12)], [kv("a", b"1", 10)])
    assert kinds(result) == [(DiffKind.EXTRA, k("z"))]
    assert result.keys == 2  # etcd's one key, and the extra row's


def test_a_tombstone_of_a_key_etcd_holds() -> None:
    # etcd put the key again after the delete: downstream missed that put.
    assert kinds(compare(SPAN, R, [tomb("a", 20)], [kv("a", b"back", 30)])) == [(DiffKind.MISSING, k("a"))]
    # etcd's key is older than the tombstone: downstream deleted a key etcd did not delete.
    assert kinds(compare(SPAN, R, [tomb("a", 20)], [kv("a", b"1", 10)])) == [(DiffKind.MISMATCH, k("a"))]


def test_rows_ahead_of_r_are_verified_at_their_own_revision() -> None:
    rows = [live("a", b"2", 150), tomb("b", 160), live("c", b"new", 170)]
    at_r = [kv("a", b"1", 10), kv("b", b"2", 20)]  # c did not exist at R: no missing, no extra
    assert [needs_point_read(r, R) for r in rows] == [True, True, True]
    reads = {(k("a"), 150): kv("a", b"2", 150), (k("b"), 160): None, (k("c"), 170): kv("c", b"new", 170)}
    result = compare(SPAN, R, rows, at_r, reads)
    assert kinds(result) == []
    assert result.ahead == 3


def test_rows_ahead_of_r_that_differ_at_their_revision() -> None:
    rows = [live("a", b"corrupt", 150), tomb("b", 160), live("c", b"x", 170)]
    reads = {
        (k("a"), 150): kv("a", b"2", 150),  # value differs
        (k("b"), 160): kv("b", b"2", 20),  # etcd did not delete b at 160
        (k("c"), 170): None,  # etcd held no c at 170
    }
    result = compare(SPAN, R, rows, [kv("a", b"1", 10), kv("b", b"2", 20)], reads)
    assert kinds(result) == [(DiffKind.MISMATCH, k("a")), (DiffKind.MISMATCH, k("b")), (DiffKind.EXTRA, k("c"))]
    assert [d.at for d in result.differences] == [150, 160, 170]


def test_a_row_ahead_at_a_compacted_revision_is_unverifiable_not_a_difference() -> None:
    rows = [live("a", b"2", 150), live("b", b"3", 151)]
    result = compare(SPAN, R, rows, [kv("a", b"1", 10)], {(k("a"), 150): COMPACTED})
    assert kinds(result) == []
    assert (result.ahead, result.unverifiable) == (2, 2)  # b's read is not given: unverifiable too


def test_keys_outside_the_span_are_ignored() -> None:
    half = KeyRange(table_key(T), k("m"))
    result = compare(half, R, [live("a", b"1", 10), live("x", b"?", 11)], [kv("a", b"1", 10), kv("y", b"2", 12)])
    assert kinds(result) == []
    assert result.keys == 1


# -- the command's pure parts (controller/cli/verify.py) ---------------------------------------------


def test_the_secrets_the_changefeed_names_and_their_data() -> None:
    raw = {"spec": {"source": {"etcd": {"secretRef": {"name": "src"}}}, "sink": {"postgres": {"secretRef": {}}}}}
    assert cli_verify.secret_names(raw) == ("src", None)
    assert cli_verify.secret_names({}) == (None, None)
    secret = {"data": {"endpoints": base64.b64encode(b"h1:2379, h2:2379").decode(), "bad": "%%"},
              "stringData": {"dsn": "host=x"}}  # fmt: skip
    data = cli_verify.secret_data(secret)
    assert data == {"endpoints": "h1:2379, h2:2379", "dsn": "host=x"}
    assert cli_verify.endpoints_of(data["endpoints"]) == ["h1:2379", "h2:2379"]


def test_the_revision_is_the_checkpoint_or_one_below_it() -> None:
    assert cli_verify.choose_revision(100, None, "cf") == 100
    assert cli_verify.choose_revision(100, 40, "cf") == 40
    for checkpoint, wanted, message in [(0, None, "no checkpoint"), (100, 101, "above"), (100, 0, "positive")]:
        with pytest.raises(Refused, match=message):
            cli_verify.choose_revision(checkpoint, wanted, "cf")


def test_output_summary_and_limited_differences() -> None:
    span = compare(SPAN, R, [live("a", b"x" * 40, 10), live("z", b"?", 12)], [kv("a", b"1", 10), kv("b", b"2", 11)])
    result = TableResult(T, Mode.DEFAULT, [span])
    text = cli_verify.render_result([result], R, limit=2).splitlines()
    assert text[0] == f"table {T} (default): 3 keys at revision {R}: 3 differences"
    assert text[3].split()[:4] == ["mismatch", str(T), "default", k("a").hex()]
    assert "b'xxxxxxxxxxxxxxxxxxx... @10" in text[3]
    assert text[-1] == "... and 1 more (--limit)"
    assert len(text) == 6
    totals = cli_verify.totals([result], R, 5.0)
    assert (totals.revision, totals.differences, totals.keys, totals.at) == (R, 3, 3, 5.0)
