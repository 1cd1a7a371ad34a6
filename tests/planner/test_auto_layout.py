"""`serve` runs the layout the planner ranks first, from a profile on disk; without one, a
rule (colocated on a CPU box) unless auto was asked for by name, which refuses and says
what to do; settings that name a layout pin it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hand_profiles import hand_profile
from server_process import ServerProcess

from appliance.admin.schema import Snapshot
from appliance.model.gguf_cache import gguf_entry
from appliance.model.model_source import default_model_path
from appliance.planner import auto_layout
from appliance.planner.auto_layout import (
    autopilot_resolved,
    best_layout,
    layout_pins,
    layout_settings,
    moves_itself,
    planned_settings,
)
from appliance.planner.layout import Layout, Pool
from appliance.planner.plan_memo import PlanMemo
from appliance.planner.profile import (
    HandoffCost,
    HostCost,
    Profile,
    ProfileKey,
    StepCost,
    WorkerCost,
    model_id,
)
from appliance.settings.config import PlannerSettings, Settings, SettingsError, load_settings

PLAN_ENV = {
    "APPLIANCE_PLANNER__WORKLOAD": "chat",
    "APPLIANCE_PLANNER__RATE": "3",
    "APPLIANCE_PLANNER__SLO_TTFT_MS": "2000",
    "APPLIANCE_PLANNER__SLO_TPOT_MS": "200",
    "APPLIANCE_PLANNER__NUM_REQUESTS": "100",
}


def prompt_bound_profile() -> Profile:
    """A 2-core box whose one-core workers prefill slowly and decode fast, and whose
    two-core worker is slow at everything: at 3 chat requests a second one prefill
    worker cannot keep up, two colocated ones can; so colocated x2 wins."""
    prompt = StepCost(base_s=0.002, per_token_s=0.0012)
    decode = StepCost(base_s=0.004, per_seq_s=0.0002)
    mixed = StepCost(base_s=0.004, per_token_s=0.0012, per_seq_s=0.0002)
    fast = WorkerCost(prefill=prompt, decode=decode, mixed=mixed, kv_blocks=2000)
    slow_step = StepCost(base_s=0.05, per_token_s=0.01, per_seq_s=0.01)
    slow = WorkerCost(prefill=slow_step, decode=slow_step, mixed=slow_step, kv_blocks=2000)
    key = ProfileKey(
        model=model_id(default_model_path()),
        dtype="float32",
        weights="quantized",
        device_kind="cpu: test",
    )
    return hand_profile(
        {"1x1": fast, "2x1": slow},
        key=key,
        kv_bytes_per_token=46080,
        max_model_len=8192,
        handoff=HandoffCost(base_s=0.001, per_byte_s=1e-10),
        host=HostCost(per_step_s=0.0005, per_token_s=0.00005),
    )


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    path.write_text(prompt_bound_profile().model_dump_json())
    return path


def test_the_planner_picks_two_colocated_workers_on_a_prompt_bound_box(profile_file: Path) -> None:
    planner = PlannerSettings(
        workload="chat", rate=3, slo_ttft_ms=2000, slo_tpot_ms=200, num_requests=100
    )
    settings = load_settings(planner=planner)
    layout = best_layout(settings, prompt_bound_profile())
    assert layout == Layout(mode="colocated", prefill=Pool(workers=2))
    assert layout_settings(layout, prompt_bound_profile()) == {
        "mode": "colocated",
        "prefill_tp": 1,
        "prefill_devices": (0, 1),
        "cpu_devices": 2,
        "device": "cpu",
    }


@pytest.mark.process
def test_serve_layout_auto_runs_the_planned_layout(profile_file: Path) -> None:
    server = ServerProcess(
        {
            **PLAN_ENV,
            "APPLIANCE_PLANNER__LAYOUT": "auto",
            "APPLIANCE_PLANNER__PROFILE": str(profile_file),
        }
    )
    server.start()
    try:
        token = Path(load_settings(port=server.port).admin_token_path()).read_text()
        reply = httpx.get(
            server.url + "/admin/state", headers={"Authorization": f"Bearer {token}"}, timeout=10
        )
        snap = Snapshot.model_validate(reply.json())
        # Without the plan this box would run 1 prefill + 1 decode worker (the automatic split).
        assert snap.mode == "colocated"
        assert sorted(d.index for d in snap.devices if d.worker is not None) == [0, 1]
        assert {d.pool for d in snap.devices} == {"colocated"}
        answer = httpx.post(
            server.url + "/v1/completions",
            json={"model": snap.model, "prompt": "Hello", "max_tokens": 4},
            timeout=120,
        )
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0


@pytest.mark.process
def test_serve_layout_auto_without_a_profile_refuses_and_says_what_to_do(tmp_path: Path) -> None:
    env = {"APPLIANCE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "serve", "--layout", "auto"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert done.returncode == 2
    assert "run `appliance profile`" in done.stderr and "PROFILE_AT_START" in done.stderr


def test_settings_that_name_a_layout_pin_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APPLIANCE_MODE", raising=False)
    assert layout_pins(load_settings()) == ()
    assert layout_pins(load_settings(mode="disaggregated")) == ("mode",)
    assert layout_pins(load_settings(prefill_devices="0", decode_devices="1")) == (
        "prefill_devices",
        "decode_devices",
    )
    assert layout_pins(load_settings(planner={"layout": "manual"})) == ("planner.layout=manual",)
    # auto by name replaces the layout settings, as `serve --layout auto` always did
    assert layout_pins(load_settings(mode="colocated", planner={"layout": "auto"})) == ()
    monkeypatch.setenv("APPLIANCE_MODE", "disaggregated")
    assert layout_pins(load_settings()) == ("mode",)  # from the environment too


def test_the_autopilot_moves_a_layout_the_planner_chose_and_only_recommends_a_pinned_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("APPLIANCE_MODE", raising=False)
    assert moves_itself(load_settings())  # the default: the planner's layout, moved
    assert not moves_itself(load_settings(mode="disaggregated"))  # pinned: recommended
    assert not moves_itself(load_settings(planner={"layout": "manual"}))
    assert moves_itself(load_settings(mode="disaggregated", planner={"auto_rebalance": True}))
    assert not moves_itself(load_settings(planner={"auto_rebalance": False}))
    # Planning names the layout it runs (which reads as pinned): resolved before, it stays.
    fresh = autopilot_resolved(load_settings(cache_dir=tmp_path, device="cpu"))
    planned = planned_settings(fresh)
    assert planned.mode == "colocated" and moves_itself(planned)
    pinned = planned_settings(autopilot_resolved(load_settings(mode="disaggregated")))
    assert not moves_itself(pinned) and pinned.planner.auto_rebalance is False


def test_without_a_profile_a_cpu_box_runs_every_device_colocated(tmp_path: Path) -> None:
    fresh = load_settings(cache_dir=tmp_path, device="cpu")
    assert fresh.mode == "disaggregated"  # the settings' own default: the Python API's
    assert planned_settings(fresh).mode == "colocated"
    pinned = load_settings(cache_dir=tmp_path, device="cpu", mode="disaggregated")
    assert planned_settings(pinned) is pinned
    with pytest.raises(SettingsError, match="run `appliance profile`"):
        planned_settings(load_settings(cache_dir=tmp_path, planner={"layout": "auto"}))


@pytest.mark.process
def test_a_fresh_serve_starts_at_once_on_the_rule(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    # Fresh to the planner (no profile in its cache), with the model's converted tokenizer
    # and facts linked in: converting them again (about 8 s) is any first start's work,
    # not the layout's (tests/model/test_model_loader.py holds it).
    entry = gguf_entry(default_model_path(), load_settings().cache_dir)
    (cache / entry.name).symlink_to(entry, target_is_directory=True)
    server = ServerProcess(
        {
            "APPLIANCE_CACHE_DIR": str(cache),
            "APPLIANCE_ADMIN__TOKEN_FILE": str(tmp_path / "admin.token"),
        },
        split_unless_named=False,
    )
    server.start()
    try:
        token = (tmp_path / "admin.token").read_text()
        reply = httpx.get(
            server.url + "/admin/state", headers={"Authorization": f"Bearer {token}"}, timeout=10
        )
        snap = Snapshot.model_validate(reply.json())
        assert snap.mode == "colocated"
        assert {d.pool for d in snap.devices if d.worker is not None} == {"colocated"}
        assert len([d for d in snap.devices if d.worker is not None]) == len(
            os.sched_getaffinity(0)
        )
        assert any("layout: colocated on every device" in line for line in server.output)
        assert snap.planner is not None and snap.planner.auto_rebalance  # the planner's own
    finally:
        assert server.stop() == 0


def test_the_auto_layout_is_ranked_once_per_question_then_remembered(
    profile_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranked: list[float] = []
    rank = auto_layout.best_layout

    def counted(settings: Settings, profile: Profile) -> Layout:
        ranked.append(settings.planner.rate)
        return rank(settings, profile)

    monkeypatch.setattr(auto_layout, "best_layout", counted)
    monkeypatch.setattr(auto_layout, "PlanMemo", lambda _folder: PlanMemo(tmp_path))
    planner = {"layout": "auto", "profile": profile_file, "rate": 3, "num_requests": 15}
    settings = load_settings(planner={**planner, "slo_ttft_ms": 2000, "slo_tpot_ms": 200})
    first, second = planned_settings(settings), planned_settings(settings)
    assert ranked == [3]
    assert (first.mode, first.prefill_devices, first.cpu_devices) == ("colocated", (0, 1), 2)
    assert (second.mode, second.prefill_devices, second.cpu_devices) == ("colocated", (0, 1), 2)
    planned_settings(
        settings.model_copy(update={"planner": settings.planner.model_copy(update={"rate": 0.5})})
    )
    assert ranked == [3, 0.5]  # other traffic: ranked again
    for kept in tmp_path.glob("*.json"):
        kept.write_text("{")  # a file cut short: ranked again, not trusted
    assert planned_settings(settings).prefill_devices == (0, 1) and ranked == [3, 0.5, 3]
