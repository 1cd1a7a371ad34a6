"""CUDA-only checks of a step's host syncs and of decode CUDA graphs, run on a GPU machine
by benchmarks/gpu_check.py (section "cuda_tests"): they have nothing to run on a CPU, so
they are not in the CPU suite (tests/), where they would only be skipped.

    .venv/bin/python -m pytest -q benchmarks/gpu_tests
"""

from __future__ import annotations

import pytest
import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.model_runner import move_to
from appliance.engine.sampling.sampler import Sampler, SampleRow
from appliance.engine.sequence import SamplingParams
from appliance.settings.config import load_settings

GREEDY = SamplingParams(max_tokens=12)

if not torch.cuda.is_available():
    pytest.fail("these checks need a CUDA device", pytrace=False)


def prompts_for(engine: LLMEngine, lengths: tuple[int, ...]) -> list[list[int]]:
    """Prompts of these token counts (tests/engine/test_step_syncs.py's)."""
    text = "Graphs replay a whole decode step in one launch; padding rows copy the last."
    ids = engine.tokenizer.encode(text * 6)
    return [ids[:n] for n in lengths]


def test_cuda_upload_and_sampling_never_sync() -> None:
    device = torch.device("cuda")
    logits = torch.randn(8, 1000, device=device)
    requests = [
        SampleRow(i, SamplingParams(temperature=0.0 if i == 0 else 1.0, top_k=i, top_p=0.9, seed=i))
        for i in range(8)
    ]
    sampler = Sampler(device)
    inputs = [torch.arange(10), [torch.ones(3, dtype=torch.bool)], torch.arange(5.0)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = move_to(inputs, device)
        drawn = sampler.sample_tensor(logits, requests)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert drawn.device.type == "cuda" and drawn.shape == (8,)
    assert drawn.tolist()[0] == int(logits[0].argmax())
    assert torch.equal(moved[0].cpu(), torch.arange(10))
    assert moved[1][0].dtype == torch.bool and bool(moved[1][0].all())


def test_cuda_graphs_give_the_eager_tokens() -> None:
    # two engines on one GPU: a pool each of an explicit size, not 0.9 of the device each
    settings = load_settings(
        device="cuda", dtype="bfloat16", weights="dense", kv={"memory_mb": 1024}
    )
    eager, graphed = LLMEngine.from_settings(settings), LLMEngine.from_settings(settings)
    graphed.runner.enable_decode_graphs((1, 2, 4, 8), max_len=512)
    prompts = prompts_for(eager, (5, 17, 30))
    expected = [c.token_ids for c in eager.generate(prompts, GREEDY)]
    assert [c.token_ids for c in graphed.generate(prompts, GREEDY)] == expected


def test_the_cuda_graphs_setting_captures_powers_of_two_and_keeps_the_tokens() -> None:
    from appliance.engine.model_runner import decode_graph_sizes

    common = {"device": "cuda", "dtype": "bfloat16", "weights": "dense", "kv": {"memory_mb": 512}}
    eager = LLMEngine.from_settings(load_settings(**common, batch={"max_num_seqs": 8}))
    graphed = LLMEngine.from_settings(
        load_settings(**common, batch={"max_num_seqs": 8, "cuda_graphs": True})
    )
    prefill_only = LLMEngine.from_settings(
        load_settings(**common, batch={"max_num_seqs": 8, "cuda_graphs": True}), decodes=False
    )
    assert graphed.runner.decode_graphs is not None and eager.runner.decode_graphs is None
    assert tuple(graphed.runner.decode_graphs.sizes) == decode_graph_sizes(8) == (1, 2, 4, 8)
    assert prefill_only.runner.decode_graphs is None  # a prefill worker runs no decode step
    prompts = prompts_for(eager, (5, 17, 30, 3, 11))
    expected = [c.token_ids for c in eager.generate(prompts, GREEDY)]
    assert [c.token_ids for c in graphed.generate(prompts, GREEDY)] == expected
