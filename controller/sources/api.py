"""What a source is to the data plane: the interface the capture's dispatchers are fed through.

A source kind (``controller.sources.etcd``) gives the runtime, per changefeed on a capture, one object that:

- keeps the connection (made on first use, dropped and made again after a transport error: ``errors``);
- **scans** a key range at one position (``scan``: the rows as of the source's current position, and that
  position), for a dispatcher that starts from nothing;
- **watches** ranges from positions on one shared stream (``stream.want(watcher)`` / ``stream.drop(name)``): each
  :class:`Watcher` is told when its watch is created, each batch of changes (whole positions, in order, as
  :data:`~controller.sinks.api.Row` s), each progress notification (every change of its range up to a position has
  been sent: how an idle span advances), and **compaction** past its position as a failure of its own (its changes
  since are gone: never skipped);
- reports the source's head position with every answer (``on_head``: the lag clock; an answer also says the source
  works) and each failure (``on_error``), classified for the Changefeed (``trouble``: transient or needing a
  person);
- tries new values before they are used (``try_values``, then ``use``), so a rotated Secret takes effect without
  losing a position, and refuses values that reach another source than the one the positions belong to.

A position is the source's own totally ordered clock (etcd: its revision): checkpoints taken on different captures
compare exactly.
"""

from __future__ import annotations

from typing import Protocol

from controller.sinks.api import Row


class Watcher(Protocol):
    """What a source's watch stream needs of a dispatcher's watcher."""

    @property
    def name(self) -> str: ...

    @property
    def key(self) -> bytes: ...

    @property
    def range_end(self) -> bytes: ...

    def position(self) -> int:
        """The position up to which it has every change of its range (its watch starts after it)."""
        ...

    def created(self, head: int) -> None:
        """Its watch was created (``head``: the source's position then)."""

    def events(self, rows: list[Row], head: int) -> None:
        """Changes of its range: whole positions, in order."""

    def progress(self, head: int) -> None:
        """A progress notification: every change of its range up to ``head`` was sent."""

    def compacted(self, compact_revision: int) -> None:
        """The source was compacted past its position: its changes since are gone."""

    def cancelled(self, reason: str) -> None:
        """The source cancelled the watcher for another reason; it is created again."""
