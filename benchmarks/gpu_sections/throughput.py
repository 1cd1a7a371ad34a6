"""Section 7, throughput: the default model in bfloat16 on the scale's device: decode
tokens/s at a few batch sizes, prefill tokens/s and the peak memory a prompt's steps add."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

import torch

from .common import Result, markdown_table, random_ids, settings_for, verdict
from .measure import peak_tracker
from .scale import Scale

if TYPE_CHECKING:
    from appliance.engine.llm_engine import LLMEngine


def section_throughput(scale: Scale) -> Result:
    """The engine in bfloat16 (prefix caching off): decode tokens/s with `batch` requests
    decoding together (timed once all have their first token), and one prompt's prefill
    tokens/s and the device memory its steps take above the loaded model."""
    from appliance.engine.llm_engine import LLMEngine
    from appliance.engine.sequence import SamplingParams
    from appliance.model.layers import paged_attention as attention

    kv = {"memory_mb": 2048 if scale.cuda else 256, "prefix_caching": False}
    engine = LLMEngine.from_settings(settings_for(scale, "bfloat16", kv=kv))
    rng = random.Random(4)
    vocab = engine.model.config.vocab_size
    engine.generate([random_ids(rng, 32, vocab)], SamplingParams(max_tokens=4, ignore_eos=True))
    decode = [decode_rate(engine, batch, scale, rng) for batch in scale.decode_batches]
    prefill = [prefill_rate(engine, length, rng, scale.device) for length in scale.prefill_lengths]
    checks = {
        "every request made all its tokens": all(row["complete"] for row in decode),
        "every KV block is free after": engine.num_free_blocks == engine.kv.num_blocks,
    }
    table = [*markdown_table(decode), "", *markdown_table(prefill)]
    return verdict(
        checks,
        summary=", ".join(f"b{r['batch']} {r['tokens_per_s']} tok/s" for r in decode)
        + f"; prefill {prefill[-1]['tokens']} tok at {prefill[-1]['tokens_per_s']} tok/s",
        dtype="bfloat16",
        attention="triton" if attention.runs_triton(scale.device) else "torch/C kernels",
        decode=decode,
        prefill=prefill,
        table=table,
        note="32k prefills: the default model's context is 8192 tokens (see bandwidth)",
    )


def decode_rate(engine: LLMEngine, batch: int, scale: Scale, rng: random.Random) -> dict[str, Any]:
    """Decode tokens/s of `batch` requests: from the step after the last first token to
    the end, every token made in that time over that time."""
    from appliance.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=scale.decode_steps + 1, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    ids = {
        engine.add_request(random_ids(rng, scale.decode_prompt, vocab), params)
        for _ in range(batch)
    }
    made = dict.fromkeys(ids, 0)
    while not all(made.values()):  # prefill steps: not timed (some decode in them already)
        for out in engine.step():
            made[out.seq_id] += len(out.token_ids)
    tokens, steps, start = 0, 0, time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
            made[out.seq_id] += len(out.token_ids)
        steps += 1
    seconds = time.perf_counter() - start
    return {
        "batch": batch,
        "steps": steps,
        "ms_per_step": round(seconds / max(steps, 1) * 1e3, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "complete": all(n == params.max_tokens for n in made.values()),
    }


def prefill_rate(
    engine: LLMEngine, length: int, rng: random.Random, device: torch.device
) -> dict[str, Any]:
    """One prompt of `length` tokens to its first token: tokens/s and the peak memory
    its steps add (in chunks of the engine's chunk size)."""
    from appliance.engine.sequence import SamplingParams

    prompt = random_ids(rng, length, engine.model.config.vocab_size)
    tracker = peak_tracker(device)
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    seconds = time.perf_counter() - start
    return {
        "tokens": length,
        "ms": round(seconds * 1e3, 1),
        "tokens_per_s": round(length / seconds, 1),
        "peak_mib_above_model": tracker(),
    }
