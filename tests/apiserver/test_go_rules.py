"""The Go behaviours the embedded API reproduces, unit by unit (the corpus replay tests them end to end).

Each expected text is one a real kube-apiserver v1.36.2 produced (tests/apiserver/corpus) or Go's own.
"""

from __future__ import annotations

import pytest

from controller.apiserver import gojson, managed
from controller.apiserver.errors import ApiError
from controller.apiserver.gojson import RFC3339, RFC3339_MICRO, TimeParseError
from controller.apiserver.selectors import SelectorError, parse_label_selector


def test_numbers_decode_as_go_int64_and_float64() -> None:
    doc = gojson.loads(b'{"a": 3.0, "b": 2.5, "c": 9223372036854775808, "d": 9223372036854775807, "e": 1e3}')
    assert doc == {"a": 3, "b": 2.5, "c": 2.0**63, "d": 2**63 - 1, "e": 1000}
    assert isinstance(doc["a"], int)  # 3.0 reads back as 3
    assert isinstance(doc["c"], float)  # beyond int64: a float64
    assert gojson.canonical_number(2.0**63) == 9223372036854776000  # Go prints the shortest digits


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "invalid character 'n' looking for beginning of object key string"),
        ("", "unexpected end of JSON input"),
        ("not-a-token", "invalid character 'o' in literal null (expecting 'u')"),
        ('{"a" 1}', "invalid character '1' after object key"),
        ("[1 2]", "invalid character '2' after array element"),
    ],
)
def test_json_syntax_errors_have_gos_text(text: str, message: str) -> None:
    with pytest.raises(gojson.JSONSyntaxError) as exc:
        gojson.loads(text)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("value", "shown"), [(15.0, "15"), (0.5, "0.5"), (-0.5, "-0.5"), (1e6, "1e+06"), (2.0**63, "9.223372036854776e+18")]
)
def test_floats_print_as_gos_percent_v(value: float, shown: str) -> None:
    assert gojson.format_float(value) == shown


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("2020-01-02T03:04:05Z", 'cannot parse "Z" as ".000000"'),
        ("2020-01-02T03:04:05.123Z", 'cannot parse ".123Z" as ".000000"'),
        ("2020-01-02T03:04:05.123456789Z", 'cannot parse "789Z" as "Z07:00"'),
        ("yesterday", 'cannot parse "yesterday" as "2006"'),
    ],
)
def test_microtime_needs_six_fractional_digits(value: str, error: str) -> None:
    with pytest.raises(TimeParseError) as exc:
        gojson.parse_time(value, RFC3339_MICRO)
    assert str(exc.value) == f'parsing time "{value}" as "2006-01-02T15:04:05.000000Z07:00": {error}'


def test_times_with_offsets_and_fractions() -> None:
    assert gojson.parse_time("2020-01-02T05:04:05.000000+02:00", RFC3339_MICRO)[-1] == 7200
    assert gojson.parse_time("2020-01-02T03:04:05.5Z", RFC3339)[6] == 500000  # RFC 3339 takes any fraction


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        ("tier in x", "unable to parse requirement: found 'x' expected: '('"),
        ("tier=a b", "found 'b', expected: ',' or 'end of string'"),
        ("!tier=x", "found '=', expected: ',' or 'end of string'"),
    ],
)
def test_label_selector_errors(selector: str, message: str) -> None:
    with pytest.raises(SelectorError) as exc:
        parse_label_selector(selector)
    assert str(exc.value) == message


def test_label_selector_semantics() -> None:
    def matches(selector: str) -> list[bool]:
        predicate = parse_label_selector(selector)
        assert predicate is not None
        return [predicate({"metadata": {"labels": labels}}) for labels in ({"t": "x"}, {"t": "y"}, {})]

    assert matches("t!=x") == [False, True, True]  # != matches objects without the label
    assert matches("t notin (x)") == [False, True, True]
    assert matches("t in (x,y)") == [True, True, False]
    assert matches("!t") == [False, False, True]


def test_apply_conflicts_force_and_ownership() -> None:
    live = {"spec": {"size": 1, "color": "red"}}
    entries = managed.apply({}, {"spec": {"size": 1, "color": "red"}}, None, "a", "", None, False, "g/v1", "t0")[1]
    assert [e["manager"] for e in entries] == ["a"]
    with pytest.raises(ApiError) as exc:
        managed.apply(live, {"spec": {"size": 9}}, entries, "b", "", None, False, "g/v1", "t1")
    assert exc.value.code == 409
    assert exc.value.message == 'Apply failed with 1 conflict: conflict with "a": .spec.size'
    assert exc.value.details == {
        "causes": [{"reason": "FieldManagerConflict", "message": 'conflict with "a"', "field": ".spec.size"}]
    }
    same, _ = managed.apply(live, {"spec": {"size": 1}}, entries, "b", "", None, False, "g/v1", "t1")
    assert same["spec"] == {"size": 1, "color": "red"}  # the same value: shared, no conflict
    merged, after = managed.apply(live, {"spec": {"size": 9}}, entries, "b", "", None, True, "g/v1", "t2")
    assert merged["spec"] == {"size": 9, "color": "red"}
    owners = {e["manager"]: e["fieldsV1"] for e in after}
    assert owners["b"] == {"f:spec": {".": {}, "f:size": {}}}
    assert "f:size" not in owners["a"]["f:spec"]  # forced: taken from a


def test_an_update_takes_the_fields_it_changes_and_a_removal_frees_them() -> None:
    old = {"spec": {"size": 1, "color": "red"}, "metadata": {"ownerReferences": [{"uid": "u"}]}}
    entries = managed.record(None, "a", "Update", "", "v1", managed.owned(old), {}, "t0")
    new = {"spec": {"size": 2, "color": "red"}}
    changed, removed = managed.diff(old, new)
    after = managed.record(entries, "b", "Update", "", "v1", changed, removed, "t1")
    owners = {e["manager"]: e["fieldsV1"] for e in after}
    assert owners["b"] == {"f:spec": {"f:size": {}}}
    assert owners["a"] == {"f:spec": {".": {}, "f:color": {}}}  # ownerReferences removed: owned by nobody
