"""What each dispatcher's traffic is: its share of its Table's ``spec.writeRate`` and ``spec.regionCount``, which the
maintainer's split and merge schedulers judge by. The Tables are re-read every ``interval`` while dispatchers run;
what moved is returned, so that the dispatchers of those Tables are looked at (at rest, nothing is)."""

from __future__ import annotations

import contextlib
import logging
import time

from controller.capture.logs import fields
from controller.kube.client import RESOURCES, TRANSPORT_ERRORS, ApiError, Client
from controller.model.records import Dispatcher
from controller.model.states import Kind

log = logging.getLogger("controller.capture")
TABLES = RESOURCES[Kind.TABLE]


class TableRates:
    def __init__(self, client: Client, namespace: str, interval: float) -> None:
        self.client = client
        self.namespace = namespace
        self.interval = interval
        #: (changefeed, table ID) -> (write rate, region count), from the Tables as last listed.
        self.rates: dict[tuple[str, int], tuple[float, int]] = {}
        self._at = -1e9

    def of(self, d: Dispatcher) -> tuple[float, int]:
        return self.rates.get((d.changefeed, d.table_id), (0.0, 0))

    async def refresh(self) -> set[tuple[str, int]]:
        """List the Tables again if ``interval`` has passed; the (changefeed, table ID) whose traffic moved."""
        if time.monotonic() - self._at < self.interval:
            return set()
        self._at = time.monotonic()
        try:
            items, _ = await self.client.list(TABLES, self.namespace)
        except (ApiError, *TRANSPORT_ERRORS) as exc:
            log.warning("could not list Tables", extra=fields(error=repr(exc)))
            return set()
        rates: dict[tuple[str, int], tuple[float, int]] = {}
        for item in items:
            spec = item.get("spec") or {}
            with contextlib.suppress(KeyError, TypeError, ValueError):
                key = (str(spec.get("changefeed")), int(spec["tableID"]))
                rates[key] = (float(spec.get("writeRate") or 0.0), int(spec.get("regionCount") or 0))
        moved = {k for k in rates.keys() | self.rates.keys() if rates.get(k) != self.rates.get(k)}
        self.rates = rates
        return moved
