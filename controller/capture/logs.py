"""JSON-lines logging to stderr: ``{"ts": ..., "level": ..., "msg": ..., <fields>}`` per record.

Fields are passed as ``extra={"fields": {...}}`` (see :func:`fields`), so call sites stay plain
``logging`` calls and tests can parse every line.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from controller.model.resources import format_time, round_time


def fields(**values: Any) -> dict[str, Any]:
    """``extra=`` for a log call that adds ``values`` to the JSON line."""
    return {"fields": values}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": format_time(round_time(record.created), micro=True),
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
            "logger": record.name,
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            for key, value in extra.items():
                out.setdefault(key, value)
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.Formatter.converter = time.gmtime
