"""Builds the admin API's Snapshot from the appliance's live state (Appliance.state)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, cast

from appliance.admin.device_stats import DeviceStats
from appliance.admin.latency_window import LatencyWindow
from appliance.admin.schema import (
    DeviceInfo,
    KVStoreView,
    RequestRow,
    Snapshot,
    WorkerInfo,
    WorkerPhase,
)
from appliance.api import Appliance
from appliance.core.request_table import Phase, Request
from appliance.pools.pool_state import StoreFigures, WorkerView

MAX_REQUEST_ROWS = 50
EVENTS_SHOWN = 20
FAULT_EVENTS_SHOWN = 20  # fault events, kept apart: a busy log of moves would push them out
RATE_INTERVAL_S = 1.0  # tokens/s is measured over at least this long
RowState = Literal["queued", "prefill", "handoff", "decode"]
# A request's phase as the admin API names it.
ROW_STATES: dict[Phase, RowState] = {
    Phase.WAITING: "queued",
    Phase.QUEUED: "queued",
    Phase.PREFILLING: "prefill",
    Phase.PARKED: "handoff",
    Phase.HANDING_OFF: "handoff",
    Phase.DECODING: "decode",
}


@dataclass
class _Rate:
    since: float
    count: int
    per_s: float = 0.0


class SnapshotBuilder:
    """One per server: keeps what rates need between snapshots (token counts, CPU times)."""

    def __init__(self, appliance: Appliance, latency: LatencyWindow, stats: DeviceStats) -> None:
        self.appliance = appliance
        self.latency = latency
        self.stats = stats
        self._rates: dict[int, _Rate] = {}  # worker id -> tokens produced

    def build(self) -> Snapshot:
        now = time.monotonic()
        appliance = self.appliance
        state = appliance.state
        views = state.views()
        pids = {v.pid for v in views if v.pid is not None}
        self.stats.forget_exited(pids | {p for v in views for p in v.shard_pids})
        requests = sorted(state.requests.values(), key=lambda r: r.request_id)
        return Snapshot(
            at=time.time(),
            model=appliance.model_name,
            mode=appliance.settings.mode,
            ready=appliance.ready,
            devices=self._devices(views, now),
            tuning=state.tuning,
            latency=self.latency.summary(now),
            requests=[_row(r, now) for r in requests[:MAX_REQUEST_ROWS]],
            requests_in_flight=len(requests),
            moves=list(appliance.pools.moves),
            events=list(state.events)[-EVENTS_SHOWN:],
            faults=dict(state.fault_counts),
            fault_events=list(state.fault_events)[-FAULT_EVENTS_SHOWN:],
            planner=appliance.autopilot.view(),
            kv_store=_kv_store_view(state.kv_store_figures),
        )

    def _devices(self, views: list[WorkerView], now: float) -> list[DeviceInfo]:
        # Every device of a tensor-parallel group shows its worker.
        by_device = {d: v for v in views if v.phase != "exited" for d in v.devices}
        by_device |= {d: v for v in views for d in v.devices if d not in by_device}
        devices = []
        for device in self.appliance.state.topology.devices:
            view = by_device.get(device.index)
            load = self.stats.sample(device, view.pid_on(device.index) if view else None, now)
            devices.append(
                DeviceInfo(
                    index=device.index,
                    name=device.name,
                    kind=device.kind,
                    box=device.box,
                    pool=view.role if view else None,
                    worker=self._worker(view, now) if view else None,
                    utilization=load.utilization,
                    memory_used=load.memory_used,
                    memory_total=load.memory_total,
                )
            )
        return devices

    def _worker(self, view: WorkerView, now: float) -> WorkerInfo:
        return WorkerInfo(
            worker_id=view.worker_id,
            # WorkerView types the phase str; it holds WorkerPhase's values (WorkerHandle.phase
            # returns only those), and pydantic checks it here too.
            role=view.role,
            phase=cast(WorkerPhase, view.phase),
            pid=view.pid,
            waiting=view.waiting,
            running=view.running,
            kv_blocks_used=view.num_blocks - view.num_free_blocks,
            kv_blocks_total=view.num_blocks,
            tokens_per_s=self._tokens_per_s(view, now),
            restarts=view.restarts,
            devices=list(view.devices),
            **speculation_figures(view),
        )

    def _tokens_per_s(self, view: WorkerView, now: float) -> float:
        rate = self._rates.get(view.worker_id)
        if rate is None:
            self._rates[view.worker_id] = _Rate(now, view.tokens_out)
            return 0.0
        if now - rate.since >= RATE_INTERVAL_S:
            rate.per_s = (view.tokens_out - rate.count) / (now - rate.since)
            rate.since, rate.count = now, view.tokens_out
        return rate.per_s


def speculation_figures(view: WorkerView) -> dict[str, float]:
    """WorkerInfo's speculative decoding figures, where the worker has verified drafts."""
    counts = view.speculation
    if not counts.verify_steps:
        return {}
    return {
        "spec_acceptance_rate": counts.rate,
        "spec_mean_accepted_length": counts.mean_emitted,
    }


def _row(request: Request, now: float) -> RequestRow:
    # A request that ended, its last chunk not yet read, shows where it ended.
    phase = request.previous if request.phase.terminal else request.phase
    return RequestRow(
        request_id=request.request_id,
        state=ROW_STATES[phase],
        prompt_tokens=len(request.prompt),
        output_tokens=len(request.output_ids),
        ttft_ms=request.timing.time_to_first_token(now) * 1000,
        prefill_worker=request.prefill_worker,
        decode_worker=request.decode_worker,
    )


# --- kv store (issue 41)


def _kv_store_view(figures: StoreFigures | None) -> KVStoreView | None:
    if figures is None:
        return None
    return KVStoreView.model_validate(figures, from_attributes=True)  # its fields, by name


# --- end kv store
