"""Analytic profiles (planner/analytic.py): the roofline's closed forms on datasheet numbers."""

from pathlib import Path

import pytest

from appliance.planner.analytic import (
    GPUS,
    MODEL_SHAPES,
    Efficiency,
    analytic_profile,
    kv_blocks,
)
from appliance.planner.profile import load_profile

A100 = GPUS["a100-80gb-sxm"]
OPT = MODEL_SHAPES["opt-13b"]
EFF = Efficiency()
OVERHEAD = EFF.step_overhead_us * 1e-6
HBM = A100.hbm_gb_s * 1e9 * EFF.hbm  # achievable bytes/s of one GPU


def test_a_13b_decode_alone_reads_its_weights_at_the_achievable_bandwidth() -> None:
    profile = analytic_profile("a100-80gb-sxm", 1, "opt-13b")
    decode = profile.worker("1x1").decode
    weights = OPT.params() * 2
    assert 25e9 < weights < 27e9  # OPT-13B in bf16: 12.85B params
    assert decode.seconds(1, 1, 0, 0) == pytest.approx(OVERHEAD + weights / HBM)
    # ~18 ms: the memory-bound decode step of a 13B model on one A100
    assert 0.015 < decode.seconds(1, 1, 0, 0) < 0.02
    # each cached token read adds its K and V of every layer
    extra = decode.seconds(1, 1, 0, 1000) - decode.seconds(1, 1, 0, 0)
    assert extra == pytest.approx(1000 * OPT.kv_bytes_per_token() / HBM)


def test_tp2_halves_each_gpus_bytes_and_adds_two_all_reduces_per_layer() -> None:
    profile = analytic_profile("a100-80gb-sxm", 2, "opt-13b")
    one, two = profile.worker("1x1").decode, profile.worker("1x2").decode
    latency = 2 * OPT.layers * A100.link_latency_us * 1e-6
    assert two.base_s - OVERHEAD - latency == pytest.approx((one.base_s - OVERHEAD) / 2)
    assert two.per_context_s == pytest.approx(one.per_context_s / 2)
    # a token's hidden state (bf16) in a 2-GPU ring: each GPU moves half of it twice,
    # at the one-way link bandwidth's achievable share; 2 all-reduces per layer
    one_way = A100.link_gb_s * 1e9 / 2 * EFF.link
    per_token = 2 * OPT.layers * 2 * (1 / 2) * OPT.hidden * 2 / one_way
    assert one.per_token_s == 0
    assert two.per_token_s == pytest.approx(per_token)


def test_prefill_is_the_math_at_the_achievable_flops() -> None:
    prefill = analytic_profile("a100-80gb-sxm", 1, "opt-13b").worker("1x1").prefill
    flops = A100.bf16_tflops * 1e12 * EFF.mfu
    assert prefill.per_token_s == pytest.approx(2 * OPT.layer_params() / flops)
    assert prefill.per_seq_s == pytest.approx(2 * OPT.hidden * OPT.vocab / flops)
    assert prefill.per_attended_s > 0 and prefill.base_s == pytest.approx(OVERHEAD)


def test_kv_blocks_are_the_memory_left_after_weights_and_reserve() -> None:
    free = 80e9 * 0.9 - OPT.params() * 2 - 2 * 1024**3
    block = OPT.kv_bytes_per_token() * 16
    assert OPT.kv_bytes_per_token() == 2 * 40 * 5120 * 2
    assert kv_blocks(OPT, A100, EFF, 1) == int(free // block)
    profile = analytic_profile("a100-80gb-sxm", 8, "opt-13b")
    assert profile.worker("1x1").kv_blocks == int(free // block)
    # TP2: each GPU holds half the weights and half of every block
    free2 = 80e9 * 0.9 - OPT.params() - 2 * 1024**3
    assert profile.worker("1x2").kv_blocks == int(free2 // (block / 2))


def test_units_for_every_tp_degree_that_fits() -> None:
    assert set(analytic_profile("a100-80gb-sxm", 8, "opt-13b").workers) == {
        "1x1",
        "1x2",
        "1x4",
        "1x8",
    }
    assert set(analytic_profile("a100-80gb-sxm", 4, "opt-13b").workers) == {"1x1", "1x2", "1x4"}
    # 141 GB of Llama-3-70B weights: not on one or two 80 GB GPUs
    big = analytic_profile("a100-80gb-sxm", 8, "llama-3-70b")
    assert set(big.workers) == {"1x4", "1x8"}
    # SmolLM2's 9 heads do not split 2, 4 or 8 ways
    assert set(analytic_profile("h100-80gb-sxm", 8, "smollm2-135m").workers) == {"1x1"}
    assert analytic_profile("rtx-4090", 8, "llama-2-13b").atoms == 8


def test_a_model_that_fits_nowhere_and_unknown_names_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="fits no worker"):
        analytic_profile("rtx-4090", 2, "llama-3-70b")
    with pytest.raises(ValueError, match=r"unknown GPU .b200.; choose one of a100-80gb-sxm"):
        analytic_profile("b200", 8, "opt-13b")
    with pytest.raises(ValueError, match="unknown model shape"):
        analytic_profile("h200", 8, "gpt-5")
    with pytest.raises(ValueError, match="efficiency mfu"):
        Efficiency(mfu=1.5)


def test_it_says_it_is_analytic_and_what_it_assumed() -> None:
    profile = analytic_profile("a100-80gb-sxm", 8, "opt-13b")
    assert profile.analytic
    text = "\n".join(profile.assumptions)
    for expected in ("not measured", "0.6 of peak FLOP/s", "0.8 of HBM", "no pipeline", "KV"):
        assert expected in text
    assert "analytic" in profile.key.device_kind and "A100" in profile.key.device_kind
    assert profile.max_model_len == 2048 and profile.atoms == 8


def test_it_round_trips_through_its_json_file(tmp_path: Path) -> None:
    profile = analytic_profile("h200", 8, "llama-3-8b")
    path = profile.save(tmp_path)
    assert load_profile(path) == profile
