"""The base of the resource conversion (``controller.model.resources``): the labels and annotations, the errors, the
times, where a model field lives in a resource, and the JSON of progress reports and placements. Pure: no I/O."""

from __future__ import annotations

import functools
import json
import math
import re
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, TypeVar

from controller.model.progress import (
    SIDES,
    Progress,
    ProgressEntry,
    Side,
    SinkFigures,
    Trouble,
)
from controller.model.records import (
    Span,
)
from controller.model.states import (
    GROUP,
    Mode,
)

#: The placement the maintainer recorded in a Span it created (``Span.created_capture``/``created_dispatcher``).
PLACEMENT_ANNOTATION = f"{GROUP}/placement"
#: On a Capture whose ``spec.draining`` its own agent set while shutting down (value ``shutdown``): the next
#: process of that capture clears the drain as it starts; a drain a person set (no annotation) stays.
DRAIN_REASON_ANNOTATION = f"{GROUP}/drain-reason"
#: On a capture's Lease, written by the maintainer that takes it (``intents.FenceCapture``): when, by its clock.
#: Informational; what matters is that the take is a write, so that it lands after the decision's view.
FENCED_ANNOTATION = f"{GROUP}/fenced-at"
DRAIN_FOR_SHUTDOWN = "shutdown"


#: Label on every object the maintainer creates, naming its changefeed (selectors, ``kubectl -l``).
CHANGEFEED_LABEL = f"{GROUP}/changefeed"
#: Label of a Dispatcher naming its capture (each capture watches only its own: a label selector).
CAPTURE_LABEL = f"{GROUP}/capture"
#: Label of a Span naming its table's ID (``kubectl get spans -l cdc.maintainer.dev/table-id=7``).
TABLE_ID_LABEL = f"{GROUP}/table-id"
LEASE_API_VERSION = "coordination.k8s.io/v1"
#: Values of ``Table.status.state`` ("" in the model: not yet validated, omitted in the resource).
TABLE_STATES = ("Active", "Invalid", "Removing", "Detached")
#: Scheduler knobs whose minimum is 1 (for the others 0 means off, or, for intervals, every decision).
_AT_LEAST_ONE = frozenset(
    {
        "max_in_flight_operators",
        "basic_batch_size",
        "balance_max_moves",
        "drain_batch_size",
        "split_checks",
        "merge_checks",
    }
)
CONDITION_STATUSES = ("True", "False", "Unknown")
#: Largest ts the resources carry (int64, as the API server stores integers).
MAX_TS = 2**63 - 1
MAX_INT32 = 2**31 - 1

_HEX_KEY = re.compile(r"(?:[0-9a-f]{2})*")
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(?:([Zz])|([+-])(\d{2}):(\d{2}))"
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROS = 1_000_000

E = TypeVar("E", bound=StrEnum)
Obj = dict[str, Any]


class InvalidResource(ValueError):
    """A resource that cannot be converted: ``<Kind> <name>: <field path>: <problem>``."""

    def __init__(self, kind: str, name: str, path: str, problem: str) -> None:
        self.kind = kind
        self.name = name
        self.path = path
        self.problem = problem
        super().__init__(f"{kind} {name}: {path}: {problem}" if path else f"{kind} {name}: {problem}")


def changefeed_labels(changefeed: str) -> tuple[tuple[str, str], ...]:
    """The labels of an object the maintainer creates for ``changefeed``, in the model's form."""
    return ((CHANGEFEED_LABEL, changefeed),)


def span_labels(changefeed: str, table_id: int) -> tuple[tuple[str, str], ...]:
    """The labels of a Span the maintainer creates (a new table's, a hole's, a split's or merge's)."""
    return ((CHANGEFEED_LABEL, changefeed), (TABLE_ID_LABEL, str(table_id)))


def dispatcher_labels(changefeed: str, capture: str) -> tuple[tuple[str, str], ...]:
    """The labels of a Dispatcher the maintainer creates."""
    return ((CAPTURE_LABEL, capture), (CHANGEFEED_LABEL, changefeed))


def lease_name(capture: str) -> str:
    """The name of the ``coordination.k8s.io/v1`` Lease through which ``capture`` shows it is alive."""
    return f"capture-{capture}"


# --------------------------------------------------------------------------------------------------
# Timestamps


def round_time(seconds: float) -> float:
    """``seconds`` rounded to the nearest microsecond: the value a resource round trip gives back."""
    return _micros(seconds) / _MICROS


def _micros(seconds: float) -> int:
    if not math.isfinite(seconds):
        raise ValueError(f"timestamp {seconds!r} is not a finite number")
    return round(seconds * _MICROS)


def format_time(seconds: float, *, micro: bool = False) -> str:
    """RFC 3339 in UTC, to the microsecond (``micro=True``: always six fractional digits)."""
    micros = _micros(seconds)
    try:
        stamp = _EPOCH + timedelta(microseconds=micros)
    except OverflowError:
        raise ValueError(f"timestamp {seconds!r} is out of the range of RFC 3339 (years 1 to 9999)") from None
    text = f"{stamp.year:04d}-{stamp.month:02d}-{stamp.day:02d}T{stamp.hour:02d}:{stamp.minute:02d}:{stamp.second:02d}"
    if micro or stamp.microsecond:
        text += f".{stamp.microsecond:06d}"
    return text + "Z"


def parse_time(text: str | datetime) -> float:
    """Seconds since the epoch of an RFC 3339 timestamp (or an aware datetime; naive is taken as UTC).

    A fraction finer than a microsecond is rounded to the nearest microsecond (half up).
    Raises ``ValueError`` for anything else.
    """
    if isinstance(text, datetime):
        stamp = text if text.tzinfo is not None else text.replace(tzinfo=UTC)
        delta = stamp - _EPOCH
        return ((delta.days * 86400 + delta.seconds) * _MICROS + delta.microseconds) / _MICROS
    return _parse_text(text)


@functools.lru_cache(maxsize=1 << 16)
def _parse_text(text: str) -> float:
    """Memoised: the informer re-converts an object on every watch event, and most of its timestamps
    (creationTimestamp above all) are the same strings every time; parsing was a hot spot at 10k spans."""
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not an RFC 3339 timestamp")
    year, month, day, hour, minute, second = (int(g) for g in match.group(1, 2, 3, 4, 5, 6))
    try:
        stamp = datetime(year, month, day, hour, minute, second, tzinfo=UTC)
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a valid timestamp: {exc}") from None
    nanos = int((match.group(7) or "").ljust(9, "0"))
    if match.group(9):
        offset = timedelta(hours=int(match.group(10)), minutes=int(match.group(11)))
        stamp -= offset if match.group(9) == "+" else -offset
    delta = stamp - _EPOCH
    micros = (delta.days * 86400 + delta.seconds) * _MICROS + (nanos + 500) // 1000
    return micros / _MICROS


#: Resource paths of model fields that are not simply camelCased (relative to spec or status).
_RENAMED: dict[str, tuple[str, ...]] = {
    "table_id": ("tableID",),
    "key_range": ("startKey", "endKey"),
    "pre_split_spans": ("preSplit.spans",),
    "pre_split_keys": ("preSplit.splitKeys",),
    "span_counts": ("spans",),
    "scheduler_status": ("scheduler",),
    "status_reason": ("reason",),
    "last_transition": ("lastTransitionTime",),
    "source_secret": ("source.etcd.secretRef.name",),
    "sink_kind": ("sink",),
    "sink_secret": ("sink.<kind>.secretRef.name",),
}


def resource_paths(model_field: str) -> tuple[str, ...]:
    """Where a model field lives under spec/status (or in a list item): camelCase, or a rename above."""
    if model_field in _RENAMED:
        return _RENAMED[model_field]
    head, *rest = model_field.split("_")
    return (head + "".join(part.title() for part in rest),)


def placement_to_json(span: Span) -> str:
    """The placement recorded at the span's creation, as its annotation ``cdc.maintainer.dev/placement``."""
    return json.dumps({"capture": span.created_capture, "dispatcher": span.created_dispatcher}, separators=(",", ":"))


def placement_from_json(text: object) -> tuple[str, str]:
    """(capture, dispatcher) of a placement annotation; ("", "") if there is none or it does not parse."""
    if not isinstance(text, str):
        return "", ""
    try:
        value = json.loads(text)
    except ValueError:
        return "", ""
    if not isinstance(value, dict):
        return "", ""
    capture, dispatcher = value.get("capture"), value.get("dispatcher")
    if not (isinstance(capture, str) and capture and isinstance(dispatcher, str) and dispatcher):
        return "", ""
    return capture, dispatcher


def progress_to_json(progress: Progress) -> str:
    """A capture's report as the compact JSON its Lease annotation carries."""
    doc = {
        "incarnation": progress.incarnation,
        "at": format_time(progress.at, micro=True),
        "changefeeds": [_entry_to_json(e) for e in progress.entries],
    }
    if progress.sinks:
        doc["sinks"] = [
            {"changefeed": f.changefeed, "collected": f.collected, "tombstones": f.tombstones, "liveRows": f.live_rows}
            for f in progress.sinks
        ]
    if progress.troubles:
        doc["troubles"] = [
            {"changefeed": t.changefeed, "side": t.side.value, "transient": t.transient, "message": t.message}
            for t in progress.troubles
        ]
    return json.dumps(doc, separators=(",", ":"))


def _entry_to_json(e: ProgressEntry) -> dict[str, object]:
    doc: dict[str, object] = {
        "changefeed": e.changefeed,
        "mode": e.mode.value,
        "checkpointTs": e.checkpoint_ts,
        "dispatchers": e.dispatchers,
        "digest": e.digest,
        "slowest": e.slowest,
    }
    if e.checkpoint_time is not None:
        doc["checkpointTime"] = round(e.checkpoint_time, 3)
    return doc


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def progress_from_json(text: object) -> Progress | None:
    """The report in a Lease annotation, or None if there is none or it does not parse (never raises)."""
    if not isinstance(text, str) or not text:
        return None
    try:
        doc = json.loads(text)
        entries = []
        for item in doc["changefeeds"]:
            ts, count = item["checkpointTs"], item["dispatchers"]
            if not (isinstance(ts, int) and isinstance(count, int)) or isinstance(ts, bool) or ts < 0 or count < 0:
                return None
            digest = item["digest"]
            if not isinstance(digest, str) or not isinstance(item["changefeed"], str):
                return None
            when = item.get("checkpointTime")
            if when is not None and (
                isinstance(when, bool) or not isinstance(when, int | float) or not 0 <= when < math.inf
            ):
                return None
            entries.append(
                ProgressEntry(
                    changefeed=item["changefeed"],
                    mode=Mode(item["mode"]),
                    checkpoint_ts=ts,
                    dispatchers=count,
                    digest=digest,
                    slowest=str(item.get("slowest") or ""),
                    checkpoint_time=None if when is None else float(when),
                )
            )
        troubles = []
        for item in doc.get("troubles") or ():
            changefeed, side, transient, message = item["changefeed"], item["side"], item["transient"], item["message"]
            if not (isinstance(changefeed, str) and isinstance(transient, bool) and isinstance(message, str)):
                return None
            if side in SIDES:  # a side this version does not know (a newer capture's) is not one it can show
                troubles.append(Trouble(changefeed=changefeed, side=Side(side), transient=transient, message=message))
        sinks = []
        for item in doc.get("sinks") or ():
            numbers = (item["collected"], item["tombstones"], item["liveRows"])
            if not isinstance(item["changefeed"], str) or not all(_count(n) for n in numbers):
                return None
            sinks.append(SinkFigures(changefeed=item["changefeed"], collected=numbers[0], tombstones=numbers[1],
                                     live_rows=numbers[2]))  # fmt: skip
        incarnation = doc["incarnation"]
        if not isinstance(incarnation, str):
            return None
        return Progress(
            incarnation=incarnation,
            at=parse_time(doc["at"]),
            entries=tuple(entries),
            troubles=tuple(troubles),
            sinks=tuple(sinks),
        )
    except (ValueError, KeyError, TypeError, AttributeError):  # json.JSONDecodeError is a ValueError
        return None
