"""Phi-3 / Phi-4 (model_type and GGUF architecture "phi3": fused qkv_proj and gate_up_proj,
LongRoPE, partial RoPE) against transformers on small random models: from a sharded
folder and from GGUF, at TP=2 and served in both layouts.

Two models: "phi3" as Phi-3-mini-4k (no scaling, whole-head RoPE) and "phi4mini" as
Phi-4-mini (LongRoPE with a pretraining length of 64 in a 256-token context, RoPE over
3/4 of each head, tied embeddings). The engine takes LongRoPE's long factors when its
max_model_len passes the pretraining length, else the short ones (rope.longrope_factors);
transformers switches per call by sequence length, so each set is checked where
transformers uses it too, and on short prompts the long set is checked against
transformers with its short factors replaced by the long ones."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
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
from appliance.model import cpu_kernels
from appliance.model.errors import ModelLoadError
from appliance.model.families.phi3 import Phi3Weights, rotary_row_order
from appliance.model.formats import gguf_file
from appliance.model.registry import from_hf_config

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

VOCAB, HIDDEN, FF, LAYERS, HEADS, KV_HEADS = 49152, 64, 128, 2, 4, 2
ORIGINAL, CONTEXT, PARTIAL = 64, 256, 0.75  # LongRoPE's pretraining length, the context


def _factors(seed: int, hidden: int) -> tuple[list[float], list[float]]:
    """Short and long LongRoPE factors, one per turned pair of a head's dimensions."""
    pairs = int(hidden // HEADS * PARTIAL) // 2
    rng = np.random.default_rng(seed)
    return [float(f) for f in 1 + rng.random(pairs)], [float(f) for f in 2 + 6 * rng.random(pairs)]


def phi3_config(vocab: int, kind: str, *, hidden: int = HIDDEN, long_only: bool = False):
    """The "phi3" model (plain) or the "phi4mini" one (LongRoPE, partial RoPE, tied); with
    `long_only`, its short factors replaced by the long ones (transformers then uses the
    long at every length)."""
    from transformers import Phi3Config

    extra: dict = {}
    if kind == "phi4mini":
        short, long = _factors(1, hidden)
        scaling = {"type": "longrope", "short_factor": long if long_only else short}
        extra = {"partial_rotary_factor": PARTIAL, "rope_scaling": scaling | {"long_factor": long}}
    return Phi3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        original_max_position_embeddings=ORIGINAL,
        tie_word_embeddings=kind == "phi4mini",
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        **extra,
    )


def long_only(reference: torch.nn.Module, vocab: int, hidden: int = HIDDEN) -> torch.nn.Module:
    """`reference` with LongRoPE's long factors at every length."""
    model = random_model(phi3_config(vocab, "phi4mini", hidden=hidden, long_only=True))
    model.load_state_dict(reference.state_dict())
    return model


def phi3_gguf(model: torch.nn.Module, path: Path, *, quantize: bool = False) -> Path:
    """`model` as llama.cpp's convert_hf_to_gguf writes a "phi3" file: no key_length, the
    turned dimensions in rope.dimension_count, sliding_window 0 for none, LongRoPE's
    factors as tensors with its pretraining length and attention factor in metadata."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    metadata: dict[str, int | float] = {
        "context_length": cfg.max_position_embeddings,
        "rope.scaling.original_context_length": cfg.original_max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "block_count": cfg.num_hidden_layers,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 1.0)),
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.sliding_window": 0,
    }
    extra = {}
    if rope.get("rope_type") == "longrope":
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        attn = math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings))
        metadata["rope.scaling.attn_factor"] = attn
        extra = {
            "rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32),
        }
    return write_gguf(model, path, gguf.MODEL_ARCH.PHI3, metadata, quantize=quantize, extra=extra)


@pytest.fixture(scope="module")
def plain() -> torch.nn.Module:
    return random_model(phi3_config(VOCAB, "phi3"))


@pytest.fixture(scope="module")
def phi4mini() -> torch.nn.Module:
    return random_model(phi3_config(VOCAB, "phi4mini"))


@pytest.fixture(scope="module")
def phi4mini_long(phi4mini: torch.nn.Module) -> torch.nn.Module:
    return long_only(phi4mini, VOCAB)


@pytest.fixture(scope="module")
def phi4mini_folder(tmp_path_factory: pytest.TempPathFactory, phi4mini: torch.nn.Module) -> Path:
    return save_folder(phi4mini, tmp_path_factory.mktemp("phi4mini"), shard_size="1MB")


def test_phi3_sharded_folder_matches_transformers(tmp_path: Path, plain: torch.nn.Module) -> None:
    folder = save_folder(plain, tmp_path, shard_size="1MB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    ours = our_engine(folder)
    config = ours.model.config
    assert (config.architecture, config.rotary_dim, config.rope_scaling) == ("phi3", None, None)
    prompts = token_prompts(VOCAB, [5, 17, 40, 3, 64])
    prompts.append(ours.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}]))
    assert_matches(ours, plain, prompts)


def test_longrope_short_factors_within_the_pretraining_length(
    phi4mini_folder: Path, phi4mini: torch.nn.Module
) -> None:
    """max_model_len = the pretraining length: the short factors, as transformers uses
    them for every sequence that stays within it."""
    ours = our_engine(phi4mini_folder, batch={"max_model_len": ORIGINAL})
    config = ours.model.config
    assert config.rotary_dim == int(HIDDEN // HEADS * PARTIAL) and config.tie_word_embeddings
    assert config.rope_scaling is not None
    assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert_matches(ours, phi4mini, token_prompts(VOCAB, [5, 17, 30, 3]))


def test_longrope_long_factors_past_the_pretraining_length(
    phi4mini_folder: Path, phi4mini: torch.nn.Module, phi4mini_long: torch.nn.Module
) -> None:
    """max_model_len past the pretraining length: the long factors, for prompts past it
    (as transformers) and within it (as transformers with only long factors)."""
    short_prompt = token_prompts(VOCAB, [20], seed=5)[0]
    # The check means something: the two factor sets answer differently.
    assert greedy(phi4mini, short_prompt, 16) != greedy(phi4mini_long, short_prompt, 16)
    ours = our_engine(phi4mini_folder)
    assert_matches(ours, phi4mini, token_prompts(VOCAB, [65, 90, 70], seed=1))
    assert_matches(ours, phi4mini_long, [short_prompt, *token_prompts(VOCAB, [5, 40], seed=2)])


def test_phi3_gguf_names_and_config(tmp_path: Path) -> None:
    """A llama.cpp-style "phi3" GGUF: attn_qkv and ffn_up (gate and up) cut into the
    projections at Hugging Face's rows, Q/K rows reordered for the partial RoPE;
    LongRoPE and the turned dimensions read from its metadata and tensors."""
    model = random_model(phi3_config(len(TOY_TOKENS), "phi4mini"))
    path = phi3_gguf(model, tmp_path / "p.gguf")
    config = gguf_file.read_model_config(gguf_file.open_gguf(path), path)
    head_dim = HIDDEN // HEADS
    rotary = int(head_dim * PARTIAL)
    assert (config.architecture, config.head_dim, config.rotary_dim) == ("phi3", head_dim, rotary)
    assert config.sliding_window is None and config.tie_word_embeddings
    rope = model.config.rope_parameters
    assert config.rope_scaling is not None
    assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    for key in ("short_factor", "long_factor"):
        np.testing.assert_allclose(config.rope_scaling[key], rope[key], rtol=1e-6)
    weights = Phi3Weights(gguf_file.read_weights(path, config), config)
    state = model.state_dict()
    q, kv, ff = HEADS * head_dim, KV_HEADS * head_dim, 2 * HIDDEN
    order = rotary_row_order(head_dim, rotary)
    layer = "model.layers.1."
    qkv = state[layer + "self_attn.qkv_proj.weight"]
    gate_up = state[layer + "mlp.gate_up_proj.weight"]
    expected = {
        "self_attn.q_proj.weight": qkv[:q].view(HEADS, head_dim, -1)[:, order].reshape(q, -1),
        "self_attn.k_proj.weight": qkv[q : q + kv].view(KV_HEADS, head_dim, -1)[:, order],
        "self_attn.v_proj.weight": qkv[q + kv :],
        "mlp.gate_proj.weight": gate_up[:ff],
        "mlp.up_proj.weight": gate_up[ff:],
    }
    for name, tensor in expected.items():
        torch.testing.assert_close(
            weights[layer + name], tensor.reshape(-1, HIDDEN), rtol=0, atol=0
        )
    assert "lm_head.weight" not in weights and not any("rope_factors" in n for n in weights)


@pytest.mark.parametrize("kind", ["phi3", "phi4mini"])
def test_phi3_gguf_matches_transformers(tmp_path: Path, kind: str) -> None:
    vocab = len(TOY_TOKENS)
    reference = random_model(phi3_config(vocab, kind))
    path = phi3_gguf(reference, tmp_path / "p.gguf")
    cache = tmp_path / "cache"
    if kind == "phi3":
        ours = our_engine(path, cache_dir=cache, weights="dense")
        assert_matches(ours, reference, token_prompts(vocab, [5, 17, 40, 3, 64]))
        return
    short = our_engine(path, cache_dir=cache, weights="dense", batch={"max_model_len": ORIGINAL})
    assert_matches(short, reference, token_prompts(vocab, [5, 17, 30]))
    ours = our_engine(path, cache_dir=cache, weights="dense")
    assert_matches(ours, reference, token_prompts(vocab, [65, 80], seed=1))
    assert_matches(ours, long_only(reference, vocab), token_prompts(vocab, [5, 30], seed=2))


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels are not built")
def test_quantized_phi4mini_gguf_runs_the_compiled_decode_step(tmp_path: Path) -> None:
    """Q8_0 blocks cut from attn_qkv and ffn_up and multiplied in place, head size 64:
    the compiled decode step (which takes the RoPE tables, partial and scaled, as they
    are) answers as the Python layers do, and close to the same file dequantized."""
    vocab = len(TOY_TOKENS)
    model = random_model(phi3_config(vocab, "phi4mini", hidden=256))
    path = phi3_gguf(model, tmp_path / "q8.gguf", quantize=True)
    cache = tmp_path / "cache"
    compiled = our_engine(path, cache_dir=cache, weights="quantized")
    assert compiled.model.decode_step is not None
    layers = our_engine(path, cache_dir=cache, weights="quantized")
    layers.model.decode_step = None
    dense = our_engine(path, cache_dir=cache, weights="dense")
    prompts = token_prompts(vocab, [5, 17, 70])
    for ours, theirs in zip(
        our_prefill_logits(compiled, prompts), our_prefill_logits(dense, prompts), strict=True
    ):
        assert (ours - theirs).abs().max().item() < 0.02 * theirs.abs().max().item()
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got = [c.token_ids for c in compiled.generate(prompts, params)]
    assert got == [c.token_ids for c in layers.generate(prompts, params)]


def test_phi4mini_tensor_parallel_shards_match_transformers(
    phi4mini_folder: Path, phi4mini: torch.nn.Module, phi4mini_long: torch.nn.Module
) -> None:
    """Two shards, a KV head (and its query heads) each, cut from the fused qkv_proj and
    gate_up_proj; long factors (max_model_len 256)."""
    prompts = token_prompts(VOCAB, [70, 90, 7, 30], seed=3)
    references = [phi4mini, phi4mini, phi4mini_long, phi4mini_long]
    assert_shards_match(phi4mini_folder, prompts, references)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_appliance_serves_phi4mini(
    phi4mini_folder: Path,
    phi4mini: torch.nn.Module,
    phi4mini_long: torch.nn.Module,
    mode: str,
) -> None:
    """`appliance serve` (prefill and decode pools, the KV cache handed between them, or
    colocated workers) answers as transformers does: its keys, reordered for the partial
    RoPE, mean the same in every worker."""
    from transformers import AutoTokenizer

    prompts = token_prompts(VOCAB, [70, 20], seed=4)
    texts = served_completions(phi4mini_folder, {"APPLIANCE_MODE": mode}, prompts)
    tokenizer = AutoTokenizer.from_pretrained(phi4mini_folder)
    references = [phi4mini, phi4mini_long]
    expected = [
        tokenizer.decode(greedy(r, p, 24)) for p, r in zip(prompts, references, strict=True)
    ]
    assert texts == expected


@pytest.mark.parametrize(
    ("model_type", "fields", "words"),
    [
        ("phi3small", {}, "unknown architecture 'phi3small'"),
        ("phimoe", {}, "supported: llama, mistral, qwen2, qwen3, phi3"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ("phi3", {"partial_rotary_factor": 0.1}, "gives 1 of 16 head dimensions"),
        ("phi3", {"rope_scaling": {"type": "yarn", "factor": 2.0}}, "unsupported RoPE scaling"),
        (
            "phi3",
            {"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [1.0]}},
            "longrope short_factor must list 8 numbers",
        ),
    ],
)
def test_unsupported_variants_are_refused_in_one_line(
    model_type: str, fields: dict, words: str
) -> None:
    cfg = phi3_config(100, "phi3").to_dict() | {"model_type": model_type} | fields
    with pytest.raises(ModelLoadError) as excinfo:
        from_hf_config(cfg, "m")
    assert words in str(excinfo.value) and "\n" not in str(excinfo.value)
