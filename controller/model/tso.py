"""TiDB-style timestamps (TSOs): physical milliseconds shifted left by the logical counter's bits. One home
for the encoding, used by the capture runtime, the maintainer's metrics and the kubectl plugin."""

from __future__ import annotations

#: Bits of a TSO below the physical milliseconds (TiDB's logical counter).
LOGICAL_BITS = 18


def tso(physical_ms: int, logical: int = 0) -> int:
    """A TiDB-style timestamp from physical milliseconds and a logical counter."""
    return (physical_ms << LOGICAL_BITS) | logical


def physical_ms(ts: int) -> int:
    """The physical milliseconds (since the epoch) of a TSO."""
    return ts >> LOGICAL_BITS


def physical_seconds(ts: int) -> float:
    """Wall time (seconds since the epoch) of a TSO."""
    return physical_ms(ts) / 1000.0
