"""The read-only view of the pools that the HTTP server, the admin API and the metrics
read. The supervisor provides it; they see only this, so the supervisor can change
inside without them (actions go through Appliance's methods, never through this view)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Protocol

from appliance.core.events import Event
from appliance.core.request_table import Request
from appliance.core.tuning import Tuning
from appliance.pools.kv_store_owner import StoreFigures as StoreFigures  # what it shows
from appliance.pools.worker_handle import WorkerView as WorkerView  # what a view shows
from appliance.topology.devices import Topology


class PoolState(Protocol):
    """The read-only view of the pools that the server, admin API and metrics read.

    Members are read-only properties so that plain attributes of the supervisor satisfy
    them; what they return is the live state, to read and not to change."""

    @property
    def tuning(self) -> Tuning:
        """The knobs in force (admission, routing, batching limits)."""
        ...

    @property
    def topology(self) -> Topology:
        """The devices the pools run on."""
        ...

    @property
    def failed_devices(self) -> AbstractSet[int]:
        """Devices whose workers kept crashing and are no longer restarted."""
        ...

    @property
    def events(self) -> Sequence[Event]:
        """The latest events for the admin API, oldest first."""
        ...

    @property
    def fault_events(self) -> Sequence[Event]:
        """The latest fault events, oldest first, however many other events came since."""
        ...

    @property
    def fault_counts(self) -> Mapping[str, int]:
        """Fault and recovery events since the start, by kind (core/events.py)."""
        ...

    @property
    def requests(self) -> Mapping[int, Request]:
        """Every request in flight by id, oldest first."""
        ...

    def views(self) -> list[WorkerView]:
        """A snapshot of every worker's state and load."""
        ...

    def pending_handoffs(self) -> int:
        """Handoffs sent to a decode worker and not yet answered."""
        ...

    @property
    def kv_store_figures(self) -> StoreFigures | None:
        """The box's KV store: what it holds and served; None while it is off or not open."""
        ...
