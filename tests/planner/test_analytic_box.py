"""A GPU box without a profile plans on the analytic profile of the cards NVML reports
(recorded boxes as data: there is no GPU here), and says why where it cannot."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from hand_profiles import hand_profile
from nvml_boxes import H100_NVSWITCH, MIB, MIXED, PCIE_4GPU, TWO_GPU_NO_P2P, cpu_box, gpus

from appliance.model.model_source import default_model_path
from appliance.ops.autopilot import Autopilot
from appliance.planner import auto_layout
from appliance.planner.analytic_box import box_profile, gpu_preset
from appliance.planner.auto_layout import (
    analytic_base,
    best_layout,
    box_kind,
    known_profile,
    ruled_settings,
)
from appliance.planner.layout import Layout
from appliance.planner.profile import (
    Profile,
    ProfileKey,
    StepCost,
    WorkerCost,
    model_id,
    newest_profile,
    profiles_folder,
    worker_unit,
)
from appliance.settings.config import Settings, load_settings


@dataclass(frozen=True)
class Shape:
    """A model's shape as its config gives it (Llama-3-8B's by default)."""

    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 128256
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    num_experts: int = 0


@pytest.mark.parametrize(
    ("name", "mib", "preset"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "h100-80gb-sxm"),
        ("NVIDIA H200", 143771, "h200"),
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-80gb-sxm"),
        ("NVIDIA A100-PCIE-40GB", 40960, "a100-40gb-pcie"),
        ("NVIDIA L40S", 46068, "l40s"),
        ("NVIDIA GeForce RTX 4090", 24564, "rtx-4090"),
        # no preset is these cards: a PCIe H100 has less bandwidth and compute than the
        # SXM one, a 40 GB SXM A100 half the memory, a MIG slice a share of its card
        ("NVIDIA H100 PCIe", 81559, None),
        ("NVIDIA A100-SXM4-40GB", 40960, None),
        ("NVIDIA A100 80GB PCIe", 81920, None),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 9728, None),
        ("NVIDIA H200 NVL", 143771, None),
        ("Tesla V100-SXM2-32GB", 32768, None),
    ],
)
def test_a_card_takes_the_preset_of_its_datasheet(name: str, mib: int, preset: str | None) -> None:
    assert gpu_preset(name, mib * MIB) == preset


def test_an_hgx_h100_box_gets_a_worker_of_every_tp_degree() -> None:
    profile, about = box_profile(gpus(H100_NVSWITCH), Shape(), "llama-3-8b")
    assert profile is not None, about
    assert about == "the analytic profile of 8x NVIDIA H100-80GB SXM (datasheet)"
    assert profile.analytic and profile.atoms == 8
    assert set(profile.workers) == {worker_unit(1, tp) for tp in (1, 2, 4, 8)}
    # the same box of larger cards holds more KV per worker
    h200 = {
        "gpus": [
            {**gpu, "name": "NVIDIA H200", "total": 143771 * MIB} for gpu in H100_NVSWITCH["gpus"]
        ],
        "p2p": True,
    }
    bigger, _ = box_profile(gpus(h200), Shape(), "llama-3-8b")
    assert bigger is not None
    assert bigger.workers["1x1"].kv_blocks > profile.workers["1x1"].kv_blocks


@pytest.mark.parametrize(
    ("box", "shape", "why"),
    [
        (MIXED, Shape(), "cards of several kinds"),
        (PCIE_4GPU, Shape(), "no datasheet preset for NVIDIA A100 80GB PCIe (80 GiB)"),
        (H100_NVSWITCH, Shape(num_experts=8), "is a mixture of experts"),
        # 405B in bf16 is 810 GB: no worker of up to 2 RTX 4090s holds it
        (
            TWO_GPU_NO_P2P,
            Shape(hidden_size=16384, intermediate_size=53248, num_layers=126, num_heads=128),
            "fits no worker",
        ),
    ],
)
def test_without_a_preset_or_a_dense_shape_there_is_no_analytic_profile(
    box: dict, shape: Shape, why: str
) -> None:
    profile, about = box_profile(gpus(box), shape, "model")
    assert profile is None
    assert why in about


def test_a_gpu_box_without_a_profile_runs_the_planners_best_on_its_cards(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded model on a recorded HGX H100: the layout `serve` starts is the one the
    planner ranks first on the analytic profile, not the fixed split. The ranking (about a
    second of simulation) runs once: recorded as ruled_settings asks for it, not run again."""
    settings = load_settings(device="cuda", planner={"num_requests": 40})
    topology = gpus(H100_NVSWITCH)
    profile, _ = analytic_base(settings, topology)
    assert profile is not None
    ranked: list[tuple[Settings, Profile, Layout]] = []

    def recorded(asked: Settings, on: Profile) -> Layout:
        layout = best_layout(asked, on)
        ranked.append((asked, on, layout))
        return layout

    monkeypatch.setattr(auto_layout, "best_layout", recorded)
    with caplog.at_level(logging.INFO, logger="appliance.planner"):
        ruled = ruled_settings(settings, topology)
    [(asked, on, planned)] = ranked
    assert asked is settings and on == profile  # the planner's first for these, on this box
    assert ruled.mode == planned.settings()["mode"]
    for name, value in planned.settings().items():
        assert getattr(ruled, name) == value
    assert "on the analytic profile of 8x NVIDIA H100-80GB SXM" in caplog.text


def test_cards_without_a_preset_start_split_and_say_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = load_settings(device="cuda")
    with caplog.at_level(logging.INFO, logger="appliance.planner"):
        ruled = ruled_settings(settings, gpus(PCIE_4GPU))
    assert ruled is settings  # the split the settings describe
    assert "pools split (no profile yet, no datasheet preset for NVIDIA A100 80GB PCIe" in (
        caplog.text
    )


def test_the_autopilot_of_a_gpu_box_without_a_profile_starts_from_its_cards(
    tmp_path: Path,
) -> None:
    """With no profile on disk the autopilot plans on the analytic profile (refined by the
    steps the workers run) on a GPU box; on a CPU box it has none until steps fit."""
    settings = load_settings(device="cuda", planner={"profile": None})
    # A cache with no profile in it, holding the model the real one has converted (a cold
    # one would spend ~10 s converting the embedded GGUF's tokenizer first).
    for entry in settings.cache_dir.iterdir():
        if entry.name != "profiles":
            (tmp_path / entry.name).symlink_to(entry)
    settings = settings.model_copy(update={"cache_dir": tmp_path})
    on_gpus = Autopilot(SimpleNamespace(topology=gpus(H100_NVSWITCH)), None, settings)
    profile, status = on_gpus._find_profile()
    assert profile is not None and profile.atoms == 8
    assert "planning on the analytic profile of 8x NVIDIA H100-80GB SXM" in status
    on_cpus = Autopilot(SimpleNamespace(topology=cpu_box(2, 2)), None, settings)
    profile, status = on_cpus._find_profile()
    assert profile is None
    assert "learning the step costs from the steps the workers run" in status


def test_a_cpu_profile_on_disk_does_not_plan_a_gpu_box(tmp_path: Path) -> None:
    """A profile made on this box's CPUs (say, before its driver worked) is no plan for its
    GPUs: the planner looks only for profiles of the box's kind of device."""
    step = StepCost(base_s=0.01, per_token_s=0.001)
    cost = WorkerCost(prefill=step, decode=step, mixed=step, kv_blocks=100)
    model = model_id(default_model_path())
    key = ProfileKey(model=model, dtype="float32", weights="quantized", device_kind="cpu: test")
    hand_profile({"1x1": cost}, key=key).save(profiles_folder(tmp_path))
    folder = profiles_folder(tmp_path)
    assert newest_profile(folder, model) is not None
    assert newest_profile(folder, model, "cpu") is not None
    assert newest_profile(folder, model, "cuda") is None
    settings = load_settings(cache_dir=tmp_path)
    assert known_profile(settings, box_kind(gpus(H100_NVSWITCH)))[0] is None
    assert known_profile(settings, box_kind(cpu_box(2, 2)))[0] is not None
