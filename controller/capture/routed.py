"""What the agent drives: each dispatcher in the real data plane when its changefeed names a source and a sink, else
in the logical clock (``RoutedRuntime``)."""

from __future__ import annotations

from collections.abc import Sequence

from controller.capture.dataplane import DataplaneRuntime, Endpoints
from controller.capture.runtime import DispatcherRuntime
from controller.model.progress import Side, SinkFigures
from controller.model.records import Dispatcher


class RoutedRuntime:
    """What the agent drives (a ``DispatcherRuntime`` itself): each dispatcher runs in the :class:`DataplaneRuntime`
    when its changefeed was configured with a source and a sink (:meth:`configure`), else in ``default`` (the logical
    clock: a changefeed that names no source replicates nothing, for benchmarks of the control plane)."""

    def __init__(self, default: DispatcherRuntime, data: DataplaneRuntime | None = None) -> None:
        self.default = default
        self.data = data if data is not None else DataplaneRuntime()
        self._real: set[str] = set()

    def configure(self, changefeed: str, endpoints: Endpoints) -> None:
        self.data.configure(changefeed, endpoints)

    def configured(self, changefeed: str) -> bool:
        return self.data.configured(changefeed)

    async def reconfigure(self, changefeed: str, endpoints: Endpoints) -> dict[Side, str]:
        """New values from the changefeed's Secrets, tried before they are used (``DataplaneRuntime.reconfigure``):
        per side, why they were not."""
        return await self.data.reconfigure(changefeed, endpoints)

    def published(self, changefeed: str, checkpoint_ts: int) -> None:
        """The changefeed's published checkpoint, as its Changefeed says (``DataplaneRuntime.published``)."""
        self.data.published(changefeed, checkpoint_ts)

    def _rt(self, name: str) -> DispatcherRuntime:
        return self.data if name in self._real else self.default

    def start(self, dispatcher: Dispatcher) -> None:
        if dispatcher.name in self._real:
            return
        if self.data.configured(dispatcher.changefeed):
            self.data.start(dispatcher)
            self._real.add(dispatcher.name)
        else:
            self.default.start(dispatcher)

    def checkpoint(self, name: str) -> int:
        return self._rt(name).checkpoint(name)

    def write_rate(self, name: str) -> float:
        return self._rt(name).write_rate(name)

    def region_count(self, name: str) -> int:
        return self._rt(name).region_count(name)

    def close(self, name: str) -> int:
        rt = self._rt(name)
        final = rt.close(name)
        self._real.discard(name)
        return final

    def pause(self, name: str) -> int:
        return self._rt(name).pause(name)

    def resume(self, name: str) -> None:
        self._rt(name).resume(name)

    def flush(self) -> None:
        self.default.flush()
        self.data.flush()

    def release(self, changefeed: str) -> None:
        rt = self.data if self.data.configured(changefeed) else self.default
        rt.release(changefeed)

    def checkpoint_time(self, name: str) -> float | None:
        """The wall time a real dispatcher's checkpoint stands for; None for the logical clock (a TSO)."""
        return self._rt(name).checkpoint_time(name)

    def sink_figures(self) -> tuple[SinkFigures, ...]:
        """The sinks' figures (``DataplaneRuntime.sink_figures``: the logical clock writes no sink)."""
        return self.default.sink_figures() + self.data.sink_figures()

    def take_failed(self) -> set[str]:
        """The dispatchers that stopped for good since the last call (``DataplaneRuntime.take_failed``: the logical
        clock stops none)."""
        return self.default.take_failed() | self.data.take_failed()

    def failed(self, name: str) -> str | None:
        """Why a dispatcher stopped for good (None: it did not; the logical clock never stops one)."""
        return self._rt(name).failed(name)

    def low_watermark(self, names: Sequence[str]) -> tuple[int, str] | None:
        """The default runtime's shortcut, for groups with no real dispatcher (else None: ask each)."""
        if any(n in self._real for n in names):
            return None
        return self.default.low_watermark(names)

    async def aclose(self) -> None:
        self._real.clear()
        await self.data.aclose()
