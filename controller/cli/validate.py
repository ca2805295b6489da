"""Checks before anything is written, and the SpanOperators the commands create. Pure.

Every check raises :class:`~controller.cli.errors.Refused` (or ``NotFound``) with a one-line message.
They mirror the maintainer's own validation (``controller.engine.operators``), which stays the
authority: the plugin refuses early what the maintainer would fail, with a clearer message, and is
stricter in one way: it only operates on Replicating spans that no in-flight operator names.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from typing import Any

from controller.cli.errors import NotFound, Refused
from controller.cli.snapshot import Snapshot
from controller.engine.operators.split import MAX_PIECES
from controller.model import resources as conv
from controller.model.keys import KeyError_, KeyRange, key_from_hex
from controller.model.records import Capture, Span, SpanOperator
from controller.model.states import OpSource, OpType, SpanState

JSON = dict[str, Any]
#: Most spans one SpanOperator may name, and split keys one Split may carry (the CRD's bounds).
MAX_SPANS = 128
MAX_SPLIT_KEYS = 127
#: Longest split key in bytes: the CRD allows 8192 hex digits per key.
MAX_KEY_BYTES = 4096
#: A label value (Kubernetes): at most 63 characters, alphanumerics at both ends, ``-_.`` inside.
MAX_LABEL_VALUE = 63
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


def resolve_changefeed(names: Iterable[str], wanted: str | None, namespace: str) -> str:
    """``wanted`` if it exists, else the only Changefeed of the namespace."""
    existing = sorted(names)
    if wanted:
        if wanted not in existing:
            raise NotFound(f"changefeed {wanted!r} not found in namespace {namespace!r}")
        return wanted
    if not existing:
        raise NotFound(f"no Changefeed in namespace {namespace!r}")
    if len(existing) > 1:
        raise Refused(
            f"namespace {namespace!r} has {len(existing)} changefeeds ({', '.join(existing)}): pick one with -c"
        )
    return existing[0]


def parse_keys(texts: Sequence[str]) -> tuple[bytes, ...]:
    """Hex keys (upper or lower case, an optional ``0x``) as bytes."""
    keys = []
    for text in texts:
        raw = text[2:] if text.lower().startswith("0x") else text
        if not raw:
            raise Refused(f"split key {text!r} is empty")
        try:
            keys.append(key_from_hex(raw))
        except KeyError_:
            raise Refused(f"split key {text!r} is not hex (two digits per byte)") from None
    return tuple(keys)


# -- spans and captures ----------------------------------------------------------------------------


def find_span(snap: Snapshot, changefeed: str, name: str) -> Span:
    span = snap.spans.get(name)
    if span is None:
        raise NotFound(f"span {name!r} not found in namespace {snap.namespace!r}")
    if span.changefeed != changefeed:
        raise Refused(f"span {name!r} belongs to changefeed {span.changefeed!r}, not {changefeed!r}")
    if span.deleting:
        raise Refused(f"span {name!r} is being deleted")
    return span


def require_idle(snap: Snapshot, span: Span) -> None:
    """Replicating, and no in-flight operator names it."""
    op = snap.operator_on(span)
    if op is not None:
        raise Refused(f"span {span.name!r} is busy: operator {op.name!r} ({op.type}, {op.phase}) is working on it")
    if span.state is not SpanState.REPLICATING:
        state = span.state.value if span.state is not None else "not yet accepted by the maintainer"
        raise Refused(f"span {span.name!r} is {state}, not Replicating")


def require_capture(snap: Snapshot, name: str) -> Capture:
    """A capture that may receive spans: exists, alive (Lease renewed), not draining."""
    capture = snap.captures.get(name)
    if capture is None:
        raise NotFound(f"capture {name!r} not found in namespace {snap.namespace!r}")
    if not capture.alive(snap.now):
        raise Refused(f"capture {name!r} is not alive (its Lease {conv.lease_name(name)!r} is not renewed)")
    if capture.draining:
        raise Refused(f"capture {name!r} is draining")
    return capture


def find_capture(snap: Snapshot, name: str) -> Capture:
    capture = snap.captures.get(name)
    if capture is None:
        raise NotFound(f"capture {name!r} not found in namespace {snap.namespace!r}")
    return capture


# -- operators -------------------------------------------------------------------------------------


def require_label_value(changefeed: str) -> None:
    """The changefeed's name fits the value of the label ``cdc.maintainer.dev/changefeed`` an operator
    carries (the API refuses the create otherwise)."""
    if len(changefeed) > MAX_LABEL_VALUE:
        raise Refused(
            f"changefeed name {changefeed!r} is {len(changefeed)} characters: the label {conv.CHANGEFEED_LABEL} "
            f"of a SpanOperator takes at most {MAX_LABEL_VALUE}"
        )
    if not _LABEL_VALUE.fullmatch(changefeed):
        raise Refused(
            f"changefeed name {changefeed!r} is not a valid value of the label {conv.CHANGEFEED_LABEL} "
            f"(alphanumerics at both ends, '-', '_' or '.' inside)"
        )


def _operator(
    snap: Snapshot, changefeed: str, name: str, type_: OpType, spans: tuple[str, ...], **spec: Any
) -> SpanOperator:
    require_label_value(changefeed)
    return SpanOperator(
        name=name,
        namespace=snap.namespace,
        changefeed=changefeed,
        type=type_,
        spans=spans,
        source=OpSource.USER,
        reason="kubectl changefeed",
        labels=conv.changefeed_labels(changefeed),
        **spec,
    )


def plan_move(snap: Snapshot, changefeed: str, span_name: str, capture: str, name: str) -> SpanOperator:
    span = find_span(snap, changefeed, span_name)
    require_idle(snap, span)
    require_capture(snap, capture)
    if span.capture == capture:
        raise Refused(f"span {span.name!r} is already on capture {capture!r}")
    return _operator(snap, changefeed, name, OpType.MOVE, (span.name,), target=capture)


def plan_split(
    snap: Snapshot, changefeed: str, span_name: str, name: str, *, into: int = 0, keys: Sequence[bytes] = ()
) -> tuple[SpanOperator, tuple[KeyRange, ...]]:
    """The Split and the ranges it will make. Exactly one of ``into`` (>= 2) and ``keys``."""
    if bool(into) == bool(keys):
        raise Refused("split needs exactly one of --into N and --at KEY...")
    span = find_span(snap, changefeed, span_name)
    require_idle(snap, span)
    table = snap.table_of(span)
    if table is None or table.deleting:
        raise Refused(f"table {span.table_id} of span {span.name!r} does not exist or is being deleted")
    if not table.splittable:
        raise Refused(f"table {table.name!r} (id {table.table_id}) is not splittable")
    rng = span.key_range
    if keys:
        if len(keys) > MAX_SPLIT_KEYS:
            raise Refused(f"at most {MAX_SPLIT_KEYS} split keys, got {len(keys)}")
        for key in keys:
            if len(key) > MAX_KEY_BYTES:
                raise Refused(
                    f"split key {key[:8].hex()}... is {len(key)} bytes: at most {MAX_KEY_BYTES} "
                    f"({2 * MAX_KEY_BYTES} hex digits)"
                )
        for key in keys:
            if not (rng.start < key < rng.end):
                raise Refused(f"split key {key.hex()} is not strictly inside span {span.name!r} {rng}")
        for a, b in itertools.pairwise(keys):
            if not a < b:
                raise Refused(f"split keys must be strictly increasing: {b.hex()} follows {a.hex()}")
        cut = tuple(keys)
        op = _operator(snap, changefeed, name, OpType.SPLIT, (span.name,), split_keys=cut)
    else:
        if not 2 <= into <= MAX_PIECES:
            raise Refused(f"--into must be between 2 and {MAX_PIECES}, got {into}")
        try:
            cut = rng.even_split_keys(into)
        except KeyError_ as exc:
            raise Refused(f"span {span.name!r}: {exc}") from None
        op = _operator(snap, changefeed, name, OpType.SPLIT, (span.name,), split_into=into)
    return op, rng.split_at(cut)


def plan_merge(snap: Snapshot, changefeed: str, span_names: Sequence[str], name: str) -> tuple[SpanOperator, KeyRange]:
    """The Merge and the range of the merged span."""
    if len(span_names) < 2:
        raise Refused(f"merge needs at least two spans, got {len(span_names)}")
    if len(span_names) > MAX_SPANS:
        raise Refused(f"merge takes at most {MAX_SPANS} spans, got {len(span_names)}")
    twice = sorted({n for n in span_names if span_names.count(n) > 1})
    if twice:
        raise Refused(f"merge names span {twice[0]!r} more than once")
    spans = [find_span(snap, changefeed, n) for n in span_names]
    for span in spans:
        require_idle(snap, span)
    first = spans[0]
    for span in spans[1:]:
        if (span.table_id, span.mode) != (first.table_id, first.mode):
            raise Refused(
                f"spans of one table and mode only: {first.name!r} is table {first.table_id}/{first.mode}, "
                f"{span.name!r} is table {span.table_id}/{span.mode}"
            )
    ordered = sorted(spans, key=lambda s: s.key_range)
    for a, b in itertools.pairwise(ordered):
        if a.key_range.end != b.key_range.start:
            raise Refused(
                f"spans {a.name!r} {a.key_range} and {b.name!r} {b.key_range} are not adjacent "
                f"(their key ranges do not meet)"
            )
    op = _operator(snap, changefeed, name, OpType.MERGE, tuple(s.name for s in ordered))
    return op, KeyRange(ordered[0].key_range.start, ordered[-1].key_range.end)


def operator_name(type_: OpType, suffix: str) -> str:
    """``<type>-<suffix>``, e.g. ``move-3f9a1c``."""
    return f"{type_.value.lower()}-{suffix}"


def operator_body(op: SpanOperator) -> JSON:
    """The resource to create: the operator without a status (the maintainer writes that)."""
    body = conv.to_resource(op)
    body.pop("status", None)
    return body
