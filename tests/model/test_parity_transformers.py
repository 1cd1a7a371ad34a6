"""Our engine against transformers on the same weights: greedy tokens and prefill logits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from family_configs import tiny_config
from parity_prompts import parity_prompts
from reference import hf_greedy, hf_logits, our_prefill_logits

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.settings.config import load_settings

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model


def test_greedy_batch_matches_transformers(engine: LLMEngine, hf_reference) -> None:
    prompts = parity_prompts(engine)
    assert len(prompts) >= 8 and len({len(p) for p in prompts}) >= 6  # varied lengths
    ours = engine.generate(prompts, SamplingParams(max_tokens=32))
    for prompt, completion in zip(prompts, ours, strict=True):
        assert completion.token_ids == hf_greedy(hf_reference, prompt, 32)
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_prefill_logits_match_transformers(engine: LLMEngine, hf_reference) -> None:
    prompts = parity_prompts(engine)
    for prompt, logits in zip(prompts, our_prefill_logits(engine, prompts), strict=True):
        assert (logits - hf_logits(hf_reference, prompt)).abs().max().item() < 1e-3
    assert engine.num_free_blocks == engine.kv.num_blocks


def _random_model_folder(tmp: Path, engine: LLMEngine, config) -> Path:
    """A transformers model with random weights saved as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = _tokenizer_dir() / name
        if src.is_file():
            shutil.copy(src, tmp / name)
    return tmp


def _tokenizer_dir() -> Path:
    """The embedded model's converted tokenizer, which the random models borrow."""
    from appliance.model.gguf_cache import cache_entry
    from appliance.model.model_source import default_model_path

    return cache_entry(default_model_path(), load_settings().cache_dir)


def _qwen2_config():
    return tiny_config(
        "Qwen2Config",
        49152,
        intermediate_size=160,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )


def _llama3_config():
    return tiny_config(
        "LlamaConfig",
        49152,
        intermediate_size=160,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        initializer_range=0.2,
        rope_theta=50000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )


@pytest.mark.parametrize(
    ("make_config", "expected"),
    [
        (_qwen2_config, {"architecture": "qwen2", "attention_bias": True}),
        (_llama3_config, {"architecture": "llama", "tie_word_embeddings": False}),
    ],
    ids=["qwen2", "llama3"],
)
def test_random_architectures_match_transformers(
    tmp_path: Path, engine: LLMEngine, make_config, expected: dict
) -> None:
    from transformers import AutoModelForCausalLM

    folder = _random_model_folder(tmp_path, engine, make_config())
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = LLMEngine.from_settings(
        load_settings(model=folder, dtype="float32", device="cpu", kv={"num_blocks": 64})
    )
    config = ours.model.config.to_dict()
    assert {k: config[k] for k in expected} == expected
    if config["architecture"] == "llama":
        assert config["rope_scaling"]["rope_type"] == "llama3"
    prompts = parity_prompts(ours)
    for prompt, logits in zip(prompts, our_prefill_logits(ours, prompts), strict=True):
        assert (logits - hf_logits(reference, prompt)).abs().max().item() < 1e-3
    completions = ours.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for prompt, completion in zip(prompts, completions, strict=True):
        ref = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert completion.token_ids == ref
    assert ours.num_free_blocks == ours.kv.num_blocks
