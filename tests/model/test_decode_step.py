"""The decode step's layers in one compiled call (model/decode_step.py, csrc/decode_step.c)
answer as the Python layers do, and refuse what they cannot run."""

from __future__ import annotations

import pytest
import torch

from appliance.engine.sequence import SamplingParams
from appliance.model import cpu_kernels
from appliance.model.decode_step import CompiledDecode, compiled_problem
from appliance.model.layers.paged_attention import AttentionBatch, DecodeGroup

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

QUESTIONS = ("What do bees make?", "Name three planets.", "Write a haiku about rain.")


def generate(engine, compiled: CompiledDecode | None) -> list[list[int]]:
    before = engine.model.decode_step
    engine.model.decode_step = compiled
    try:
        prompts = [
            engine.tokenizer.apply_chat_template([{"role": "user", "content": q}])
            for q in QUESTIONS
        ]
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        return [out.token_ids for out in engine.generate(prompts, params)]
    finally:
        engine.model.decode_step = before


def test_the_quantized_engine_decodes_in_one_compiled_call(quant_engine) -> None:
    assert compiled_problem(quant_engine.model) == ""
    assert isinstance(quant_engine.model.decode_step, CompiledDecode)
    calls = []
    step = quant_engine.model.decode_step
    original = cpu_kernels.decode_step
    cpu_kernels.decode_step = lambda *args: calls.append(1) or original(*args)
    try:
        with_step = generate(quant_engine, step)
    finally:
        cpu_kernels.decode_step = original
    assert len(calls) >= 31  # every decode step of the 32 tokens but the prefill's
    assert generate(quant_engine, None) == with_step  # the Python layers: the same tokens
    assert quant_engine.model.decode_step is step


def decode_inputs(engine) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """What the compiled step got at the decode of a two-token answer (residual, cos,
    sin, slots, tables, lens) and the KV cache as it was then."""
    got = {}
    original = cpu_kernels.decode_step

    def keep(layers, shape, residual, final_norm, cos, sin, slots, tables, lens, kv, precise):
        got["args"] = tuple(t.clone() for t in (residual, cos, sin, slots, tables, lens))
        got["kv"] = kv.clone()
        return original(layers, shape, residual, final_norm, cos, sin, slots, tables, lens, kv,
                        precise)  # fmt: skip

    cpu_kernels.decode_step = keep
    try:
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Count to 5."}])
        engine.generate([ids], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    finally:
        cpu_kernels.decode_step = original
    return got["args"], got["kv"]


@pytest.mark.parametrize("layers", [1, 30])
def test_the_compiled_step_gives_the_layers_hidden_states(quant_engine, layers) -> None:
    """The first `layers` layers and the final norm, compiled and in Python, on the same
    inputs and cache."""
    model, step = quant_engine.model, quant_engine.model.decode_step
    (residual, cos, sin, slots, tables, lens), kv = decode_inputs(quant_engine)
    stream_c, kv_c = residual.clone(), kv[:layers].clone()
    compiled = cpu_kernels.decode_step(
        step.layers[:layers].contiguous(), step.shape, stream_c, model.norm.weight, cos, sin,
        slots, tables, lens, kv_c, True,
    )  # fmt: skip
    stream_p, kv_p, delta = residual.clone(), kv[:layers].clone(), None
    batch = AttentionBatch(slots, [], 0, [DecodeGroup(None, tables, None, lens)])
    with torch.inference_mode():
        for index in range(layers):
            delta, stream_p = model.layers[index](stream_p, delta, (cos, sin), kv_p[index], batch)
        python = model.norm(stream_p, delta)[0]
    # the same kernels in the same order, SiLU's included: the same bits
    assert torch.equal(kv_c, kv_p)  # the same keys and values stored
    assert torch.equal(compiled, python)


def test_bad_inputs_are_refused(quant_engine) -> None:
    model = quant_engine.model
    step = model.decode_step
    # a pool of its own: slot 0 of the engine's may hold a cached prefix other tests reuse
    layers, _, _, block_size, kv_heads, head_dim = quant_engine.kv.tensor.shape
    cache = torch.zeros(layers, 2, 4, block_size, kv_heads, head_dim)
    hidden = model.config.hidden_size
    cos, sin = model.rope.at(torch.tensor([0]))
    one = torch.zeros(1, dtype=torch.int64)
    table = torch.zeros(1, 1, dtype=torch.int64)

    def call(**change):
        args = dict(
            layers=step.layers, shape=step.shape, residual=torch.randn(1, hidden),
            final_norm=model.norm.weight, cos=cos, sin=sin, slots=one, tables=table,
            lens=torch.ones(1, dtype=torch.int64), kv_cache=cache,
        )  # fmt: skip
        args.update(change)
        return cpu_kernels.decode_step(**args)

    assert call().shape == (1, hidden)  # the baseline runs
    with pytest.raises(ValueError, match="slot is outside the cache"):
        call(slots=torch.tensor([cache.shape[2] * cache.shape[3]]))
    with pytest.raises(ValueError, match="outside its block table"):
        call(lens=torch.tensor([cache.shape[3] + 1]))
    with pytest.raises(ValueError, match="residual must be"):
        call(residual=torch.randn(1, hidden + 1))
    with pytest.raises(ValueError, match="does not fit"):
        call(kv_cache=cache[1:])
    broken = step.layers.clone()
    broken[0, 2 + 2] = 7  # the q/k/v projection's output rows
    with pytest.raises(ValueError, match="output size"):
        call(layers=broken)


def test_a_dense_model_keeps_the_python_layers(engine) -> None:
    assert engine.model.decode_step is None
    assert "block-quantized" in compiled_problem(engine.model)
    with pytest.raises(ValueError, match="cannot compile the decode step"):
        CompiledDecode(engine.model)
