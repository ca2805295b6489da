"""The Working dispatchers each capture's progress report must cover, and the digest of their uids, kept per change.

A capture's report for a changefeed and mode carries how many Working dispatchers it covers and a digest of their
uids; the report's minimum is used only when both match what the maintainer believes that capture runs
(engine/progress.py). The believed sets are kept here per (capture, mode), with the digest as a sum of per-uid hashes
updated one addition per change (``controller.model.progress.digest``), so judging a report costs O(1), not a hash
over every dispatcher. A report from a capture of an older version carries the legacy digest (over the sorted uids):
it is still judged, hashed when first asked after a change, so that a rolling upgrade keeps using those reports.
"""

from __future__ import annotations

from controller.model.progress import SET_DIGEST, legacy_digest, sum_digest, uid_hash
from controller.model.states import Mode

#: Set digests are sums modulo 2^64 (``controller.model.progress.digest``).
SUM_MASK = (1 << 64) - 1

#: A capture and a mode: the unit of a capture's progress report for this changefeed (engine/progress.py).
ReportKey = tuple[str, Mode]
#: What a Working dispatcher is to the sets: its capture, its mode and its uid.
Member = tuple[str, Mode, str]


class WorkingSets:
    """Per (capture, mode): the Working dispatchers (name -> uid) the maintainer believes that capture runs for this
    changefeed, and the digest of their uids. See the module docstring."""

    def __init__(self) -> None:
        self.members: dict[ReportKey, dict[str, str]] = {}
        #: Per (capture, mode): the sum of the ``uid_hash``es of its Working dispatchers (``digest``, kept current per
        #: change), and the legacy digest of those uids when a report still carries one (computed when first asked
        #: after a change: only while captures of an older version run).
        self._sums: dict[ReportKey, int] = {}
        self._legacy: dict[ReportKey, str] = {}

    def change(self, name: str, before: Member | None, after: Member | None) -> None:
        """Dispatcher ``name`` goes from ``before`` to ``after`` (None: not a Working dispatcher of this changefeed)."""
        if before == after:
            return
        if before is not None:
            key: ReportKey = (before[0], before[1])
            group = self.members[key]
            del group[name]
            if not group:
                del self.members[key]
                del self._sums[key]
            else:
                self._sums[key] = (self._sums[key] - uid_hash(before[2])) & SUM_MASK
            self._legacy.pop(key, None)
        if after is not None:
            key = (after[0], after[1])
            self.members.setdefault(key, {})[name] = after[2]
            self._sums[key] = (self._sums.get(key, 0) + uid_hash(after[2])) & SUM_MASK
            self._legacy.pop(key, None)

    def digest(self, key: ReportKey) -> str:
        """The digest of the uids of the Working dispatchers of ``key`` (what an exact report carries): O(1)."""
        return sum_digest(self._sums.get(key, 0))

    def covers(self, key: ReportKey, reported: str) -> bool:
        """Whether a report's digest is the digest of ``key``'s Working dispatchers (a set digest: O(1); a legacy one,
        from a capture of an older version: hashed over them when first asked after a change)."""
        if reported.startswith(SET_DIGEST):
            return reported == self.digest(key)
        found = self._legacy.get(key)
        if found is None:
            found = self._legacy[key] = legacy_digest(self.members.get(key, {}).values())
        return reported == found
