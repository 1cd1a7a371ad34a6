"""Qwen3 dense (per-head q/k RMSNorm, no q/k/v bias, head_dim from the config) against
transformers on small random models: from a folder (one file, sharded) and from GGUF."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from random_models import (
    TOY_TOKENS,
    assert_matches,
    assert_shards_match,
    our_engine,
    random_model,
    save_folder,
    token_prompts,
    write_gguf,
)
from reference import our_prefill_logits

from appliance.engine.sequence import SamplingParams
from appliance.model import cpu_kernels
from appliance.model.formats import gguf_file

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 64  # head_dim 64, not hidden / heads = 16


def qwen3_config(vocab: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,
        rope_theta=1000000.0,
    )


def gguf_metadata(vocab: int) -> dict[str, int | float]:
    return {
        "block_count": LAYERS,
        "context_length": 512,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
        "rope.freq_base": 1000000.0,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "vocab_size": vocab,
    }


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    model = random_model(qwen3_config(49152))
    # The norms' default weights are ones: random ones show they are applied.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def toy_reference() -> torch.nn.Module:
    """The same architecture over the toy tokenizer's vocabulary (for GGUF files)."""
    model = random_model(qwen3_config(len(TOY_TOKENS)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("shard_size", [None, "1MB"], ids=["one-file", "sharded"])
def test_qwen3_folder_matches_transformers(
    tmp_path: Path, reference: torch.nn.Module, shard_size: str | None
) -> None:
    folder = save_folder(reference, tmp_path, shard_size=shard_size)
    if shard_size is not None:
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 1
    ours = our_engine(folder)
    config = ours.model.config
    assert (config.architecture, config.qk_norm, config.attention_bias) == ("qwen3", True, False)
    assert config.head_dim == HEAD_DIM and config.sliding_window is None
    prompts = token_prompts(49152, [5, 17, 40, 3, 64])
    prompts.append(ours.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}]))
    assert_matches(ours, reference, prompts)


def test_qwen3_gguf_names_and_config(tmp_path: Path, toy_reference: torch.nn.Module) -> None:
    vocab = len(TOY_TOKENS)
    path = write_gguf(
        toy_reference, tmp_path / "q.gguf", gguf.MODEL_ARCH.QWEN3, gguf_metadata(vocab)
    )
    config = gguf_file.read_model_config(gguf_file.open_gguf(path), path)
    assert (config.architecture, config.qk_norm, config.attention_bias) == ("qwen3", True, False)
    assert (config.head_dim, config.num_heads, config.hidden_size) == (HEAD_DIM, HEADS, 64)
    weights = gguf_file.read_weights(path, config)
    expected = toy_reference.state_dict()
    assert set(weights) == set(expected)
    checked = (
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.self_attn.q_proj.weight",  # rows as Hugging Face has them
        "model.layers.1.self_attn.k_proj.weight",
    )
    for name in checked:
        torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=0)


def test_qwen3_gguf_matches_transformers(tmp_path: Path, toy_reference: torch.nn.Module) -> None:
    vocab = len(TOY_TOKENS)
    path = write_gguf(
        toy_reference, tmp_path / "q.gguf", gguf.MODEL_ARCH.QWEN3, gguf_metadata(vocab)
    )
    ours = our_engine(path, cache_dir=tmp_path / "cache", weights="dense")
    assert_matches(ours, toy_reference, token_prompts(vocab, [5, 17, 40, 3, 64]))


def test_qwen3_quantized_gguf_runs_the_compiled_decode_step(tmp_path: Path) -> None:
    """Q8_0 blocks multiplied in place: the compiled decode step runs the q/k head norms
    and answers as the Python layers do, and close to the same file dequantized."""
    vocab = len(TOY_TOKENS)
    model = random_model(qwen3_config(vocab))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    path = write_gguf(
        model, tmp_path / "q8.gguf", gguf.MODEL_ARCH.QWEN3, gguf_metadata(vocab), quantize=True
    )
    compiled = our_engine(path, cache_dir=tmp_path / "cache", weights="quantized")
    layers = our_engine(path, cache_dir=tmp_path / "cache", weights="quantized")
    layers.model.decode_step = None
    dense = our_engine(path, cache_dir=tmp_path / "cache", weights="dense")
    assert compiled.model.decode_step is not None or not cpu_kernels.available()
    prompts = token_prompts(vocab, [5, 17, 40])
    for ours, theirs in zip(
        our_prefill_logits(compiled, prompts), our_prefill_logits(dense, prompts), strict=True
    ):
        scale = theirs.abs().max().item()
        assert (ours - theirs).abs().max().item() < 0.02 * scale
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got = [c.token_ids for c in compiled.generate(prompts, params)]
    assert got == [c.token_ids for c in layers.generate(prompts, params)]
    assert got == [c.token_ids for c in dense.generate(prompts, params)]


def test_qwen3_tensor_parallel_shards_match_transformers(
    tmp_path: Path, reference: torch.nn.Module
) -> None:
    """Two shards, a KV head (and its query heads) each; the q/k norms are per head, so
    each shard keeps them whole."""
    folder = save_folder(reference, tmp_path)
    prompts = token_prompts(49152, [7, 30, 50])
    assert_shards_match(folder, prompts, [reference] * len(prompts))
