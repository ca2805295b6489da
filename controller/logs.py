"""One log schema for every process of the project (maintainer, capture agent, embedded API, demo).

``--log-format json`` (the default) writes one JSON object per line to stderr::

    {"ts": "2025-01-02T03:04:05.123456Z", "level": "info", "logger": "controller.capture",
     "msg": "registered", "capture": "c1", "lease": "capture-c1"}

* ``ts``: when the record was made, RFC 3339 in UTC, always six fractional digits and ``Z``.
* ``level``: ``debug``, ``info``, ``warning``, ``error`` or ``critical``.
* ``logger``: the Python logger (``controller.capture``, ``controller.maintainer``, ``kopf.activities.probe``...).
* ``msg``: the message, formatted.
* ``error`` and ``stacktrace``, when the record carries an exception (``log.exception``): the exception as
  ``Type: text`` (unless the call site gave an ``error`` field of its own) and the whole traceback.
* ``object``: the Kubernetes object a record of Kopf's per-object loggers is about (``apiVersion``, ``kind``,
  ``namespace``, ``name``, ``uid``), the key Kopf's own JSON format used.
* Any structured field the call site adds with ``extra=fields(...)`` (``changefeed``, ``capture``,
  ``dispatcher``, ``epoch``...). A field never replaces one of the keys above.

``--log-format plain`` renders the same keys as one line of text for people (``ts LEVEL logger: msg
key=value...``; a traceback follows on its own lines). Call sites stay plain ``logging`` calls; Kopf's
records (the maintainer runs in Kopf) go through the same handler, because :func:`setup` owns the root
logger's handlers.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import IO, Any

from controller.model.resources import format_time, round_time

FORMATS = ("json", "plain")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: The keys every line has, in this order.
CORE_KEYS = ("ts", "level", "logger", "msg")
#: The attribute Kopf's per-object loggers (kopf.ObjectLogger) put the object reference in.
KOPF_REF = "k8s_ref"


def fields(**values: Any) -> dict[str, Any]:
    """``extra=`` for a log call that adds ``values`` to the line as fields of their own."""
    return {"fields": values}


def record_fields(record: logging.LogRecord, format_exception: Callable[[Any], str] | None = None) -> dict[str, Any]:
    """The schema's fields of ``record``, in order: the core keys, then error/stacktrace, object, the rest."""
    out: dict[str, Any] = {
        "ts": format_time(round_time(record.created), micro=True),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    extra = getattr(record, "fields", None)
    given = extra if isinstance(extra, dict) else {}
    if record.exc_info and record.exc_info[1] is not None:
        exc = record.exc_info[1]
        out["error"] = given.get("error", f"{type(exc).__name__}: {exc}")
        fmt = format_exception or logging.Formatter().formatException
        out["stacktrace"] = fmt(record.exc_info)
    ref = getattr(record, KOPF_REF, None)
    if isinstance(ref, dict):
        out["object"] = {k: v for k, v in ref.items() if v is not None}
    for key, value in given.items():
        out.setdefault(key, value)
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module doc)."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(record_fields(record, self.formatException), default=str)


class PlainFormatter(logging.Formatter):
    """The same keys for people: ``ts LEVEL logger: msg key=value ...``, then the traceback, if any."""

    def format(self, record: logging.LogRecord) -> str:
        out = record_fields(record, self.formatException)
        stacktrace = out.pop("stacktrace", None)
        line = f"{out.pop('ts')} {str(out.pop('level')).upper():<7} {out.pop('logger')}: {out.pop('msg')}"
        line += "".join(f" {key}={_plain(value)}" for key, value in out.items())
        return f"{line}\n{stacktrace}" if stacktrace else line


def _plain(value: Any) -> str:
    if isinstance(value, str) and value and not any(c.isspace() or c in "\"'=" for c in value):
        return value
    return json.dumps(value, default=str, separators=(",", ":"))


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if log_format == "plain":
        return PlainFormatter()
    raise ValueError(f"unknown log format {log_format!r} (expected one of {', '.join(FORMATS)})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--log-format`` and ``--log-level``, the same flags and defaults in every process."""
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="json",
        help="json: one JSON object per line on stderr (ts, level, logger, msg and fields; docs/operations.md, "
        "Logging); plain: the same fields as text, for people (default json)",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LEVELS,
        default="INFO",
        help="the lowest level logged (default INFO)",
    )


def setup(level: str = "INFO", log_format: str = "json", stream: IO[str] | None = None) -> logging.Handler:
    """Send every record of the process (the root logger's, so Kopf's too) to ``stream`` (stderr) in the
    schema. Replaces whatever handlers the root logger had, Kopf's included. Returns the handler."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return handler
