"""The auto layout's remembered choices (plan_memo.py), on plain data."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance.planner.plan_memo import Choice, PlanMemo, code_digest, memo_key

TRAFFIC = {"workload": "chat", "rate": 1.0, "slo_ttft_ms": 3000.0, "slo_tpot_ms": 100.0}
PLANNER = {**TRAFFIC, "num_requests": 200, "interval_s": 10.0, "auto_rebalance": False}


@dataclass(frozen=True)
class Policy:
    max_num_seqs: int = 64


def key(**changes: object) -> str:
    parts: dict[str, object] = {
        "profile_json": '{"a": 1}',
        "planner": PLANNER,
        "policy": Policy(),
        "model": "SmolLM2",
        "code": "c0",
    }
    parts.update(changes)
    return memo_key(**parts)  # type: ignore[arg-type]


def test_every_ingredient_of_the_question_changes_the_key_and_nothing_else_does() -> None:
    base = key()
    assert key() == base
    others = [
        key(profile_json='{"a": 2}'),
        key(planner={**PLANNER, "rate": 2.0}),
        key(planner={**PLANNER, "workload": "long-burst"}),
        key(planner={**PLANNER, "slo_ttft_ms": 1000.0}),
        key(planner={**PLANNER, "num_requests": 50}),
        key(policy=Policy(max_num_seqs=8)),
        key(model="Qwen3"),
        key(code="c1"),
    ]
    assert base not in others and len(set(others)) == len(others)
    # The autopilot's knobs do not change which layout ranks first at start.
    assert key(planner={**PLANNER, "interval_s": 99.0, "auto_rebalance": True}) == base


def test_a_choice_comes_back_as_kept_with_its_device_tuples(tmp_path: Path) -> None:
    memo = PlanMemo(tmp_path / "plans")
    assert memo.get("k") is None
    choice = Choice(
        "colocated x2", {"mode": "colocated", "prefill_devices": (0, 1), "cpu_devices": 2}
    )
    memo.put("k", choice)
    assert memo.get("k") == choice
    assert [p.name for p in (tmp_path / "plans").iterdir()] == ["k.json"]  # no .tmp left


def test_an_unreadable_choice_is_planned_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    memo = PlanMemo(tmp_path)
    (tmp_path / "k.json").write_text('{"label": "1P+1D"')  # cut short
    assert memo.get("k") is None
    assert "unreadable" in caplog.text
    (tmp_path / "k.json").write_text('{"label": "1P+1D"}')  # no settings
    assert memo.get("k") is None


def test_a_folder_that_cannot_be_written_only_costs_a_plan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "plans").write_text("a file where the folder would be")
    memo = PlanMemo(tmp_path / "plans")
    memo.put("k", Choice("colocated x2", {"mode": "colocated"}))  # warns, does not raise
    assert "could not keep the planned layout" in caplog.text
    assert memo.get("k") is None


def test_the_code_digest_follows_the_sources(tmp_path: Path) -> None:
    (tmp_path / "sim.py").write_text("RATE = 1\n")
    (tmp_path / "notes.txt").write_text("not code")
    before = code_digest((tmp_path,))
    (tmp_path / "notes.txt").write_text("changed, still not code")
    assert code_digest((tmp_path,)) == before
    (tmp_path / "sim.py").write_text("RATE = 2\n")
    assert code_digest((tmp_path,)) != before
