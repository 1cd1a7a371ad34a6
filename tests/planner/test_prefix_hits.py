"""The box's KV store in the planner's simulator (issue 41), on plain data: a workload's
measured store hit rate gives each prompt whole stored blocks (never the block with its
last token), and a simulated prefill computes only the rest, whichever worker takes it."""

from __future__ import annotations

import pytest
from hand_profiles import SIM_DECODE, SIM_HOST, SIM_PREFILL, hand_profile

from appliance.planner.layout import Layout, Pool
from appliance.planner.prefix_hits import (
    StoreHitRates,
    measured_rate,
    stored_tokens,
    with_store_hits,
)
from appliance.planner.profile import (
    HandoffCost,
    Profile,
    ProfileKey,
    WorkerCost,
    attended,
)
from appliance.planner.simulator import Policy, SimRequest, StepRecord, simulate

PREFILL, DECODE = SIM_PREFILL, SIM_DECODE
HOST = SIM_HOST
COLOCATED_X2 = Layout(mode="colocated", prefill=Pool(workers=2))
ONE_PLUS_ONE = Layout(mode="disaggregated", prefill=Pool(workers=1), decode=Pool(workers=1))


def profile() -> Profile:
    worker = WorkerCost(prefill=PREFILL, decode=DECODE, mixed=DECODE, kv_blocks=4096)
    return hand_profile(
        {"1x1": worker},
        key=ProfileKey(model="test", dtype="float32", weights="dense", device_kind="cpu: test"),
        kv_bytes_per_token=1000,
        max_model_len=4096,
        handoff=HandoffCost(base_s=0.003, per_byte_s=1e-8),
        host=HOST,
    )


def test_a_prompts_stored_part_is_whole_blocks_short_of_its_last_token() -> None:
    assert stored_tokens(1100, 0.75, 16) == 816  # 825 tokens: 51 whole blocks
    assert stored_tokens(1100, 1.0, 16) == 1088  # never the block with the last token
    assert stored_tokens(1088, 1.0, 16) == 1072  # (a prompt of whole blocks: the last)
    assert stored_tokens(1100, 0.0, 16) == 0
    assert stored_tokens(10, 0.9, 16) == 0  # no whole block
    with pytest.raises(ValueError, match="block_size"):
        stored_tokens(100, 0.5, 0)


def test_the_rate_is_measured_from_the_stores_counts_per_workload() -> None:
    # The bench's multi-turn chat: 784 blocks of 16 served of 43,008 prompt tokens.
    assert measured_rate(784 * 16, 43008) == pytest.approx(0.2917, abs=1e-4)
    assert measured_rate(0, 0) == 0.0
    with pytest.raises(ValueError, match="exceed"):
        measured_rate(20, 10)
    rates = StoreHitRates({"shared-prefix": 0.7}, default=0.1)
    assert rates.rate("shared-prefix") == 0.7 and rates.rate("sharegpt") == 0.1
    with pytest.raises(ValueError, match="shared-prefix"):
        StoreHitRates({"shared-prefix": 1.5})


def test_a_stored_prefix_is_not_prefilled_on_whichever_worker_takes_it() -> None:
    """Two colocated workers, four 1100-token prompts at once with no prefix in common
    (no pool holds one): at a 75% store hit rate each prefill computes 284 tokens after
    816 loaded, on both workers; without the store, all 1100 of each."""
    requests = [SimRequest(0.0, 1100, 2) for _ in range(4)]
    stored = with_store_hits(requests, 0.75, profile().block_size)
    assert [r.stored_tokens for r in stored] == [816] * 4
    trace: list[StepRecord] = []
    hit = simulate(profile(), COLOCATED_X2, stored, Policy(chunk_size=512), trace=trace)
    chunks = [n for r in trace for n in r.prefill_chunks]
    assert chunks == [284] * 4
    assert {r.worker for r in trace if r.prefill_chunks} == {0, 1}
    plain: list[StepRecord] = []
    miss = simulate(profile(), COLOCATED_X2, requests, Policy(chunk_size=512), trace=plain)
    assert sum(n for r in plain for n in r.prefill_chunks) == 4 * 1100
    assert all(m.ttft > 2 * h.ttft for h, m in zip(hit, miss, strict=True))


def test_one_stored_prompt_alone_costs_the_prefill_of_its_rest() -> None:
    (alone,) = simulate(
        profile(), COLOCATED_X2, with_store_hits([SimRequest(0.0, 1100, 2)], 0.75, 16)
    )
    first = PREFILL.seconds(284, 1, attended(816, 284), 0) + HOST.per_step_s
    assert alone.ttft == pytest.approx(first + HOST.per_token_s)


def test_the_split_layout_hands_off_the_whole_prompts_kv_either_way() -> None:
    """Stored blocks are loaded into the prefill worker's pool: the decode worker still
    takes every prompt block, so only the prefill gets cheaper."""
    (alone,) = simulate(profile(), ONE_PLUS_ONE, [SimRequest(0.0, 1100, 4)])
    (stored,) = simulate(
        profile(), ONE_PLUS_ONE, with_store_hits([SimRequest(0.0, 1100, 4)], 0.75, 16)
    )
    assert stored.ttft < alone.ttft
    # Past the first token: the handoff and the decode steps cost the same.
    assert stored.itl == pytest.approx(alone.itl)


def test_a_request_cannot_claim_its_whole_prompt_is_stored() -> None:
    with pytest.raises(ValueError, match="stored_tokens"):
        SimRequest(0.0, 64, 2, stored_tokens=64)
