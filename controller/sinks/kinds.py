"""The sink kinds, by the name a Changefeed gives them (``spec.sink.<kind>``): a new kind is one line here."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from controller.sinks import mysql, postgres
from controller.sinks.api import Sink, Unusable

#: Each kind's ``from_secret``: the :class:`~controller.sinks.api.Sink` from its Secret's decoded data.
KINDS: dict[str, Callable[[str, Mapping[str, str]], Sink]] = {
    postgres.KIND: postgres.from_secret,
    mysql.KIND: mysql.from_secret,
}


def from_secret(kind: str, changefeed: str, data: Mapping[str, str]) -> Sink:
    """The :class:`~controller.sinks.api.Sink` of ``kind`` from its Secret's decoded data; :class:`Unusable` says what
    is wrong."""
    make = KINDS.get(kind)
    if make is None:
        raise Unusable(f"unknown sink kind {kind!r} (known: {', '.join(KINDS)})")
    return make(changefeed, data)
