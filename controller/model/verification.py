"""The last verification of a changefeed (``kubectl changefeed verify``), as the Changefeed carries it.

The command writes its result on the Changefeed as the annotation ``cdc.maintainer.dev/last-verify``, JSON
``{"revision": R, "differences": N, "keys": K, "unverifiable": U, "at": "<RFC 3339>"}``; the model reads it
into ``Changefeed.last_verify`` (metadata, neither spec nor status: verify is a read-only check a person
runs, not an intent the maintainer carries out), and the maintainer's metrics export it
(``changefeed_maintainer_verify_*``). Read leniently: an annotation that does not parse is no verification,
it never makes the Changefeed invalid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

LAST_VERIFY_ANNOTATION = "cdc.maintainer.dev/last-verify"


@dataclass(frozen=True, slots=True)
class Verification:
    #: The etcd revision R the sink was compared at.
    revision: int
    #: Differences found (missing, extra and mismatched keys); 0: the sink matched etcd at R.
    differences: int
    #: Keys compared.
    keys: int
    #: When it ran, seconds since the epoch.
    at: float
    #: Rows ahead of R whose own revision etcd had compacted (not differences).
    unverifiable: int = 0

    def to_json(self) -> str:
        stamp = datetime.fromtimestamp(self.at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return json.dumps(
            {
                "revision": self.revision,
                "differences": self.differences,
                "keys": self.keys,
                "unverifiable": self.unverifiable,
                "at": stamp,
            },
            separators=(",", ":"),
        )


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def verification_from_json(text: object) -> Verification | None:
    """The annotation's verification, or None if there is none or it does not parse (never raises)."""
    if not isinstance(text, str):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    revision, differences = _count(value.get("revision")), _count(value.get("differences"))
    keys, unverifiable = _count(value.get("keys", 0)), _count(value.get("unverifiable", 0))
    at = value.get("at")
    if revision is None or differences is None or keys is None or unverifiable is None or not isinstance(at, str):
        return None
    try:
        stamp = datetime.fromisoformat(at.replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return Verification(revision, differences, keys, stamp.timestamp(), unverifiable)
