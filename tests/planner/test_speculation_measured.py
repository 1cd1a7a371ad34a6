"""The speculative acceptance the box measures reaches the planner (issue 38): the
workers' totals since they started (the counts /metrics shows), observed at each of the
autopilot's looks, give the acceptance of the window it looks at
(planner/measured_acceptance.py), and the autopilot's simulator policy speculates at it
instead of a fixed `--spec-acceptance`. On plain data: the window's counts follow the
traffic (older looks drop out, a restarted worker counts from 0), none is measured
without verify steps or without speculation; and the autopilot's policy carries the
figure its workers' reports imply. (How the simulator ranks layouts at a measured
acceptance: test_speculation.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from worker_handles import worker_handle

from appliance.engine.speculative.acceptance import AcceptanceCounts
from appliance.ops.autopilot import Autopilot
from appliance.ops.pool_moves import PoolMover
from appliance.planner.measured_acceptance import MovingAcceptance
from appliance.planner.speculation import acceptance_for
from appliance.pools.supervisor import Supervisor
from appliance.settings.config import load_settings
from appliance.settings.engine import SpeculativeSettings
from appliance.workers.messages import TokenBatch

NGRAM = SpeculativeSettings(method="ngram", num_speculative_tokens=4)


def counts(steps: int, drafted: int, accepted: int) -> AcceptanceCounts:
    return AcceptanceCounts(verify_steps=steps, drafted=drafted, accepted=accepted)


def test_the_window_counts_what_the_totals_grew_by() -> None:
    moving = MovingAcceptance(window_s=30.0)
    assert moving.counts() == AcceptanceCounts() and moving.speculation(NGRAM) is None
    # The first look: everything since the workers started.
    moving.observe(0.0, {1: counts(10, 40, 10), 2: counts(0, 0, 0)})
    assert moving.counts() == counts(10, 40, 10)
    # Grounded traffic now: worker 2 keeps 3 of 4 drafts a step.
    moving.observe(20.0, {1: counts(10, 40, 10), 2: counts(50, 200, 150)})
    assert moving.counts() == counts(50, 200, 150)
    # 40 s: the look at 0 s is older than the window's start (10 s) but the newest such:
    # still the baseline. 50 s: the look at 20 s is; the grounded burst drops out.
    moving.observe(40.0, {1: counts(30, 120, 20), 2: counts(50, 200, 150)})
    assert moving.counts() == counts(70, 280, 160)
    moving.observe(50.0, {1: counts(30, 120, 20), 2: counts(50, 200, 150)})
    assert moving.counts() == counts(20, 80, 10)


def test_a_restarted_or_new_worker_counts_from_zero() -> None:
    moving = MovingAcceptance(window_s=60.0)
    moving.observe(0.0, {1: counts(100, 400, 300)})
    moving.observe(10.0, {1: counts(5, 20, 2), 3: counts(7, 28, 14)})  # 1 restarted; 3 new
    assert moving.counts() == counts(12, 48, 16)
    with pytest.raises(ValueError, match="forward in time"):
        moving.observe(5.0, {})
    with pytest.raises(ValueError, match="window_s"):
        MovingAcceptance(0.0)


def test_the_model_takes_the_windows_acceptance_and_the_servers_draft_lengths() -> None:
    moving = MovingAcceptance(window_s=60.0)
    moving.observe(0.0, {1: counts(100, 400, 300)})  # 3 of 4 drafts kept a step
    spec = moving.speculation(NGRAM)
    assert spec is not None
    assert spec.acceptance == pytest.approx(acceptance_for(3.0, 4))
    assert spec.made(4) == pytest.approx(4.0)  # the measured mean: 3 kept + 1
    assert (spec.draft_tokens, spec.draft_tokens_min, spec.disable_by_batch_size) == (4, 1, 8)
    assert moving.speculation(SpeculativeSettings()) is None  # the server does not speculate
    never = MovingAcceptance(window_s=60.0)
    never.observe(0.0, {1: counts(0, 0, 0)})
    assert never.speculation(NGRAM) is None  # nothing verified: plain decoding is simulated


def test_the_autopilots_policy_speculates_at_its_workers_measured_acceptance(
    tmp_path: Path,
) -> None:
    """Reports of the decode workers (TokenBatch.speculation, as a worker sends them)
    reach the policy the autopilot's simulator ranks layouts with."""
    settings = load_settings(
        device="cpu",
        cpu_devices=2,
        cache_dir=tmp_path,
        speculative={"method": "ngram", "num_speculative_tokens": 6},
        planner={"window_s": 30},
    )
    supervisor = Supervisor(settings)
    autopilot = Autopilot(supervisor, PoolMover(supervisor, 10.0), settings)
    handles = {
        i: worker_handle(i, role, ready=True, free=64)
        for i, role in enumerate(("prefill", "decode", "decode"))
    }
    supervisor.processes.workers.update(handles)
    assert autopilot.policy().speculation is None  # nothing observed yet

    def report(at: float, totals: dict[int, AcceptanceCounts]) -> None:
        for worker_id, total in totals.items():
            handles[worker_id].reported(TokenBatch(worker_id, speculation=total), at)
        autopilot.observe_acceptance(at)

    report(0.0, {1: counts(0, 0, 0), 2: counts(0, 0, 0)})
    report(10.0, {1: counts(40, 240, 200), 2: counts(60, 360, 100)})
    spec = autopilot.policy().speculation
    assert spec is not None and spec.draft_tokens == 6
    assert spec.acceptance == pytest.approx(acceptance_for(300 / 100, 600 / 100))
    # The tuning knobs are the live ones, as before.
    assert autopilot.policy().max_num_seqs == supervisor.tuning.decode_max_seqs
    # Later traffic keeps nothing: past the window the figure is the new traffic's.
    report(50.0, {1: counts(90, 540, 200), 2: counts(60, 360, 100)})
    late = autopilot.policy().speculation
    assert late is not None and late.acceptance == 0.0
