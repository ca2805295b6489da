"""The etcd source (``spec.source.etcd``): a changefeed's key ranges read from one etcd v3 cluster.

Per changefeed on a capture, one :class:`EtcdSource`: one connection (``connection.Connection``: plaintext for
``http://`` endpoints, TLS for ``https://`` ones; one endpoint at a time, the next after a transport error), one watch
stream carrying every dispatcher's watcher (``watch.WatchStream``), the initial scans, and the probe of new values.
Positions are etcd revisions: one cluster's revision is global and totally ordered. New endpoints must belong to the
same cluster (its id, once a scan or a probe saw it): the positions are revisions of that one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

import aetcd.rpc

from controller.model.keys import KeyRange
from controller.sinks.api import Row
from controller.sources.etcd import errors
from controller.sources.etcd.connection import Connection, Tls
from controller.sources.etcd.watch import TRANSPORT, ChannelClosed, WatchStream, rpc

#: Rows per page of the initial scan.
SCAN_PAGE = 2_000


class Values(Protocol):
    """Where the source is (a changefeed's ``Endpoints``): never printed."""

    @property
    def etcd(self) -> tuple[str, ...]: ...

    @property
    def username(self) -> str | None: ...

    @property
    def password(self) -> str | None: ...

    @property
    def tls(self) -> Tls | None: ...


def same(a: Values, b: Values) -> bool:
    return (a.etcd, a.username, a.password, a.tls) == (b.etcd, b.username, b.password, b.tls)


class EtcdSource:
    def __init__(
        self,
        values: Values,
        *,
        on_head: Callable[[int], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.values = values
        self.client: Connection | None = None
        self._client_lock = asyncio.Lock()
        self._endpoint_index = 0
        self.stream = WatchStream(self.connection, self.reset, on_head=on_head, on_error=on_error)
        self.on_head = on_head
        #: The cluster's id, once a scan or a probe saw it (0 before): new endpoints must belong to it.
        self.cluster_id = 0

    @staticmethod
    def errors() -> tuple[type[BaseException], ...]:
        """What a failed call to the source raises (retried)."""
        return TRANSPORT

    @staticmethod
    def trouble(exc: BaseException) -> tuple[bool, str] | None:
        """(transient, message) of a failure; None for a connection closed under a call by another task's error
        (that task reports its own)."""
        return None if isinstance(exc, ChannelClosed) else errors.source_trouble(exc)

    async def connection(self) -> Connection:
        async with self._client_lock:
            if self.client is None:
                v = self.values
                endpoint = v.etcd[self._endpoint_index % len(v.etcd)]
                try:
                    self.client = await rpc(
                        Connection.open(endpoint, username=v.username, password=v.password, tls=v.tls, auth_timeout=10)
                    )
                except TRANSPORT:
                    self._endpoint_index += 1  # refused (authentication asks the server): the next endpoint next
                    raise
            return self.client

    async def reset(self, used: Connection | None) -> None:
        """Drop the connection ``used`` after a transport error on it: the next call connects again (to the next
        endpoint). A connection already replaced (another task's error came first) is left as it is: closing the
        new one would break the calls on it for nothing."""
        async with self._client_lock:
            if used is None or self.client is not used:
                return
            client, self.client = self.client, None
            self._endpoint_index += 1
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    def release(self) -> asyncio.Task[None]:
        """Close the connection in use (a paused changefeed holds none; the next call connects again)."""
        return asyncio.get_running_loop().create_task(self.reset(self.client), name="release-source")

    async def scan(self, key_range: KeyRange) -> tuple[list[Row], int]:
        """The initial scan: every key of ``key_range`` as of one revision (the store's current one, paged at that
        revision), and that revision. Raises ``errors()`` (the connection is reset: the caller retries)."""
        conn = None
        try:
            conn = await self.connection()
            return await self._scan(conn, key_range)
        except TRANSPORT:
            await self.reset(conn)
            raise

    async def _scan(self, client: Connection, key_range: KeyRange) -> tuple[list[Row], int]:
        rows: list[Row] = []
        at = 0
        key, hi = key_range.start, key_range.end
        while True:
            answer = await rpc(
                client.kvstub.Range(
                    aetcd.rpc.RangeRequest(key=key, range_end=hi, revision=at, limit=SCAN_PAGE),
                    timeout=30,
                    metadata=client.metadata,  # the auth token of a source with a username (None without)
                )
            )
            if at == 0:
                at = answer.header.revision
                self.cluster_id = self.cluster_id or int(answer.header.cluster_id)
                self.on_head(at)
            rows.extend((kv.key, kv.value, kv.mod_revision, False) for kv in answer.kvs)
            if not answer.more or not answer.kvs:
                return rows, at
            key = answer.kvs[-1].key + b"\x00"

    async def try_values(self, new: Values, probe: bytes) -> tuple[Connection | None, str]:
        """A connection to one of ``new``'s endpoints that answered a read of ``probe`` (a key of a span held here) and
        belongs to this source's cluster, or why none did."""
        problem = ""
        for endpoint in new.etcd:
            conn = None
            try:
                conn = await rpc(
                    Connection.open(
                        endpoint, username=new.username, password=new.password, tls=new.tls, auth_timeout=10
                    )
                )
                answer = await rpc(
                    conn.kvstub.Range(
                        aetcd.rpc.RangeRequest(key=probe, limit=1, keys_only=True), timeout=10, metadata=conn.metadata
                    )
                )
                cluster = int(answer.header.cluster_id)
                if self.cluster_id and cluster != self.cluster_id:
                    await conn.close()
                    return None, (
                        f"{endpoint} belongs to another etcd cluster (id {cluster:x}, not {self.cluster_id:x}): this "
                        "changefeed's positions are revisions of the first one; create a new changefeed for it"
                    )
                self.cluster_id = cluster
                return conn, ""
            except TRANSPORT as exc:
                problem = errors.source_trouble(exc)[1]
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
        return None, problem

    async def use(self, new: Values, client: Connection | None) -> None:
        """Read with ``new`` from now on, on ``client`` if given: the connection in use is closed, which breaks the
        watch stream, and every watcher is created again on the new one from its dispatcher's position."""
        async with self._client_lock:
            old, self.client = self.client, client
            self.values = new
            self._endpoint_index = 0
        if old is not None:
            with contextlib.suppress(Exception):
                await old.close()

    async def aclose(self) -> None:
        await self.stream.aclose()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
