"""Test hooks: TiCDC's failpoints, set at runtime as annotations on the agent's own Capture object.

* ``cdc.maintainer.dev/hold-close`` (TiCDC ``NotReadyToCloseDispatcher``): a running dispatcher that is
  being deleted is not closed; it keeps running and its finalizer stays until the hook is released.
* ``cdc.maintainer.dev/pause-create`` (TiCDC ``BlockCreateDispatcher``): a new dispatcher is not started
  (no epoch check, no status) until the hook is released.

Off unless the agent runs with ``--test-hooks`` (chart value ``capture.testHooks``): an annotation set on a
capture without it is reported and ignored.

Value: ``"*"`` for every table, or a comma-separated list of table IDs (``"7, 12"``). Absent: off.
A value with no valid table ID is treated as off (and reported), never as "all": a typo must not hold
every table of a test.

Parsing is pure; ``HookWatcher`` keeps what was last read (the reconciler re-reads the annotations at every pass).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from controller.logs import fields
from controller.model.states import GROUP

HOLD_CLOSE = f"{GROUP}/hold-close"
PAUSE_CREATE = f"{GROUP}/pause-create"
HOOKS = (HOLD_CLOSE, PAUSE_CREATE)


@dataclass(frozen=True)
class Scope:
    """Which tables a hook applies to: all (``every``), or the listed ``tables``."""

    every: bool = False
    tables: frozenset[int] = frozenset()

    def applies(self, table_id: int) -> bool:
        return self.every or table_id in self.tables

    def __str__(self) -> str:
        return "*" if self.every else ",".join(str(t) for t in sorted(self.tables))


def parse_scope(value: str) -> tuple[Scope | None, list[str]]:
    """The scope of one annotation value, and the parts that were not understood."""
    text = value.strip()
    if text == "*":
        return Scope(every=True), []
    tables: set[int] = set()
    bad: list[str] = []
    for part in text.split(","):
        item = part.strip()
        if not item:
            continue
        if item == "*":
            return Scope(every=True), bad
        try:
            table = int(item)
        except ValueError:
            bad.append(item)
            continue
        if table < 0:
            bad.append(item)
            continue
        tables.add(table)
    if not tables:
        return None, bad or ([text] if text else [])
    return Scope(tables=frozenset(tables)), bad


@dataclass(frozen=True)
class Hooks:
    hold_close: Scope | None = None
    pause_create: Scope | None = None

    def holds_close(self, table_id: int) -> bool:
        return self.hold_close is not None and self.hold_close.applies(table_id)

    def pauses_create(self, table_id: int) -> bool:
        return self.pause_create is not None and self.pause_create.applies(table_id)

    def describe(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.hold_close is not None:
            out["holdClose"] = str(self.hold_close)
        if self.pause_create is not None:
            out["pauseCreate"] = str(self.pause_create)
        return out


def hooks_from_annotations(annotations: Mapping[str, object] | None) -> tuple[Hooks, list[str]]:
    """The hooks set on a Capture, and a list of problems (unparsable values) to report."""
    problems: list[str] = []
    scopes: dict[str, Scope | None] = {}
    for key in HOOKS:
        raw = (annotations or {}).get(key)
        if raw is None:
            scopes[key] = None
            continue
        scope, bad = parse_scope(str(raw))
        if bad:
            problems.append(f"{key}: ignored {', '.join(repr(b) for b in bad)} (want '*' or table IDs)")
        scopes[key] = scope
    return Hooks(hold_close=scopes[HOLD_CLOSE], pause_create=scopes[PAUSE_CREATE]), problems


def disabled_hooks(annotations: Mapping[str, str] | None) -> list[str]:
    """The hook annotations set on a Capture (for the warning of an agent that does not honour them)."""
    return [key for key in HOOKS if (annotations or {}).get(key) is not None]


class HookWatcher:
    """The hooks in force: re-read from the Capture's annotations at every pass, logged when they change."""

    def __init__(self, enabled: bool, logger: logging.Logger) -> None:
        #: ``--test-hooks``: off, every hook set is reported and ignored.
        self.enabled = enabled
        self.log = logger
        self.hooks = Hooks()
        self._problems: tuple[str, ...] = ()

    def read(self, annotations: Mapping[str, str] | None) -> bool:
        """Read the hooks from ``annotations`` (the Capture's); whether they changed."""
        hooks, problems = hooks_from_annotations(annotations)
        if not self.enabled:
            if hooks != Hooks():
                problems = [f"{', '.join(disabled_hooks(annotations))}: ignored, test hooks are off (--test-hooks)"]
            hooks = Hooks()
        changed = hooks != self.hooks
        if changed:
            self.log.info("test hooks changed", extra=fields(hooks=hooks.describe()))
            self.hooks = hooks
        if tuple(problems) != self._problems:
            self._problems = tuple(problems)
            for problem in problems:
                self.log.warning("bad test hook annotation", extra=fields(problem=problem))
        return changed
