"""Gemma 3 text (Gemma3ForCausalLM) against transformers on small random float32 models:
(1 + weight) norms (four a layer, and per head on q and k), GeGLU, scaled embeddings,
query_pre_attn_scalar, sliding layers (window, local RoPE base) beside full ones (global
base, linear scaling), tied embeddings; from a folder (one file, sharded), with chunked
prefill, tensor-parallel shards and `appliance serve` in both layouts; and from GGUF
(llama.cpp's gemma3: norms stored as 1 + weight, llama.cpp's defaults for what the file
does not say), dense and block-quantized."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from random_models import (
    TOY_TOKENS,
    assert_matches,
    assert_shards_match,
    greedy,
    our_engine,
    random_model,
    save_folder,
    served_completions,
    token_prompts,
    write_gguf,
)
from reference import our_prefill_logits

from appliance.engine.sequence import SamplingParams
from appliance.model.decode_step import compiled_problem
from appliance.model.errors import ModelLoadError
from appliance.model.families.gemma3 import gguf_facts
from appliance.model.formats import gguf_file
from appliance.model.registry import from_hf_config

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

VOCAB, WINDOW, HEAD_DIM = 49152, 12, 64  # head_dim 64: the compiled decode kernel's size
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def gemma3_config(vocab: int = VOCAB, **fields: Any):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **{
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": len(LAYER_TYPES),
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": HEAD_DIM,
            "max_position_embeddings": 512,
            "sliding_window": WINDOW,
            "layer_types": LAYER_TYPES,
            "query_pre_attn_scalar": 32,  # not head_dim: the scale is its own
            "initializer_range": 0.2,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        }
        | fields
    )


def gemma3_model(config: Any) -> torch.nn.Module:
    """A random model whose norm weights are random too (Gemma's are zeros: 1 + 0). The
    norms after attention and the MLP scale up: else the scaled embedding dominates the
    residual stream and greedy decoding repeats the last token whatever the layers do."""
    model = random_model(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(
                ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
            ):
                param.uniform_(2.0, 5.0)
            elif name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    return model


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return gemma3_model(gemma3_config())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, reference: torch.nn.Module) -> Path:
    return save_folder(reference, tmp_path_factory.mktemp("gemma3"), shard_size="1MB")


# Shorter than, as long as, and longer than the window; 32 new tokens pass it for all.
PROMPT_LENGTHS = [5, 11, 12, 13, 40, 90]


def test_gemma3_sharded_folder_matches_transformers(
    folder: Path, reference: torch.nn.Module
) -> None:
    assert len(list(folder.glob("*.safetensors"))) > 1
    ours = our_engine(folder)
    config = ours.model.config
    assert (config.architecture, config.qk_norm, config.tie_word_embeddings) == (
        "gemma3",
        True,
        True,
    )
    assert config.sliding_window == WINDOW and config.layer_types == tuple(LAYER_TYPES)
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 10000.0)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert ours.model.decode_step is None
    prompts = token_prompts(VOCAB, PROMPT_LENGTHS)
    prompts.append(ours.tokenizer.apply_chat_template([{"role": "user", "content": "Hi " * 9}]))
    assert_matches(ours, reference, prompts)


def test_gemma3_one_file_folder_matches_transformers(
    tmp_path: Path, reference: torch.nn.Module
) -> None:
    ours = our_engine(save_folder(reference, tmp_path))
    assert_matches(ours, reference, token_prompts(VOCAB, [7, 30], seed=4), tokens=16)


def test_the_layer_kinds_change_the_answer(reference: torch.nn.Module) -> None:
    """The checks mean something: with every layer full (no window, one RoPE base), or
    with the window on every layer, the same weights answer otherwise."""
    prompt = token_prompts(VOCAB, [60])[0]
    expected = greedy(reference, prompt, 16)
    for types in (["full_attention"] * 3, ["sliding_attention"] * 3):
        other = gemma3_model(gemma3_config(layer_types=types))
        assert greedy(other, prompt, 16) != expected


def test_chunked_prefill_over_cached_blocks_keeps_the_windows(
    folder: Path, reference: torch.nn.Module
) -> None:
    ours = our_engine(folder, batch={"chunk_size": 16, "max_num_batched_tokens": 64})
    prompts = token_prompts(VOCAB, [70, 33], seed=1)
    completions = ours.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.token_ids == greedy(reference, prompt, 24)


def test_final_logit_softcapping_matches_transformers(tmp_path: Path) -> None:
    reference = gemma3_model(gemma3_config(final_logit_softcapping=3.0))
    ours = our_engine(save_folder(reference, tmp_path))
    assert ours.model.config.final_logit_softcapping == 3.0
    assert_matches(ours, reference, token_prompts(VOCAB, [9, 25], seed=5), tokens=16)


def test_the_quantized_path_runs_geglu_in_the_python_layers(folder: Path) -> None:
    """Float weights quantized to Q8_0: the compiled step (Llama's layers, SiLU) is
    refused; the layers' prefill logits stay close to the dense model's."""
    dense = our_engine(folder)
    quantized = our_engine(folder, weights="quantized", quantize="q8_0")
    assert quantized.model.decode_step is None
    assert "Gemma" in compiled_problem(quantized.model)
    prompts = token_prompts(VOCAB, [20, 50], seed=6)
    for ours, theirs in zip(
        our_prefill_logits(quantized, prompts), our_prefill_logits(dense, prompts), strict=True
    ):
        scale = theirs.abs().max().item()
        # Q8_0 errs by 5% of the largest logit here; SiLU in GeGLU's place by 17%.
        assert (ours - theirs).abs().max().item() < 0.08 * scale


def test_tensor_parallel_shards_match_transformers(
    folder: Path, reference: torch.nn.Module
) -> None:
    """Two shards, a KV head (and its query heads) each; the norms after attention and
    the MLP see the summed partials."""
    prompts = token_prompts(VOCAB, [10, 30, 75], seed=2)
    assert_shards_match(folder, prompts, [reference] * len(prompts))


# A TP=2 prefill pool on CPU devices 0 and 1 hands its cache to a TP=1 decode pool on 2.
TP2_PREFILL = {
    "APPLIANCE_PREFILL_TP": "2",
    "APPLIANCE_CPU_DEVICES": "3",
    "APPLIANCE_PREFILL_DEVICES": "0,1",
    "APPLIANCE_DECODE_DEVICES": "2",
    "APPLIANCE_CPU_SHARE_CORES": "true",  # this machine may have fewer cores
}


@pytest.mark.parametrize(
    ("mode", "layout"),
    [("disaggregated", {}), ("colocated", {}), ("disaggregated", TP2_PREFILL)],
    ids=["disaggregated", "colocated", "TP2-prefill-to-TP1-decode"],
)
def test_appliance_serve_answers_as_transformers(
    folder: Path, reference: torch.nn.Module, mode: str, layout: dict[str, str]
) -> None:
    """`appliance serve` (the KV cache handed from prefill to decode workers, or
    colocated workers; pools of one or two tensor-parallel shards) answers prompts
    longer than the window as transformers does."""
    from transformers import AutoTokenizer

    prompts = token_prompts(VOCAB, [30, 60], seed=3)
    texts = served_completions(folder, {"APPLIANCE_MODE": mode} | layout, prompts)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert texts == [tokenizer.decode(greedy(reference, p, 24)) for p in prompts]


def test_a_transformers_4_config_reads_alike() -> None:
    """rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern (the
    older layout, as Gemma 3's published configs have it)."""
    cfg = {
        "model_type": "gemma3_text",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
    }
    config = from_hf_config(cfg, "g")
    assert config.layer_types == ("sliding_attention",) * 5 + (
        "full_attention",
        "sliding_attention",
    )
    assert [config.layer_window(i) for i in (0, 5, 6)] == [512, None, 512]
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.tie_word_embeddings and config.query_pre_attn_scalar == 256


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"model_type": "gemma3"}, "vision"),
        ({"model_type": "gemma2"}, "unknown architecture 'gemma2'"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
        ({"sliding_window": 0}, "sliding_window"),
    ],
)
def test_what_is_not_run_is_refused(fields: dict, words: str) -> None:
    cfg = gemma3_config(100, num_hidden_layers=4, layer_types=None).to_dict() | fields
    with pytest.raises(ModelLoadError, match=words):
        from_hf_config(cfg, "g")


def gguf_metadata(vocab: int) -> dict[str, int | float | str | list[bool]]:
    return {
        "block_count": len(LAYER_TYPES),
        "context_length": 512,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
        "attention.sliding_window": WINDOW,
        "attention.sliding_window_pattern": [t == "sliding_attention" for t in LAYER_TYPES],
        "rope.freq_base": 1e6,
        "rope.scaling.type": "linear",
        "rope.scaling.factor": 2.0,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "vocab_size": vocab,
    }


@pytest.fixture(scope="module")
def toy_reference() -> torch.nn.Module:
    """The architecture over the toy tokenizer's vocabulary (for GGUF files), scores
    scaled by head_dim ** -0.5 as llama.cpp scales them (a GGUF has no scalar)."""
    return gemma3_model(gemma3_config(len(TOY_TOKENS), query_pre_attn_scalar=HEAD_DIM))


def test_gemma3_gguf_names_and_config(tmp_path: Path, toy_reference: torch.nn.Module) -> None:
    vocab = len(TOY_TOKENS)
    path = write_gguf(
        toy_reference, tmp_path / "g.gguf", gguf.MODEL_ARCH.GEMMA3, gguf_metadata(vocab)
    )
    config = gguf_file.read_model_config(gguf_file.open_gguf(path), path)
    assert (config.architecture, config.qk_norm, config.tie_word_embeddings) == (
        "gemma3",
        True,
        True,
    )
    assert config.layer_types == tuple(LAYER_TYPES) and config.sliding_window == WINDOW
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 10000.0)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.query_pre_attn_scalar == HEAD_DIM
    weights = gguf_file.read_weights(path, config)
    expected = {k: v for k, v in toy_reference.state_dict().items() if k != "lm_head.weight"}
    assert set(weights) == set(expected)
    for name in expected:  # norms back from 1 + weight, to float32's rounding of the sum
        torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=1e-6)


def test_gemma3_gguf_matches_transformers(tmp_path: Path, toy_reference: torch.nn.Module) -> None:
    vocab = len(TOY_TOKENS)
    path = write_gguf(
        toy_reference, tmp_path / "g.gguf", gguf.MODEL_ARCH.GEMMA3, gguf_metadata(vocab)
    )
    ours = our_engine(path, cache_dir=tmp_path / "cache", weights="dense")
    assert_matches(ours, toy_reference, token_prompts(vocab, [5, 13, 40], seed=7))


def test_a_quantized_gemma3_gguf_runs_the_python_layers(
    tmp_path: Path, toy_reference: torch.nn.Module
) -> None:
    vocab = len(TOY_TOKENS)
    metadata = gguf_metadata(vocab)
    path = write_gguf(
        toy_reference, tmp_path / "q8.gguf", gguf.MODEL_ARCH.GEMMA3, metadata, quantize=True
    )
    quantized = our_engine(path, cache_dir=tmp_path / "cache", weights="quantized")
    dense = our_engine(path, cache_dir=tmp_path / "cache", weights="dense")
    assert quantized.model.decode_step is None
    prompts = token_prompts(vocab, [20, 50], seed=8)
    for ours, theirs in zip(
        our_prefill_logits(quantized, prompts), our_prefill_logits(dense, prompts), strict=True
    ):
        assert (ours - theirs).abs().max().item() < 0.08 * theirs.abs().max().item()


def test_llama_cpp_defaults_for_what_a_gemma3_gguf_does_not_say() -> None:
    """Every sixth layer full; without a window every layer full at the global base; the
    62-layer model (27B) scales scores by (hidden / heads) ** -0.5."""
    config = gemma3_config(100, num_hidden_layers=7, layer_types=None)
    base = from_hf_config(config.to_dict(), "g")
    assert base.layer_types[4:] == ("sliding_attention", "full_attention", "sliding_attention")
    plain = replace(base, architecture="llama", qk_norm=False, layer_types=())
    facts = gguf_facts(plain, {}, None, "g")
    assert facts.layer_types == base.layer_types and facts.local_rope_theta == 10000.0
    unwindowed = gguf_facts(replace(plain, sliding_window=None), {}, None, "g")
    assert unwindowed.layer_types == () and unwindowed.local_rope_theta == unwindowed.rope_theta
    big = replace(plain, num_layers=62, hidden_size=5376, num_heads=32, head_dim=128)
    assert gguf_facts(big, {}, None, "g").query_pre_attn_scalar == 168
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        gguf_facts(plain, {"gemma3.attn_logit_softcapping": 50.0}, None, "g")
