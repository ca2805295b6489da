"""A steady upstream writer for the demo, the tests and the benchmark: puts, overwrites and deletes keys of
some tables in a real etcd, from a thread of its own (so a synchronous test and an asyncio program can both
run one), at about ``rate`` changes a second.

Changes go in etcd transactions of up to ``batch`` keys each (one revision per transaction, as TiDB commits
many rows at one ts): a high rate costs etcd and the writer a few requests a second, and the spans see
revisions carrying many events. Keys are ``t<table id>`` + a 2-byte row number (``keys`` rows per table), so
every span of a table gets its share; 80 % of the changes are puts (a new or an existing key, so overwrites
are common) and 20 % deletes.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import threading
import time
from collections.abc import Sequence

import aetcd
import aetcd.rpc as rpc

from controller.model.keys import table_key


def row_key(table_id: int, row: int) -> bytes:
    """The key of row ``row`` of a table: ``t<id>`` and the row number (2 bytes, big-endian)."""
    return table_key(table_id) + row.to_bytes(2, "big")


class Writer:
    """Writes until stopped; ``last`` is the revision of its last change, ``changes`` how many it made (puts,
    and deletes of a key that was there), ``deletes`` how many of those were deletes."""

    def __init__(
        self,
        host: str,
        port: int,
        tables: Sequence[int],
        *,
        rate: float = 1_000.0,
        batch: int = 50,
        keys: int = 4_096,
        seed: int = 0,
    ) -> None:
        if not tables or rate <= 0 or not 1 <= batch <= 128 or not 1 <= keys <= 65_536:
            raise ValueError("a writer needs tables, a rate > 0, 1 <= batch <= 128 and 1 <= keys <= 65536")
        self.host, self.port, self.tables = host, port, tuple(tables)
        self.rate, self.batch, self.keys = rate, batch, keys
        self.rng = random.Random(seed)
        self.last = 0
        self.changes = 0
        self.deletes = 0
        self.transactions = 0
        #: Every key it wrote or deleted at least once.
        self.touched: set[bytes] = set()
        #: (revision, wall time) of each transaction, in order (the ground truth of a lag: ``written_after``).
        self.revisions: list[int] = []
        self.times: list[float] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> Writer:
        self._thread.start()
        return self

    def __enter__(self) -> Writer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> int:
        """Stop and return the last revision written; raise if the writer failed."""
        self._stop.set()
        self._thread.join(timeout=30)
        if self.error is not None:
            raise RuntimeError(f"the writer failed: {self.error!r}") from self.error
        return self.last

    def wait_for(self, changes: int, touched: int = 0, timeout: float = 120.0) -> None:
        """Block until at least ``changes`` changes were written in all and ``touched`` keys written or deleted
        (raise on a failure or the timeout)."""
        deadline = time.monotonic() + timeout
        with self._progress:
            while self.changes < changes or len(self.touched) < touched:
                if self.error is not None:
                    raise RuntimeError(f"the writer failed: {self.error!r}") from self.error
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    raise TimeoutError(f"the writer made {self.changes} of {changes} changes")
                self._progress.wait(min(left, 0.5))

    def written_after(self, revision: int) -> float | None:
        """When (wall time) it made its first change above ``revision``: a sink complete up to ``revision`` lags by
        now minus that; None if it made none (the sink is caught up with it)."""
        with self._progress:
            i = bisect.bisect_right(self.revisions, revision)
            return self.times[i] if i < len(self.times) else None

    def _run(self) -> None:
        try:
            asyncio.run(self._write())
        except BaseException as exc:  # reported by stop() and wait_for()
            self.error = exc
        finally:
            with self._progress:
                self._progress.notify_all()

    def next_ops(self) -> list[rpc.RequestOp]:
        """The next transaction's changes (the writer's mix), for a caller that writes them itself."""
        picked: dict[bytes, bool] = {}  # key -> delete; one change per key in a transaction (etcd refuses more)
        while len(picked) < self.batch:
            key = row_key(self.rng.choice(self.tables), self.rng.randrange(self.keys))
            picked[key] = self.rng.random() < 0.2
        ops = []
        for key, delete in picked.items():
            if delete:
                ops.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)))
            else:
                value = b"v%d" % self.rng.randrange(10**9)
                ops.append(rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value)))
        return ops

    async def _write(self) -> None:
        options = {"grpc.enable_http_proxy": 0}
        period = self.batch / self.rate
        async with aetcd.Client(host=self.host, port=self.port, timeout=5, options=options) as client:
            due = time.monotonic()
            while not self._stop.is_set():
                ops = self.next_ops()
                answer = await client.kvstub.Txn(rpc.TxnRequest(success=ops), timeout=5)
                deleted = sum(r.response_delete_range.deleted for r in answer.responses)
                puts = sum(1 for op in ops if op.HasField("request_put"))
                with self._progress:
                    self.last = max(self.last, answer.header.revision)
                    self.changes += puts + deleted  # a delete of a key that is not there changes nothing
                    self.deletes += deleted
                    self.touched.update(op.request_put.key or op.request_delete_range.key for op in ops)
                    self.transactions += 1
                    self.revisions.append(answer.header.revision)
                    self.times.append(time.time())
                    self._progress.notify_all()
                due += period
                await asyncio.sleep(max(0.0, due - time.monotonic()))
