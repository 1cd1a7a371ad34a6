"""`appliance profile`: the profile file (versioned JSON, clear errors), the fit of step
costs to timed steps, the step shapes timed, and a real profile of the default model in
worker processes bound to this machine's cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hand_profiles import hand_profile

from appliance.planner.fitting import fit_step_cost
from appliance.planner.profile import (
    PROFILE_VERSION,
    HandoffCost,
    HostCost,
    Profile,
    ProfileError,
    ProfileKey,
    StepCost,
    WorkerCost,
    attended,
    load_profile,
    model_id,
    newest_profile,
    worker_unit,
)
from appliance.planner.profiler import cpu_unit_runs
from appliance.planner.step_probe import StepShape, default_shapes

KEY = ProfileKey(model="m.gguf (10 bytes)", dtype="float32", weights="quantized", device_kind="cpu")


def a_profile(model: str = KEY.model) -> Profile:
    step = StepCost(base_s=0.01, per_token_s=0.001)
    worker = WorkerCost(prefill=step, decode=step, mixed=step, kv_blocks=100)
    return hand_profile(
        {"1x1": worker},
        key=KEY.model_copy(update={"model": model}),
        max_model_len=2048,
        handoff=HandoffCost(base_s=0.001, per_byte_s=1e-9),
        host=HostCost(per_step_s=0.0005, per_token_s=0.0001),
    )


def samples_of(cost: StepCost, rows: list[dict[str, int]]) -> list[dict[str, float | int | str]]:
    return [{**row, "seconds": cost.seconds(**row)} for row in rows]


def test_a_fit_recovers_the_costs_that_made_the_times() -> None:
    truth = StepCost(base_s=0.004, per_token_s=0.002, per_seq_s=0.0005, per_attended_s=1e-6)
    rows = [
        {"tokens": n * k, "seqs": k, "attended": k * attended(0, n), "context": 0}
        for n in (16, 64, 256, 512)
        for k in (1, 2, 4)
    ]
    fitted = fit_step_cost(samples_of(truth, rows), ("tokens", "seqs", "attended"))
    for name in ("base_s", "per_token_s", "per_seq_s", "per_attended_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)


def test_a_feature_that_would_cost_less_than_nothing_is_dropped() -> None:
    # Times that fall a little with context: a free fit would give it a negative cost.
    rows = [
        {"tokens": b, "seqs": b, "attended": 0, "context": b * c}
        for b in (1, 8)
        for c in (64, 1024)
    ]
    samples = [{**r, "seconds": 0.01 + 0.001 * r["seqs"] - 1e-8 * r["context"]} for r in rows]
    fitted = fit_step_cost(samples, ("seqs", "context"))
    assert fitted.per_context_s == 0.0
    assert fitted.per_seq_s > 0 and fitted.base_s > 0


def test_fitting_refuses_what_it_cannot_fit() -> None:
    with pytest.raises(ValueError, match="unknown step features"):
        fit_step_cost([{"tokens": 1, "seconds": 1.0}], ("bytes",))
    with pytest.raises(ValueError, match="no timed steps"):
        fit_step_cost([], ("tokens",))


def test_a_profile_round_trips_through_its_file(tmp_path: Path) -> None:
    profile = a_profile()
    path = profile.save(tmp_path)
    assert path.name.startswith(f"profile-v{PROFILE_VERSION}-")
    assert load_profile(path) == profile


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not JSON"),
        (json.dumps({"version": 99}), "version 99 profile; this appliance reads version"),
        (json.dumps({"version": PROFILE_VERSION, "atoms": 2}), "key: Field required"),
    ],
)
def test_a_bad_profile_file_says_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message):
        load_profile(path)
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(tmp_path / "missing.json")


def test_the_newest_profile_of_the_model_is_the_one_planned_with(tmp_path: Path) -> None:
    old, other, new = a_profile(), a_profile("other (1 bytes)"), a_profile()
    old = old.model_copy(update={"atoms": 4})
    old.save(tmp_path)
    os.utime(tmp_path / old.key.file_name(), (1, 1))  # long ago
    other.save(tmp_path)
    assert newest_profile(tmp_path, KEY.model) == old
    # Same key, so the same file: a new profile of this model replaces the old one.
    new.save(tmp_path)
    assert newest_profile(tmp_path, KEY.model) == new
    assert newest_profile(tmp_path, "absent (0 bytes)") is None


def test_a_model_is_named_by_its_file_and_size(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 10)
    assert model_id(model) == "m.gguf (10 bytes)"


def test_a_missing_worker_size_is_a_clear_error() -> None:
    with pytest.raises(ProfileError, match=r"no worker of size 2x1 \(it has 1x1\)"):
        a_profile().worker("2x1")
    with pytest.raises(ValueError, match="tp >= 1"):
        worker_unit(1, 0)


def test_the_step_shapes_fit_the_pool_and_the_chunk_size() -> None:
    shapes = default_shapes(max_tokens=4096, chunk_size=256, block_size=16)
    assert {s.kind for s in shapes} == {"prefill", "decode", "mixed"}
    assert all(s.blocks(16) * 16 <= 4096 for s in shapes)
    assert all(n <= 256 for s in shapes for _, n in s.chunks)
    step = StepShape(chunks=((32, 16),), decodes=(100, 50))
    assert step.features() == {
        "tokens": 18,
        "seqs": 3,
        "attended": 16 * 32 + 136,
        "context": 150,
        "prompt_tokens": 16,
    }


def test_a_cpu_box_is_timed_whole_halved_and_quartered() -> None:
    assert [r.unit for r in cpu_unit_runs(1)] == ["1x1"]
    runs = cpu_unit_runs(len(os.sched_getaffinity(0)))
    assert runs[-1].busy == ()  # the whole box: nothing beside it to keep busy
    assert all(len(r.device.cores) == int(r.unit.split("x")[0]) for r in runs)


@pytest.mark.process
@pytest.mark.extended  # a whole profile of the real model: the extended lane
def test_profiling_the_default_model_times_each_worker_size(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    # Prompt chunks of at most 128 tokens, not 512: the same step kinds, worker sizes,
    # contention and handoff are timed, at about a quarter of the prefill work (most of
    # this test's time); the fits below still extrapolate to 512.
    done = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "profile", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "APPLIANCE_BATCH__CHUNK_SIZE": "128"},
    )
    assert done.returncode == 0, done.stderr
    assert "profile written to" in done.stdout and "timing worker size" in done.stderr
    profile = load_profile(out)
    cores = len(os.sched_getaffinity(0))
    assert profile.atoms == cores
    assert set(profile.workers) == {r.unit for r in cpu_unit_runs(cores)}
    assert profile.key.model.startswith("SmolLM2") and profile.key.device_kind.startswith("cpu")
    for cost in profile.workers.values():
        assert cost.kv_blocks > 0 and cost.contention >= 1.0
        small, large = (cost.decode.seconds(b, b, 0, b * 256) for b in (1, 32))
        assert 0 < small < large  # a batch of 32 costs more than one sequence
        short, long = (cost.prefill.seconds(n, 1, attended(0, n), 0) for n in (16, 512))
        assert 0 < short < long
    kinds = {s["kind"] for s in profile.samples}
    assert kinds == {"prefill", "decode", "mixed"}
    assert profile.handoff.per_byte_s > 0 and profile.host.per_token_s > 0
