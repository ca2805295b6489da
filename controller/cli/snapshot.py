"""One reading of a namespace, as model records: what every command validates and formats. Pure.

:func:`snapshot_from` converts raw listings with ``controller.model.resources`` (a Capture together with
its Lease ``capture-<name>``, as the informer does); objects that do not convert are skipped with a
warning rather than failing the whole command.

Liveness: a capture is alive while ``now < renewTime + leaseDurationSeconds`` of its Lease
(:meth:`controller.model.records.Capture.alive`). The maintainer's informer judges the same rule on its own
clock by watching renewTime change (robust to clock skew); a one-shot command sees each Lease once, so it
compares renewTime with the local clock, and a clock far ahead of the captures' makes them look lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.model import resources as conv
from controller.model.records import Capture, Changefeed, Span, SpanOperator, Table
from controller.model.states import SpanState

JSON = dict[str, Any]


@dataclass(frozen=True)
class Snapshot:
    namespace: str
    now: float
    changefeeds: Mapping[str, Changefeed] = field(default_factory=dict)
    #: Raw ``status`` of each Changefeed, for fields the model may not carry (``status.scheduler``).
    changefeed_status: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    tables: Mapping[str, Table] = field(default_factory=dict)
    spans: Mapping[str, Span] = field(default_factory=dict)
    operators: Mapping[str, SpanOperator] = field(default_factory=dict)
    captures: Mapping[str, Capture] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    # -- per changefeed --------------------------------------------------------------------------

    def spans_of(self, changefeed: str) -> list[Span]:
        """The changefeed's spans (not being deleted), by table, mode and key range."""
        spans = (s for s in self.spans.values() if s.changefeed == changefeed and not s.deleting)
        return sorted(spans, key=lambda s: (s.table_id, s.mode.value, s.key_range))

    def operators_of(self, changefeed: str) -> list[SpanOperator]:
        """The changefeed's operators, oldest first."""
        ops = (o for o in self.operators.values() if o.changefeed == changefeed)
        return sorted(ops, key=lambda o: (o.created, o.name))

    def in_flight(self, changefeed: str) -> list[SpanOperator]:
        return [o for o in self.operators_of(changefeed) if o.in_flight]

    def table_of(self, span: Span) -> Table | None:
        return next(
            (t for t in self.tables.values() if t.changefeed == span.changefeed and t.table_id == span.table_id),
            None,
        )

    def operator_on(self, span: Span) -> SpanOperator | None:
        """An in-flight operator that names ``span`` (in its spec or as a target), if any."""
        for op in self.in_flight(span.changefeed):
            if span.name in op.spans or any(t.span == span.name for t in op.targets):
                return op
        return None

    # -- captures --------------------------------------------------------------------------------

    def alive(self, capture: str) -> bool:
        cap = self.captures.get(capture)
        return cap is not None and cap.alive(self.now)

    def capture_state(self, capture: Capture) -> str:
        """``alive``, ``lost`` (no current Lease), with ``draining`` appended when set."""
        state = "alive" if capture.alive(self.now) else "lost"
        return f"{state}, draining" if capture.draining else state

    def remaining_on(self, capture: str, changefeeds: list[str]) -> tuple[list[Span], list[SpanOperator]]:
        """What keeps a drain of ``capture`` from being done: the spans it holds and the in-flight
        operators that target it, over ``changefeeds``."""
        spans = [s for cf in changefeeds for s in self.spans_of(cf) if s.capture == capture]
        ops = [
            o
            for cf in changefeeds
            for o in self.in_flight(cf)
            if o.target == capture or any(t.capture == capture and not t.done for t in o.targets)
        ]
        return spans, ops


def span_states(spans: list[Span]) -> dict[str, int]:
    """Count per state ("New" for a span whose status was never written)."""
    counts: dict[str, int] = {}
    for s in spans:
        key = s.state.value if s.state is not None else "New"
        counts[key] = counts.get(key, 0) + 1
    order = [st.value for st in SpanState] + ["New"]
    return {k: counts[k] for k in order if k in counts}


def _index(items: list[JSON]) -> dict[str, JSON]:
    out: dict[str, JSON] = {}
    for obj in items:
        meta = obj.get("metadata")
        name = meta.get("name") if isinstance(meta, Mapping) else None
        if isinstance(name, str):
            out[name] = obj
    return out


def snapshot_from(namespace: str, now: float, raw: Mapping[str, list[JSON]]) -> Snapshot:
    """A Snapshot from raw listings keyed by plural: changefeeds, tables, spans, spanoperators,
    captures, leases (any missing key counts as an empty listing)."""
    warnings: list[str] = []

    def convert(plural: str, cls: type[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, obj in _index(raw.get(plural, [])).items():
            try:
                rec = conv.from_resource(obj)
            except conv.InvalidResource as exc:
                warnings.append(f"skipping {exc}")
                continue
            if isinstance(rec, cls):
                out[name] = rec
        return out

    leases = _index(raw.get("leases", []))
    captures: dict[str, Capture] = {}
    for name, obj in _index(raw.get("captures", [])).items():
        try:
            captures[name] = conv.capture_from_resources(obj, leases.get(conv.lease_name(name)))
        except conv.InvalidResource as exc:
            warnings.append(f"skipping {exc}")
    cf_raw = _index(raw.get("changefeeds", []))
    status = {name: obj.get("status") or {} for name, obj in cf_raw.items()}
    return Snapshot(
        namespace=namespace,
        now=now,
        changefeeds=convert("changefeeds", Changefeed),
        changefeed_status={k: v for k, v in status.items() if isinstance(v, Mapping)},
        tables=convert("tables", Table),
        spans=convert("spans", Span),
        operators=convert("spanoperators", SpanOperator),
        captures=captures,
        warnings=tuple(warnings),
    )
