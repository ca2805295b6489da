"""Deterministic names.

Everything the maintainer creates is named from the facts that caused it, so that re-issuing a create
after a crash hits AlreadyExists instead of making a second object:

- a span made by hole repair or pre-split: from its changefeed, table, mode and key range;
- a split child or merged span: from the operator and the child's range;
- a dispatcher: from its span, the operator creating it, and the epoch and attempt (a dispatcher
  refused for a stale epoch is replaced under a new name, never re-created under the old one);
- a scheduler or maintainer operator: from its type, its span(s) and their resourceVersions, so
  the same decision from the same snapshot names the same operator.

Names stay DNS-1123 subdomains well under 253 characters.
"""

from __future__ import annotations

import hashlib

from controller.model.keys import KeyRange
from controller.model.states import Mode, OpType


def _digest(*parts: object, length: int = 10) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:length]


def _mode_letter(mode: Mode) -> str:
    return "d" if mode is Mode.DEFAULT else "r"


def _trim(prefix: str, limit: int = 200) -> str:
    return prefix[:limit].rstrip("-.")


def span_name(changefeed: str, table_id: int, mode: Mode, key_range: KeyRange) -> str:
    return f"{_trim(changefeed, 120)}-t{table_id}-{_mode_letter(mode)}-{_digest(key_range.start, key_range.end)}"


def child_span_name(operator: str, key_range: KeyRange, changefeed: str, table_id: int, mode: Mode) -> str:
    digest = _digest(operator, key_range.start, key_range.end)
    return f"{_trim(changefeed, 120)}-t{table_id}-{_mode_letter(mode)}-{digest}"


def dispatcher_name(span: str, operator: str, epoch: int, attempt: int = 0) -> str:
    return f"{_trim(span)}-{_digest(operator, epoch, attempt, length=6)}"


def operator_name(type_: OpType, spans: tuple[str, ...], basis: tuple[object, ...]) -> str:
    head = spans[0] if len(spans) == 1 else f"{len(spans)}spans"
    return f"{type_.value.lower()}-{_trim(head, 180)}-{_digest(type_, spans, basis, length=8)}"
