"""4-bit GGUF weights kept packed: exact unpacking, the kernel against dense math, the engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from reference import our_prefill_logits

from appliance.config import load_settings
from appliance.engine.llm_engine import LLMEngine, use_int4
from appliance.engine.sequence import SamplingParams
from appliance.model.int4 import (
    INT4_MAX_ROWS,
    Int4Linear,
    Int4Switch,
    Q8Head,
    dequantize_int4,
    split_q4_blocks,
    split_q8_blocks,
)
from appliance.model.loader import ModelFiles


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_split_blocks_is_exactly_the_gguf_dequantization(qtype: str) -> None:
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(24, 128)).astype(np.float32)
    raw = quantize(weight, GGMLQuantizationType[qtype])
    q, scale, zero = split_q4_blocks(raw, q4_1=qtype == "Q4_1")
    assert q.shape == (24, 128) and q.max() <= 15 and scale.shape == (24, 4)
    ours = dequantize_int4(*(torch.from_numpy(a) for a in (q, scale, zero)))
    expected = dequantize(raw, GGMLQuantizationType[qtype])
    assert torch.equal(ours, torch.from_numpy(expected))


def test_a_q8_0_head_in_two_4_bit_halves_is_the_file_weight() -> None:
    rng = np.random.default_rng(2)
    raw = quantize(rng.normal(size=(48, 96)).astype(np.float32), GGMLQuantizationType.Q8_0)
    q, d = split_q8_blocks(raw)
    expected = dequantize(raw, GGMLQuantizationType.Q8_0)
    assert q.dtype == np.int8 and d.shape == (48, 3)
    assert np.array_equal(q.reshape(48, 3, 32) * d[..., None], expected.reshape(48, 3, 32))
    head = Q8Head(torch.from_numpy(q), torch.from_numpy(d), torch.float32)
    # The kernel in float32 is exact but slow: what the halves compute, not how fast.
    x = torch.eye(96)  # row i picks input column i: the output is the weight, transposed
    got = torch.cat([head(x[i : i + INT4_MAX_ROWS]) for i in range(0, 96, INT4_MAX_ROWS)])
    assert torch.allclose(got.T, torch.from_numpy(expected), rtol=0, atol=1e-6)


def test_a_bfloat16_q8_head_stays_as_close_as_the_dense_head() -> None:
    rng = np.random.default_rng(3)
    raw = quantize(rng.normal(size=(512, 256)).astype(np.float32), GGMLQuantizationType.Q8_0)
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0))
    head = Q8Head(*(torch.from_numpy(a) for a in split_q8_blocks(raw)), torch.bfloat16)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    exact = x.double() @ weight.double().T
    dense = (x @ weight.to(torch.bfloat16).T).double()
    ours = head(x).double()
    assert torch.equal(ours.argmax(-1), exact.argmax(-1))
    # bfloat16 scales and two rounded halves: within twice the dense head's error
    assert (ours - exact).abs().mean() < 2 * (dense - exact).abs().mean()


def make_linear(dtype: torch.dtype) -> tuple[Int4Linear, torch.Tensor]:
    rng = np.random.default_rng(1)
    raw = quantize(rng.normal(size=(96, 64)).astype(np.float32), GGMLQuantizationType.Q4_1)
    q, scale, zero = (torch.from_numpy(a) for a in split_q4_blocks(raw, q4_1=True))
    weight = dequantize_int4(q, scale, zero)
    dense = torch.nn.Linear(64, 96, bias=True).to(dtype)
    dense.weight.data = weight.to(dtype)
    return Int4Linear(dense, q, scale, zero, Int4Switch()), weight


@pytest.mark.parametrize("rows", [1, 3, INT4_MAX_ROWS])
def test_few_rows_run_the_int4_kernel_close_to_dense(rows: int) -> None:
    layer, weight = make_linear(torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    expected = x.float() @ weight.T + layer.dense.bias.float()
    got = layer(x).float()
    assert (got - expected).abs().max().item() < 0.05 * expected.abs().max().item()
    assert not torch.equal(got, layer.dense(x).float())  # really the other kernel


def test_many_rows_take_the_dense_weight() -> None:
    layer, _ = make_linear(torch.bfloat16)
    x = torch.randn(INT4_MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), layer.dense(x))


def test_switched_off_few_rows_take_the_dense_weight_too() -> None:
    layer, _ = make_linear(torch.bfloat16)
    layer.switch.on = False  # a prefill step
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), layer.dense(x))


def test_a_prompt_prefilled_in_pieces_answers_as_prefilled_whole(int4_engine: LLMEngine) -> None:
    """Its last piece is a few rows: they must not take the 4-bit weights, or the first
    token depends on chunking (and on what the prefix cache held)."""
    from appliance.engine.scheduler import SchedulerLimits

    tok = int4_engine.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    params = SamplingParams(max_tokens=8)
    whole = int4_engine.generate([prompt], params)[0].token_ids
    limits = int4_engine.scheduler.limits
    int4_engine.scheduler.limits = SchedulerLimits(
        limits.max_num_seqs, 32, 32, limits.max_model_len
    )
    try:
        pieces = int4_engine.generate([prompt], params)[0].token_ids
    finally:
        int4_engine.scheduler.limits = limits
    assert len(prompt) % 32 <= INT4_MAX_ROWS  # the last piece is a few rows
    assert pieces == whole


@pytest.fixture(scope="module")
def int4_engine() -> LLMEngine:
    return LLMEngine.from_settings(load_settings(dtype="bfloat16", weights="int4", device="cpu"))


def test_every_projection_of_the_default_model_goes_4_bit(int4_engine: LLMEngine) -> None:
    int4 = [m for m in int4_engine.model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 4 * int4_engine.model.config.num_layers
    assert isinstance(int4_engine.model.int4_head, Q8Head)  # its tied Q8_0 embedding


def test_only_few_decode_rows_take_the_q8_head(int4_engine: LLMEngine) -> None:
    model = int4_engine.model
    hidden = torch.randn(INT4_MAX_ROWS + 1, model.config.hidden_size, dtype=torch.bfloat16)
    dense = torch.nn.functional.linear(hidden, model.embed_tokens.weight).float()
    assert torch.equal(model.logits(hidden), dense)
    assert not torch.equal(model.logits(hidden[:2]), dense[:2])  # the 4-bit halves
    model.int4_switch.on = False  # a prefill step
    try:
        assert torch.equal(model.logits(hidden[:2]), dense[:2])
    finally:
        model.int4_switch.on = True


def test_int4_logits_stay_close_to_float32(int4_engine: LLMEngine, engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("The capital of France is")
    assert len(prompt) <= INT4_MAX_ROWS  # the prefill itself runs the int4 kernel
    [ours] = our_prefill_logits(int4_engine, [prompt])
    [exact] = our_prefill_logits(engine, [prompt])
    assert torch.equal(ours[-1].argmax(), exact[-1].argmax())
    # bfloat16 activations: relative error of a few percent of the logit range
    assert (ours - exact).abs().max().item() < 0.05 * exact.abs().max().item()


def test_int4_engine_answers(int4_engine: LLMEngine) -> None:
    prompt = int4_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    [c] = int4_engine.generate([prompt], SamplingParams(max_tokens=24))
    assert "Paris" in c.text
    assert int4_engine.num_free_blocks == int4_engine.kv.num_blocks


def test_int4_setting_is_refused_where_it_cannot_run(engine: LLMEngine) -> None:
    files = ModelFiles(Path("m.gguf"), engine.model.config, {}, Path("."), {})
    with pytest.raises(ValueError, match="no Q4_0/Q4_1"):
        use_int4("int4", files, torch.bfloat16, torch.device("cpu"))
    files.int4 = {"lm_head.weight.q8": torch.zeros(1)}  # only a Q8_0 head: nothing 4-bit
    assert use_int4("auto", files, torch.bfloat16, torch.device("cpu")) is False
    with pytest.raises(ValueError, match="no Q4_0/Q4_1"):
        use_int4("int4", files, torch.bfloat16, torch.device("cpu"))
    files.int4 = {"x.q4": torch.zeros(1)}
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        use_int4("int4", files, torch.float32, torch.device("cpu"))
    assert use_int4("auto", files, torch.float32, torch.device("cpu")) is False
    assert use_int4("auto", files, torch.bfloat16, torch.device("cpu")) is True
    assert use_int4("dense", files, torch.bfloat16, torch.device("cpu")) is False
    # A tensor-parallel shard keeps dense weights: the 4-bit ones are not split.
    assert use_int4("auto", files, torch.bfloat16, torch.device("cpu"), shards=2) is False
    with pytest.raises(ValueError, match="without tensor parallelism"):
        use_int4("int4", files, torch.bfloat16, torch.device("cpu"), shards=2)
