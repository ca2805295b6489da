"""One etcd Watch stream carrying the watchers of many dispatchers: one gRPC stream per capture and changefeed, not
one per dispatcher.

etcd multiplexes watchers on a stream: each ``WatchCreateRequest`` (its own key range, start revision and
``progress_notify``) names a ``watch_id`` of ours, and every response says which watcher it is for. A watcher
keeps every guarantee it had on a stream of its own: its events come in revision order, whole revisions per
response, and its periodic progress notification (a response with its id, no events, not ``created``) means every
change of its range up to the response's ``header.revision`` has been sent. So a dispatcher's resolved revision
moves exactly as before; what is shared is the connection, the reader and the gRPC call.

A watcher is *wanted* (``want``) or not (paused, held back while its rows wait for the sink, failed, not scanned
yet). A wanted watcher is created from its position + 1 (``Watcher.position``); one no longer wanted is cancelled
and its id forgotten at once, so a response still in flight for it is ignored (the next creation, from the
position its applied events reached, replays whatever that dropped). When the stream breaks (the server gone, an
error), every wanted watcher is created again from its position on a new stream, with new ids. A cancellation the
server makes itself (``canceled``) with a ``compact_revision`` is the watcher's failure (its history is gone); any
other is retried like a break of that watcher alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import aetcd
import aetcd.rpc
import grpc

from controller.logs import fields
from controller.sinks.api import Row
from controller.sources.api import Watcher
from controller.sources.etcd.connection import Connection, describe

log = logging.getLogger("controller.capture.dataplane")

#: Back-off of a broken stream: first wait, cap (seconds).
BACKOFF = (0.1, 5.0)
#: Seconds before a watcher the server cancelled for another reason than compaction is created again.
RETRY_CANCELLED = 1.0


class ChannelClosed(Exception):
    """An etcd call ended because its connection was closed under it (another task's transport error dropped the
    shared connection): gRPC cancels the call, which reaches the awaiting task as a ``CancelledError`` that is not
    the task's own cancellation."""


#: What a broken stream, an unreachable etcd or a connection closed under a call raises.
TRANSPORT = (grpc.aio.AioRpcError, aetcd.exceptions.ClientError, OSError, TimeoutError, ChannelClosed)

T = TypeVar("T")


async def rpc(call: Awaitable[T]) -> T:
    """Await an etcd call; a cancellation that is not this task's own (the connection closed under the call) is
    :class:`ChannelClosed`, a transport error, so that the caller retries instead of ending as if cancelled."""
    try:
        return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise ChannelClosed("the etcd connection was closed under the call") from None


_DELETE = aetcd.rpc.Event.DELETE


def rows_of(events: Any) -> list[Row]:
    """A response's events as rows (key, value, revision, deleted): the hot loop of a catch-up, each protobuf
    attribute read once."""
    rows: list[Row] = []
    append = rows.append
    for e in events:
        kv = e.kv
        if e.type == _DELETE:
            append((kv.key, None, kv.mod_revision, True))
        else:
            append((kv.key, kv.value, kv.mod_revision, False))
    return rows


class WatchStream:
    def __init__(
        self,
        client: Callable[[], Awaitable[Connection]],
        reset: Callable[[Connection | None], Awaitable[None]],
        *,
        on_head: Callable[[int], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        #: The feed's etcd client (connected on first use) and how to drop it after a transport error (the
        #: connection the stream used: one another task already replaced is left alone).
        self._client = client
        self._reset = reset
        self._conn: Connection | None = None
        self._ids = itertools.count(1)
        #: watch id -> its watcher, for the watchers created on the current stream and not cancelled.
        self._by_id: dict[int, Watcher] = {}
        #: watcher name -> its current watch id.
        self._id_of: dict[str, int] = {}
        #: The watchers that should be watching, by name.
        self._wanted: dict[str, Watcher] = {}
        self._requests: asyncio.Queue[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        #: Head revisions seen in any response (the feed's lag clock; a response also says the source works), and
        #: what broke the stream (the feed's trouble while it is retried).
        self.on_head = on_head
        self.on_error = on_error
        self.streams = 0  # streams opened (the first and every reconnection)

    def watching(self) -> int:
        return len(self._by_id)

    # -- what the feed asks ------------------------------------------------------------------------------

    def want(self, w: Watcher) -> None:
        """Watch ``w`` from its position + 1 (at once if the stream is up, else when it is)."""
        self._wanted[w.name] = w
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="etcd-watch-stream")
        elif self._requests is not None and w.name not in self._id_of:
            self._create(w)

    def drop(self, name: str) -> None:
        """Stop watching ``name`` (paused, held back, failed, closed): cancelled, and any response still in flight
        for it ignored."""
        self._wanted.pop(name, None)
        wid = self._id_of.pop(name, None)
        if wid is None:
            return
        self._by_id.pop(wid, None)
        if self._requests is not None:
            self._requests.put_nowait(aetcd.rpc.WatchRequest(cancel_request=aetcd.rpc.WatchCancelRequest(watch_id=wid)))

    async def aclose(self) -> None:
        self._wanted.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    # -- the stream ------------------------------------------------------------------------------------------

    def _again(self, w: Watcher) -> None:
        """A watcher the server cancelled (not for compaction), created again if still wanted and not watching."""
        if self._wanted.get(w.name) is w and w.name not in self._id_of and self._requests is not None:
            self._create(w)

    def _create(self, w: Watcher) -> None:
        assert self._requests is not None
        wid = next(self._ids)
        self._by_id[wid] = w
        self._id_of[w.name] = wid
        create = aetcd.rpc.WatchCreateRequest(
            key=w.key, range_end=w.range_end, start_revision=w.position() + 1, progress_notify=True, watch_id=wid
        )
        self._requests.put_nowait(aetcd.rpc.WatchRequest(create_request=create))

    async def _run(self) -> None:
        backoff = BACKOFF[0]
        while self._wanted:
            try:
                await self._stream()
                backoff = BACKOFF[0]
            except asyncio.CancelledError:
                raise
            except TRANSPORT as exc:
                log.debug(
                    "etcd watch stream broke; watching again from each dispatcher's position",
                    extra=fields(error=describe(exc), watchers=len(self._wanted)),
                )
                self.on_error(exc)
                await self._reset(self._conn)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF[1])

    async def _stream(self) -> None:
        self._conn = client = await self._client()
        requests: asyncio.Queue[Any] = asyncio.Queue()

        async def iterate() -> AsyncIterator[Any]:
            while (request := await requests.get()) is not None:
                yield request

        self._requests = requests
        self._by_id.clear()
        self._id_of.clear()
        for w in list(self._wanted.values()):
            self._create(w)
        # With the auth token of a source with a username (``metadata``: None without one).
        call = aetcd.rpc.WatchStub(client.channel).Watch(iterate(), metadata=client.metadata)
        self.streams += 1
        try:
            while self._wanted or self._by_id:
                response = await rpc(call.read())
                if response is grpc.aio.EOF:
                    raise OSError("the etcd watch stream ended")
                self._dispatch(response)
        finally:
            self._requests = None
            self._by_id.clear()
            self._id_of.clear()
            call.cancel()
            requests.put_nowait(None)

    def _dispatch(self, response: Any) -> None:
        head = response.header.revision
        self.on_head(head)
        w = self._by_id.get(response.watch_id)
        if w is None:
            return  # cancelled by us (a response in flight), or the stream's own (watch_id -1)
        if response.canceled:
            self._by_id.pop(response.watch_id, None)
            self._id_of.pop(w.name, None)
            if response.compact_revision:
                self._wanted.pop(w.name, None)
                w.compacted(response.compact_revision)
                return
            log.debug(
                "etcd cancelled a watch; watching again in a second",
                extra=fields(dispatcher=w.name, reason=response.cancel_reason),
            )
            w.cancelled(str(response.cancel_reason))
            asyncio.get_running_loop().call_later(RETRY_CANCELLED, self._again, w)
            return
        if response.created:
            w.created(head)
        elif response.events:
            w.events(rows_of(response.events), head)
        else:
            w.progress(head)
