"""The step-cost model across the quantized kernels' switch to a GEMM (issue 35): a CPU
worker's prompt of fewer than prefill_gemm_rows tokens runs on the integer kernel, several
times the GEMM's cost a token, and from that count its products dequantize the weights
once for a GEMM. The timings say where the switch is, the online fit gives each side a
line (StepCost.gemm_rows), and the simulator prices a prompt on its side."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from hand_profiles import hand_profile

from appliance.engine.step_timing import StepClock, StepTiming, step_timing
from appliance.planner.fitting import both_regimes, fit_step_cost, in_regimes, regime_sample
from appliance.planner.layout import Layout, Pool
from appliance.planner.online_profile import OnlineProfile
from appliance.planner.profile import StepCost, WorkerCost, attended, load_profile
from appliance.planner.simulator import SimRequest, simulate

GEMM_ROWS = 48
# A one-core worker's steps on both sides of the switch (the shape measured on a Xeon:
# ~8 ms a prompt token on the integer kernel; ~3 ms on the GEMM, after ~60 ms of
# dequantizing the weights once a step).
TRUE_PREFILL = StepCost(
    base_s=0.01,
    per_token_s=8e-3,
    per_seq_s=2e-3,
    per_attended_s=4e-8,
    gemm_rows=GEMM_ROWS,
    per_gemm_token_s=3e-3,
    gemm_base_s=0.06,
)
TRUE_DECODE = StepCost(base_s=0.01, per_seq_s=2e-3, per_context_s=1e-6)
NOISE = 0.03


def prefill_steps(count: int, seed: int = 0, gemm_rows: int | None = GEMM_ROWS) -> list[StepTiming]:
    """Prompt steps of 4..400 tokens (one or two chunks), timed by TRUE_PREFILL with noise,
    as a worker whose kernels switch at `gemm_rows` reports them."""
    rng = random.Random(seed)
    steps = []
    for _ in range(count):
        chunks = [(0, rng.randint(4, 200)) for _ in range(rng.randint(1, 2))]
        steps.append(timed(chunks, [], rng, gemm_rows))
    return steps


def timed(
    chunks: list[tuple[int, int]], decodes: list[int], rng: random.Random, gemm_rows: int | None
) -> StepTiming:
    prompt = sum(n for _, n in chunks)
    tokens, seqs = prompt + len(decodes), len(chunks) + len(decodes)
    pairs = sum(attended(s, n) for s, n in chunks)
    # The box switches where the worker says (at 48 where it says nothing).
    switch = GEMM_ROWS if gemm_rows is None else gemm_rows
    cost = TRUE_PREFILL.model_copy(update={"gemm_rows": switch}) if chunks else TRUE_DECODE
    seconds = cost.seconds(tokens, seqs, pairs, sum(decodes), prompt)
    seconds *= 1 + rng.uniform(-NOISE, NOISE)
    kind = "mixed" if chunks and decodes else "prefill" if chunks else "decode"
    return StepTiming(kind, tokens, seqs, pairs, sum(decodes), seconds, prompt, gemm_rows)  # type: ignore[arg-type]


def test_the_online_fit_recovers_a_step_cost_with_a_kernel_switch() -> None:
    online = OnlineProfile()
    for step in prefill_steps(600):
        online.record("1x1", step)
    fitted = online.step_costs("1x1")["prefill"]
    assert fitted is not None and fitted.gemm_rows == GEMM_ROWS
    for name in ("per_token_s", "per_gemm_token_s", "gemm_base_s", "per_seq_s"):
        want, got = getattr(TRUE_PREFILL, name), getattr(fitted, name)
        assert got == pytest.approx(want, rel=0.15), name
    # Both sides of the cliff predicted within a few percent: 47 tokens cost more than 48.
    for prompt in (8, 30, 47, 48, 100, 127, 128, 300):
        true = TRUE_PREFILL.seconds(prompt, 1, attended(0, prompt), 0)
        assert fitted.seconds(prompt, 1, attended(0, prompt), 0) == pytest.approx(true, rel=0.05)
    assert fitted.seconds(47, 1, attended(0, 47), 0) > fitted.seconds(48, 1, attended(0, 48), 0)


def test_one_line_cannot_follow_the_cliff() -> None:
    """The same steps without the switch's count (an older worker): one line over both
    sides misses a prompt just short of the switch by far more than the two lines do
    (within 5%: the test above)."""
    online = OnlineProfile()
    for step in prefill_steps(600, gemm_rows=None):
        online.record("1x1", step)
    line = online.step_costs("1x1")["prefill"]
    assert line is not None and line.gemm_rows is None
    true = TRUE_PREFILL.seconds(40, 1, attended(0, 40), 0)
    assert abs(line.seconds(40, 1, attended(0, 40), 0) / true - 1) > 0.3


def test_steps_of_one_side_only_fit_one_line() -> None:
    """Prompts all past the switch: no line for the integer kernel can be fitted, so the
    cost keeps one line (gemm_rows None) rather than inventing the other side."""
    rng = random.Random(3)
    steps = [
        timed([(0, rng.randint(60, 400))] * rng.randint(1, 2), [], rng, GEMM_ROWS)
        for _ in range(200)
    ]
    online = OnlineProfile()
    for step in steps:
        online.record("1x1", step)
    fitted = online.step_costs("1x1")["prefill"]
    assert fitted is not None and fitted.gemm_rows is None
    assert fitted.per_token_s == pytest.approx(TRUE_PREFILL.per_gemm_token_s, rel=0.15)


def test_the_simulators_ttft_follows_the_fitted_regime() -> None:
    """A lone 100-token prompt's TTFT is the fitted cost of its side: the GEMM's where the
    switch is at 48 rows, the integer kernel's where the same box switched at 128."""
    ttfts = {}
    for gemm_rows in (GEMM_ROWS, 128):
        online = OnlineProfile()
        rng = random.Random(gemm_rows)
        for _ in range(600):  # prompts of 4..400 tokens in 1-2 chunks, decodes of 1..8
            chunks = [(0, rng.randint(4, 200)) for _ in range(rng.randint(1, 2))]
            online.record("1x1", timed(chunks, [], rng, gemm_rows))
            decodes = [rng.randint(50, 800) for _ in range(rng.randint(1, 8))]
            online.record("1x1", timed([], decodes, rng, gemm_rows))
        cost = online.worker_cost("1x1", kv_blocks=4096)
        assert cost is not None and cost.prefill.gemm_rows == gemm_rows
        layout = Layout(mode="colocated", prefill=Pool(workers=1))
        (result,) = simulate(hand_profile({"1x1": cost}, atoms=1), layout, [SimRequest(0, 100, 2)])
        predicted = cost.prefill.seconds(100, 1, attended(0, 100), 0)
        assert result.ttft == pytest.approx(predicted, rel=0.01)
        ttfts[gemm_rows] = result.ttft
    gemm_side = 0.01 + 0.06 + 3e-3 * 100 + 2e-3 + 4e-8 * attended(0, 100)
    row_side = 0.01 + 8e-3 * 100 + 2e-3 + 4e-8 * attended(0, 100)
    assert ttfts[GEMM_ROWS] == pytest.approx(gemm_side, rel=0.05)
    assert ttfts[128] == pytest.approx(row_side, rel=0.05)


def test_a_mixed_steps_regime_is_its_prompt_tokens() -> None:
    """Decodes beside a prompt do not move the step across the switch: a step of 40
    prompt tokens and 20 decodes is on the integer kernel side, as the model runs it."""
    cost = TRUE_PREFILL
    below = cost.seconds(60, 21, attended(0, 40), 0, prompt_tokens=40)
    assert below == pytest.approx(0.01 + 8e-3 * 60 + 2e-3 * 21 + 4e-8 * attended(0, 40))
    above = cost.seconds(60, 1, attended(0, 60), 0)  # 60 prompt tokens
    assert above == pytest.approx(0.01 + 0.06 + 3e-3 * 60 + 2e-3 + 4e-8 * attended(0, 60))


def test_a_timing_carries_the_prompt_tokens_and_the_switch() -> None:
    prompts = [SimpleNamespace(start=0, num_tokens=30), SimpleNamespace(start=10, num_tokens=20)]
    decodes = [SimpleNamespace(start=99, num_tokens=1)]
    timing = step_timing(prompts, decodes, 0.5, gemm_rows=GEMM_ROWS)
    assert (timing.tokens, timing.prompt_tokens, timing.gemm_rows) == (51, 50, GEMM_ROWS)
    assert timing.gemm and timing.features()["gemm_tokens"] == 51
    assert not step_timing(prompts[:1], decodes, 0.5, gemm_rows=GEMM_ROWS).gemm  # 30 < 48
    assert not step_timing(prompts, decodes, 0.5).gemm  # no switch told: one regime
    clock = StepClock(gemm_rows=GEMM_ROWS)
    out = SimpleNamespace(prefills=prompts, decodes=decodes, verifies=[])
    clock.run(lambda _: {}, out, cuda=False)
    popped = clock.pop()
    assert popped is not None and popped.gemm_rows == GEMM_ROWS and popped.prompt_tokens == 50


def test_the_regime_features_replace_tokens_and_need_the_switch() -> None:
    assert in_regimes(("tokens", "seqs")) == ("row_tokens", "gemm_tokens", "gemm", "seqs")
    assert in_regimes(("seqs", "context")) == ("seqs", "context")
    sample = {"tokens": 60, "prompt_tokens": 40, "seqs": 2, "seconds": 1.0}
    assert regime_sample(sample, GEMM_ROWS)["row_tokens"] == 60
    assert regime_sample(sample, 40)["gemm_tokens"] == 60
    with pytest.raises(ValueError, match="gemm_rows"):
        fit_step_cost([sample], in_regimes(("tokens",)))
    with pytest.raises(ValueError, match="gemm_rows"):
        fit_step_cost([sample], ("tokens",), gemm_rows=GEMM_ROWS)


def test_a_profile_written_before_the_switch_still_loads(tmp_path: Path) -> None:
    """A version-1 profile whose step costs have no regime fields loads as one line each;
    one with a switch keeps it through a save and a load."""
    with_switch = hand_profile(
        {
            "1x1": WorkerCost(
                prefill=TRUE_PREFILL, decode=TRUE_DECODE, mixed=TRUE_PREFILL, kv_blocks=64
            )
        }
    )
    data = json.loads(with_switch.model_dump_json())
    for kind in ("prefill", "mixed"):
        for field in ("gemm_rows", "per_gemm_token_s", "gemm_base_s"):
            del data["workers"]["1x1"][kind][field]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    loaded = load_profile(old)
    assert loaded.workers["1x1"].prefill.gemm_rows is None
    assert loaded.workers["1x1"].prefill.seconds(100, 1, 0, 0) == pytest.approx(0.01 + 0.8 + 2e-3)
    again = load_profile(with_switch.save(tmp_path))
    assert again.workers["1x1"].prefill == TRUE_PREFILL


def test_both_regimes_need_two_sizes_and_enough_steps_on_each_side() -> None:
    row_side = [(False, 10.0), (False, 20.0)]
    gemm_side = [(True, 64.0), (True, 96.0)]
    assert both_regimes(row_side + gemm_side)
    assert not both_regimes([*row_side, (True, 64.0), (True, 64.0)])  # one size: any line
    assert not both_regimes(row_side)  # the switch never reached
    assert not both_regimes(row_side + gemm_side, min_steps=3)
    assert both_regimes(row_side * 2 + gemm_side * 2, min_steps=3)
