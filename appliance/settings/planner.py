"""The planner's section of the settings model (appliance/settings/config.py, which re-exports it):
how `appliance serve` picks its pool layout."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class PlannerSettings(BaseModel):
    """Letting the server choose its layout from a profile of this box (`appliance profile`)
    and the traffic it expects (`appliance plan` shows the same ranking)."""

    model_config = ConfigDict(extra="forbid")

    layout: Literal["manual", "auto"] = Field(
        "auto",
        description="auto (the default) runs the layout the planner ranks first for the "
        "workload, rate and SLO below from this box's profile, and without a profile starts "
        "at once on a rule (CPU: every device colocated; GPU: the automatic split); any of "
        "mode, prefill_devices, decode_devices, colocated_devices, prefill_tp, decode_tp "
        "given keeps the layout as set. auto given by name replaces those settings (and "
        "cpu_devices) and needs a profile. manual runs the layout settings as set.",
    )
    profile: Path | None = Field(
        None,
        description="The profile to plan with; empty means the newest one for this model "
        "under <cache_dir>/profiles.",
    )
    profile_at_start: bool = Field(
        False,
        description="With layout auto and no profile for this model: profile the box "
        "first (a few minutes) instead of refusing to start.",
    )
    workload: Literal["chat", "long-burst", "fixed", "shared-prefix"] = Field(
        "chat", description="The traffic to plan for (the bench's workloads)."
    )
    rate: float = Field(1.0, gt=0, description="Expected requests per second.")
    slo_ttft_ms: float = Field(
        2000.0, gt=0, description="Time to first token a request must meet to count as good."
    )
    slo_tpot_ms: float = Field(
        100.0, gt=0, description="Time per output token a request must meet to count as good."
    )
    scheduling_policy: Literal["slo", "fcfs"] = Field(
        "slo",
        description="slo (the default): where an SLO is configured (slo_ttft_ms or "
        "slo_tpot_ms set), a new prompt waits in the supervisor's queue while the worker "
        "that would decode it is predicted (its fitted step cost) to step slower than 80% "
        "of slo_tpot_ms with it, so a backlog drains instead of making every stream miss; "
        "none waits longer than 3/4 of slo_ttft_ms, and every request runs. Without a "
        "configured SLO it acts as fcfs. fcfs: every prompt goes to a worker at once, in "
        "arrival order.",
    )
    num_requests: int = Field(
        1000, ge=10, le=100_000, description="Requests simulated per layout when planning."
    )
    auto_rebalance: bool = Field(
        True,
        description="Autopilot: move one device at a time between prefill, decode and "
        "colocated when the traffic of the last window would be served better one move "
        "away (with the profile above). By default it moves only a layout the planner "
        "chose (planner.layout auto, no layout setting given): a layout the settings pin "
        "is only recommended for, unless auto_rebalance is given by name (flag, variable "
        "or file), which applies to any layout. Off, the planner still recommends "
        "(console, /admin/planner) and a move applies only when asked.",
    )
    interval_s: float = Field(
        10.0, gt=0, description="How often the rebalancer looks at the traffic."
    )
    window_s: float = Field(
        30.0, gt=0, description="The traffic it looks at: requests that arrived this long ago."
    )
    margin: float = Field(
        0.15,
        ge=0,
        description="Predicted goodput gain (a fraction: 0.15 = 15%) a move must clear.",
    )
    target_attainment: float = Field(
        0.9,
        gt=0,
        le=1,
        description="No move while at least this fraction of the window's requests meet the "
        "SLO (slo_ttft_ms, slo_tpot_ms).",
    )
    cooldown_s: float = Field(
        60.0,
        ge=0,
        description="No move within this long after the last one (the second step of a "
        "two-move path and a rollback aside).",
    )
    dwell_s: float = Field(
        90.0,
        ge=0,
        description="After a move, the layout it left is not moved back to for this long, "
        "unless the move back is a rollback.",
    )
    hold_off_s: float = Field(
        300.0,
        ge=0,
        description="A layout rolled back from (it measured a lower attainment than the "
        "layout before it on similar traffic) is not moved to again for this long, while "
        "the traffic stays similar.",
    )
    remember_s: float = Field(
        600.0,
        ge=0,
        description="How long what a layout measured (attainment, goodput, the traffic's "
        "rate and lengths) counts beside what the simulator predicts.",
    )
    confirm_windows: int = Field(
        2, ge=1, description="Looks in a row that must recommend the same move first."
    )
    min_requests: int = Field(
        8, ge=1, description="Fewer requests in the window than this: no move."
    )
    decisions_log: Path | None = Field(
        None,
        description="Append every decision of the rebalancer, with its inputs (each "
        "layout's simulated goodput, the measured figures, the layouts barred and why, the "
        "rule that decided), as one JSON line to this file; empty: none.",
    )
