"""A dispatcher's status, as its capture writes it: its state, its checkpoint (delivered downstream first: the
runtime's sink is flushed before the write), a heartbeat, a message, and its traffic (what the maintainer's split and
merge schedulers judge by). Nothing live is written once the capture has fenced itself."""

from __future__ import annotations

import time

from controller.capture.lease_keeper import LeaseView
from controller.capture.runtime import DispatcherRuntime
from controller.kube.client import JSON, RESOURCES, Client
from controller.model.records import Dispatcher
from controller.model.resources import round_time, status_merge_patch
from controller.model.states import LIVE_DISPATCHER_STATES, DispatcherState, Kind

DISPATCHERS = RESOURCES[Kind.DISPATCHER]


class Fenced(Exception):
    """Raised where the capture would act after it fenced itself."""


class StatusWriter:
    def __init__(self, client: Client, runtime: DispatcherRuntime, lease: LeaseView) -> None:
        self.client = client
        self.rt = runtime
        self.lease = lease

    def traffic(self, name: str) -> tuple[float, int]:
        """Write rate and region count of a running dispatcher ((0, 0) if the runtime does not run it)."""
        try:
            return self.rt.write_rate(name), self.rt.region_count(name)
        except KeyError:
            return 0.0, 0

    async def write(self, d: Dispatcher, state: DispatcherState, cp: int, message: str = "") -> JSON:
        if self.lease.fence_reason and state in LIVE_DISPATCHER_STATES:
            raise Fenced(self.lease.fence_reason)
        record = d.evolve(state=state, checkpoint_ts=cp, heartbeat=round_time(time.time()), message=message)
        rate, regions = self.traffic(d.name) if state in LIVE_DISPATCHER_STATES else (0.0, 0)
        record = record.evolve(write_rate=rate, region_count=regions)
        self.rt.flush()  # the checkpoint written here must be delivered downstream first
        return await self.client.patch(DISPATCHERS, d.namespace, d.name, status_merge_patch(record), sub="status")
