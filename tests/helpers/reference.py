"""Helpers that compute reference outputs with transformers and raw logits with our model."""

from __future__ import annotations

import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.model_runner import move_to
from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.kv.block_allocator import blocks_for_tokens


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (stops at its EOS like ours)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=model.generation_config.eos_token_id,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """[tokens, vocab] float32 logits of every prompt position."""
    return model(torch.tensor([prompt])).logits[0].float()


def our_prefill_logits(engine: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All-position logits of several prompts prefilled together in one batched step."""
    bs = engine.kv.block_size
    seqs = [Sequence(i, list(p), SamplingParams()) for i, p in enumerate(prompts)]
    for seq in seqs:
        seq.block_table = engine.kv.allocator.allocate(blocks_for_tokens(len(seq), bs))
    try:
        out = SchedulerOutput(prefills=[ScheduledChunk(s, len(s)) for s in seqs])
        inputs = move_to(engine.runner.prepare(out), engine.model.device)
        hidden = engine.model(
            inputs.input_ids, inputs.positions, inputs.attention, engine.kv.tensor
        )
        logits = engine.model.logits(hidden)
    finally:
        for seq in seqs:
            engine.kv.allocator.free(seq.block_table)
    return list(logits.split([len(p) for p in prompts]))
