"""The embedded API's CEL: celpy's transpiler answers when it gives a boolean, its interpreter otherwise, and
the answers are the interpreter's (controller/apiserver/schema.py, ``_Cel``)."""

from __future__ import annotations

import celpy
import pytest
from celpy.adapter import json_to_cel

from controller.apiserver.schema import _Cel

TARGET = "!(self.type in ['Add', 'Move']) || (has(self.target) && size(self.target) > 0)"
RULES = [
    ("self.startKey < self.endKey", {"startKey": "74a", "endKey": "74b"}),
    ("self.startKey < self.endKey", {"startKey": "74b", "endKey": "74a"}),
    ("self <= 9223372036854775806", 9223372036854775806),
    ("self <= 9223372036854775806", 5),
    (TARGET, {"type": "Move"}),
    (TARGET, {"type": "Split"}),
    (TARGET, {"type": "Add", "target": ["c"]}),
    ("self.type != 'Merge' || size(self.spans) >= 2", {"type": "Merge", "spans": ["a"]}),
    ("self.x > 0", {}),  # an evaluation error: refused with the interpreter's message
    ("self.all(k, self[k] > 0)", {"a": 1, "b": 2}),
]


def _interpreted(rule: str, value: object) -> object:
    env = celpy.Environment()
    try:
        out = env.program(env.compile(rule)).evaluate({"self": json_to_cel(value)})
    except Exception:
        return "error"
    return bool(out) if isinstance(out, celpy.celtypes.BoolType) else "error"


@pytest.mark.parametrize(("rule", "value"), RULES)
def test_the_answer_is_the_interpreters(rule: str, value: object) -> None:
    cel = _Cel()
    ok, detail = cel.evaluate(rule, value, None, False)
    want = _interpreted(rule, value)
    if want == "error":
        assert not ok
        assert detail.startswith("rule evaluation error")
    else:
        assert (ok, detail) == (want, "")


def test_plain_rules_run_transpiled() -> None:
    cel = _Cel()
    cel.program("self.startKey < self.endKey")
    assert cel._fast["self.startKey < self.endKey"] is not None
