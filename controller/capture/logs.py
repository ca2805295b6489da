"""The capture's name for :mod:`controller.logs`, the log schema every process of the project shares, and ``Notes``:
a waiting condition said once, not at every pass.

The formatter, the flags and the setup live in ``controller.logs``, outside the import layers, so that the
maintainer, the embedded API and ``controller.kube`` (a layer below the capture) may use them too; this
module keeps ``from controller.capture.logs import fields`` working for the capture's call sites.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from controller.logs import JsonFormatter, PlainFormatter, fields, setup

__all__ = ["JsonFormatter", "Notes", "PlainFormatter", "fields", "setup"]


class Notes:
    """Waiting conditions logged once per (name, what): a dispatcher waiting for its changefeed, a hook holding a
    close... are said when they begin, not at every reconcile pass."""

    def __init__(self, logger: logging.Logger) -> None:
        self.log = logger
        self._noted: set[tuple[str, str]] = set()

    def say(self, name: str, what: str, level: int, msg: str, **extra: Any) -> None:
        if (name, what) in self._noted:
            return
        self._noted.add((name, what))
        self.log.log(level, msg, extra=fields(dispatcher=name, **extra))

    def keep(self, names: Collection[str]) -> None:
        """Forget the notes of names not in ``names`` (what is gone may be said again if it comes back)."""
        self._noted = {n for n in self._noted if n[0] in names}
