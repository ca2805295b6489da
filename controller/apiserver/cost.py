"""An optional cost model of the API's storage: writes wait for a commit that completes in batches.

The embedded API answers every write at once; a real kube-apiserver answers a write only once etcd has
committed it, and etcd commits the writes that arrived while the previous commit ran in one batch (one raft
round and one fsync for them all). So concurrency pays on a real server and nothing can show it here
without a model: on the recorded server, sequential create + status-patch pairs ran at 130/s and
16 concurrent clients at 261/s (bench/README.md).

The model: commits run one after another; each takes every write waiting when it starts, and lasts
``latency + per_write * n`` for ``n`` writes (the round and fsync, then each write's apply, which on the
real server is CPU of kube-apiserver and etcd). A write is applied to the store (validated, its
preconditions checked, its watch events sent) when its commit completes, as etcd's transaction is, and
answered after; a write the store then refuses (validation, a precondition) has waited for a commit too,
which etcd would not see. With one client a write costs ``latency + per_write`` plus the server's own time; with many,
throughput tends to ``1 / per_write``. The defaults are calibrated (``bench/run.py --api-cost``, phase 5's
raw rates) so that the pair rates come out near the real server's: about 130/s with one client and 260/s
with 16. Off unless asked for (``python -m controller.apiserver --commit-latency-ms ...``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

#: Calibrated defaults (milliseconds): see the module docstring and bench/README.md.
DEFAULT_LATENCY_MS = 0.3
DEFAULT_PER_WRITE_MS = 1.6


@dataclass(frozen=True)
class CostModel:
    latency: float  # seconds a commit lasts, whatever its size
    per_write: float  # seconds each write of a batch adds


@dataclass
class Committer:
    """Serializes commits: ``await turn()`` returns when the commit that took this write completes."""

    model: CostModel
    _pending: list[asyncio.Future[None]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    #: Commits run and writes committed (for tests and figures).
    commits: int = 0
    writes: int = 0

    async def turn(self) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(fut)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="commits")
        await fut

    async def _run(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            await asyncio.sleep(self.model.latency + self.model.per_write * len(batch))
            self.commits += 1
            self.writes += len(batch)
            for fut in batch:
                if not fut.done():  # the client went away meanwhile: its handler was cancelled
                    fut.set_result(None)
