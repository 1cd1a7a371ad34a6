"""`appliance plan` (planner/plan.py, plan_report.py, plan_cli.py): which layouts a box has,
how they rank on hand-built profiles whose answer is plain, and the command's output."""

import json
from pathlib import Path

import pytest
from hand_profiles import hand_profile

from appliance.core.goodput import SLO
from appliance.planner.analytic import analytic_profile
from appliance.planner.plan import Plan, PlanSpec, at_rate, feasible_layouts, make_plan, parse_unit
from appliance.planner.plan_cli import main, sharegpt_like
from appliance.planner.plan_report import COLUMNS, table
from appliance.planner.profile import (
    HandoffCost,
    Profile,
    StepCost,
    WorkerCost,
)
from appliance.planner.simulator import Policy, SimRequest


def worker(prefill_per_token: float, decode_base: float, mixed_base: float) -> WorkerCost:
    return WorkerCost(
        prefill=StepCost(base_s=0.001, per_token_s=prefill_per_token),
        decode=StepCost(base_s=decode_base),
        mixed=StepCost(base_s=mixed_base, per_token_s=prefill_per_token),
        kv_blocks=10_000,
    )


FLAT = worker(0.0001, 0.005, 0.005)


def labels(layouts: list) -> set[str]:
    return {layout.label for layout in layouts}


def test_a_two_core_box_has_four_layouts_three_of_them_full() -> None:
    profile = hand_profile({"1x1": FLAT, "2x1": FLAT}, atoms=2)
    every = feasible_layouts(profile)
    assert labels(every) == {"colocated x1/2c", "colocated x2", "colocated x1", "1P+1D"}
    assert len(every) == 4
    assert labels(feasible_layouts(profile, full_only=True)) == {
        "colocated x1/2c",
        "colocated x2",
        "1P+1D",
    }


def test_gpu_boxes_have_every_split_and_tp_degree() -> None:
    four = analytic_profile("a100-80gb-sxm", 4, "opt-13b")  # tp 1, 2, 4
    # colocated: 4 + 2 + 1; splits: 6 of tp1:tp1, 2 each of tp1:tp2 and tp2:tp1, 1 tp2:tp2
    assert len(feasible_layouts(four)) == 7 + 11
    assert labels(feasible_layouts(four, full_only=True)) == {
        "colocated x4",
        "colocated x2(tp2)",
        "colocated x1(tp4)",
        "1P+3D",
        "2P+2D",
        "3P+1D",
        "2P+1D(tp2)",
        "1P(tp2)+2D",
        "1P(tp2)+1D(tp2)",
    }
    eight = analytic_profile("a100-80gb-sxm", 8, "opt-13b")  # tp 1, 2, 4, 8
    assert len(feasible_layouts(eight)) == 15 + 71
    full = feasible_layouts(eight, full_only=True)
    assert len(full) == 4 + 21
    assert all(layout.atoms == 8 for layout in full)
    assert "2P(tp2)+1D(tp4)" in labels(full)


def test_unit_names_are_checked() -> None:
    assert parse_unit("2x4") == (2, 4)
    with pytest.raises(ValueError, match="device_size"):
        parse_unit("tp2")


def test_same_requests_at_another_rate_arrive_proportionally_sooner() -> None:
    requests = [SimRequest(arrival_s=t, prompt_tokens=10, output_tokens=5) for t in (1.0, 3.0)]
    faster = at_rate(requests, base=2.0, rate=4.0)
    assert [r.arrival_s for r in faster] == [0.5, 1.5]
    assert faster[0].prompt_tokens == 10


def _plan(profile: Profile, rate: float, slo: SLO, requests: list[SimRequest]) -> Plan:
    spec = PlanSpec(rate=rate, slo=slo, steps=2, span=2, plot_best=2)
    return make_plan(profile, requests, spec, "test", Policy())


def test_costly_prompts_beside_cheap_decodes_make_a_prefill_heavy_split_win() -> None:
    # A prompt token costs 1 ms; a decode step 2 ms alone but 50 ms with a prompt chunk
    # beside it: colocated decodes miss a 20 ms TPOT whenever prompts arrive; split
    # pools keep TPOT at 2 ms, and 3 prefill workers keep TTFT lowest.
    slow_prompts = worker(0.001, 0.002, 0.05)
    profile = hand_profile({"1x1": slow_prompts}, atoms=4)
    requests = sharegpt_like(1, 200, 8.0, 4096)
    requests = [SimRequest(r.arrival_s, 200, 20) for r in requests]
    plan = _plan(profile, 8.0, SLO(ttft=1.0, tpot=0.02), requests)
    assert plan.best.label == "3P+1D"
    colocated = plan.best_colocated()
    assert colocated is not None and plan.best.max_rate > colocated.max_rate
    assert plan.best.gain is not None and plan.best.gain > 1
    assert plan.best.points and plan.best.points == sorted(plan.best.points, key=lambda p: p.rate)


def test_a_costly_handoff_makes_colocated_win() -> None:
    # Mixed steps cost what decode steps do (no interference) and each handoff takes
    # 0.5 s: splitting only adds that to every request's second token.
    profile = hand_profile({"1x1": FLAT}, atoms=2, handoff=HandoffCost(base_s=0.5, per_byte_s=0.0))
    requests = [SimRequest(0.25 * i + 0.1, 64, 16) for i in range(80)]
    plan = _plan(profile, 4.0, SLO(ttft=1.0, tpot=0.02), requests)
    assert plan.best.label == "colocated x2"
    assert plan.ranked[-1].label == "1P+1D"
    assert plan.ranked[-1].at_rate.attainment < 0.5
    rows = table(plan).splitlines()[2:]
    assert [row.split("|")[2].strip() for row in rows] == ["colocated x2", "1P+1D"]


def _save(tmp_path: Path) -> Path:
    return hand_profile({"1x1": FLAT, "2x1": FLAT}, atoms=2).save(tmp_path)


PLAN_ARGS = ["plan", "--workload", "sharegpt-like", "--rate", "2", "--num-requests", "20"]


def test_the_command_prints_json_the_user_can_parse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _save(tmp_path)
    code = main(
        [*PLAN_ARGS, "--goodput", "ttft:2000", "tpot:100", "--profile", str(path), "--json"]
    )
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["rate"] == 2 and plan["num_requests"] == 20
    assert plan["skipped_partial_layouts"] == 1  # colocated x1 leaves a core idle
    ranked = plan["layouts"]
    assert [item["rank"] for item in ranked] == [1, 2, 3]
    assert {item["label"] for item in ranked} == {"colocated x1/2c", "colocated x2", "1P+1D"}
    for item in ranked:
        assert 0 <= item["attainment"] <= 1 and item["goodput"] >= 0
        assert item["max_rate"] >= 0 and item["sweep"] is not None
        assert item["settings"]["mode"] in ("colocated", "disaggregated")


def test_the_command_prints_a_table_and_writes_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = _save(tmp_path), tmp_path / "out"
    args = [*PLAN_ARGS, "--goodput", "ttft:2000", "--profile", str(path), "--out", str(out)]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| rank"))
    assert [c.strip() for c in lines[header].strip("|").split("|")] == list(COLUMNS)
    rows = [line for line in lines[header + 2 :] if line.startswith("|")]
    assert len(rows) == 3
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[0] == "1" and cells[2] == "2/2" and float(cells[3]) > 0
    assert {p.name for p in out.iterdir()} == {"plan.json", "plan.md", "goodput_vs_rate.png"}
    assert "| rank |" in (out / "plan.md").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--goodput", "ttft:100"], "run `appliance profile`"),
        (["--goodput", "ttft:100", "--profile", "/nonexistent.json"], "cannot read profile"),
        (["--goodput", "ttft:abc", "--analytic", "h200"], "needs milliseconds"),
        (["--goodput", "ttft:100", "--analytic", "h200"], "needs --model-shape"),
    ],
)
def test_bad_input_is_a_clear_error_with_exit_2(
    args: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path))  # no profiles there
    assert main([*PLAN_ARGS, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_rate_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="positive request rate"):
        PlanSpec(rate=0, slo=SLO(ttft=1.0))
    with pytest.raises(ValueError, match="needs an SLO"):
        PlanSpec(rate=1, slo=SLO())
