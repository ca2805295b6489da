"""The faults the simulated captures inject into the data path, chosen by a hash of the seed and what they touch (not
drawn from the seed's random stream: a history without such a fault is as it was): a dispatcher stopped for good (as
when etcd compacts past its position), and a window during which a capture cannot use its source or its sink."""

from __future__ import annotations

import zlib

from controller.model import progress

#: One advance in this many stops a Working dispatcher for good (as etcd compacted past its position), chosen by
#: a hash of (seed, dispatcher, checkpoint) rather than drawn from the seed's random stream: a history with no such
#: failure is as it was.
FAILURE_ODDS = 1000


def fails(seed: int, name: str, cp: int) -> bool:
    return zlib.crc32(f"{seed}/{name}/{cp}".encode()) % FAILURE_ODDS == 0


#: A capture cannot use one side of its changefeeds' data path (its source or its sink) during one window of
#: ``TROUBLE_WINDOW`` seconds in this many (by a hash of (seed, capture, side, window), as the failures above): its
#: reports then name the trouble (``progress.Trouble``) for every changefeed it runs a dispatcher of, in any state
#: (a dispatcher still scanning, or not started for want of a Secret, reports too), until the window ends or the
#: quiet phase begins. One window in three is a configuration error (not transient), the others are retried.
TROUBLE_ODDS = 40
TROUBLE_WINDOW = 3.0
TROUBLE_MESSAGES = {
    progress.SOURCE: "cannot reach the source at 127.0.0.1:2379: connection refused (simulated)",
    progress.SINK: "cannot connect to the sink at 127.0.0.1:5432: connection refused (simulated)",
}


def trouble(seed: int, capture: str, side: progress.Side, now: float) -> bool | None:
    """During a trouble window of ``capture`` on ``side``: whether it is transient; None outside one."""
    h = zlib.crc32(f"{seed}/{capture}/{side}/{int(now // TROUBLE_WINDOW)}".encode())
    return None if h % TROUBLE_ODDS else (h // TROUBLE_ODDS) % 3 != 0
