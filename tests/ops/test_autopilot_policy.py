"""The policy the autopilot's simulator ranks layouts with is the box's: SLO admission
where an SLO is configured (the supervisor's flow holds prompts by it), first come, first
served where none is. In process: a Supervisor that starts no workers."""

from __future__ import annotations

from pathlib import Path

from appliance.core.admission import AdmissionLimits
from appliance.ops.autopilot import Autopilot
from appliance.ops.pool_moves import PoolMover
from appliance.pools.supervisor import Supervisor
from appliance.settings.config import Settings, load_settings


def autopilot_of(settings: Settings) -> Autopilot:
    supervisor = Supervisor(settings)
    return Autopilot(supervisor, PoolMover(supervisor, 10.0), settings)


def test_with_an_slo_configured_the_autopilot_simulates_slo_admission(tmp_path: Path) -> None:
    planner = {"slo_ttft_ms": 8000, "slo_tpot_ms": 60}
    settings = load_settings(device="cpu", cpu_devices=2, cache_dir=tmp_path, planner=planner)
    autopilot = autopilot_of(settings)
    assert autopilot.supervisor.flow.admission.limits == AdmissionLimits.from_slo(8.0, 0.060)
    assert autopilot.policy().admission == autopilot.supervisor.flow.admission.limits


def test_without_an_slo_or_with_fcfs_it_simulates_first_come_first_served(
    tmp_path: Path,
) -> None:
    plain = load_settings(device="cpu", cpu_devices=2, cache_dir=tmp_path)
    assert autopilot_of(plain).policy().admission is None
    planner = {"slo_ttft_ms": 8000, "slo_tpot_ms": 60, "scheduling_policy": "fcfs"}
    fcfs = load_settings(device="cpu", cpu_devices=2, cache_dir=tmp_path, planner=planner)
    assert autopilot_of(fcfs).policy().admission is None
