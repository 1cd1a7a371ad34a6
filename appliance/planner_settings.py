"""The planner's section of the settings model (appliance/config.py, which re-exports it):
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
        "manual",
        description="manual runs mode/prefill_devices/decode_devices as set; auto runs the "
        "layout the planner ranks first for the workload, rate and SLO below (it replaces "
        "those settings and cpu_devices).",
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
    num_requests: int = Field(
        1000, ge=10, le=100_000, description="Requests simulated per layout when planning."
    )
