"""gpt-oss (GptOssForCausalLM) against transformers on small random float32 models:
attention sinks, q/k/v/o biases, sliding layers beside full ones, YaRN RoPE, routed
experts with biases and the clamped SwiGLU; from a folder (one file, sharded), with
chunked prefill and prefix hits, tensor-parallel shards and `appliance serve` in both
layouts; and from GGUF (llama.cpp's gpt-oss names, float and MXFP4 experts)."""

from __future__ import annotations

import copy
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

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.scheduler import SchedulerLimits
from appliance.engine.sequence import SamplingParams
from appliance.kv.cache import KVCache, KVLayout
from appliance.model import cpu_kernels
from appliance.model.decode_step import compiled_problem
from appliance.model.errors import ModelLoadError
from appliance.model.formats import gguf_file
from appliance.model.quant import QuantLinear
from appliance.model.registry import from_hf_config

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

VOCAB, WINDOW, EXPERTS, TOP_K, LIMIT = 49152, 12, 8, 2, 1.5
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
# YaRN over a short pretraining length, so the ramp between the scaled and unscaled
# pairs falls inside the head (beta_fast 8: pairs turning < 8 times over 128 blend).
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
YARN |= {"beta_fast": 8.0, "beta_slow": 1.0, "rope_theta": 10000.0}


def gpt_oss_config(vocab: int = VOCAB, truncate: bool = False, **fields: Any):
    from transformers import GptOssConfig

    return GptOssConfig(
        **{
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": len(LAYER_TYPES),
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "num_local_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "sliding_window": WINDOW,
            "layer_types": LAYER_TYPES,
            "max_position_embeddings": 512,  # factor x original: no warning
            "swiglu_limit": LIMIT,  # small: the random activations reach it
            "initializer_range": 0.2,
            "rope_parameters": YARN | {"truncate": truncate},
        }
        | fields
    )


def gpt_oss_model(config: Any) -> torch.nn.Module:
    """A random model whose sinks and biases are random and nonzero (init zeroes the
    experts' biases) and whose sinks are large enough to take a share of each softmax."""
    model = random_model(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 2.0)
            elif name.endswith(("bias", "_bias")):
                param.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return gpt_oss_model(gpt_oss_config())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, reference: torch.nn.Module) -> Path:
    folder = save_folder(reference, tmp_path_factory.mktemp("gpt_oss"), shard_size="1MB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.fixture(scope="module")
def engine(folder: Path) -> LLMEngine:
    return our_engine(folder)


# Shorter than, as long as, and longer than the window; 32 new tokens pass it for all.
PROMPT_LENGTHS = [5, 12, 13, 40, 90]


def test_gpt_oss_sharded_folder_matches_transformers(
    engine: LLMEngine, reference: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill logits and 32 greedy tokens; the compiled CPU decode kernel (no sinks) is
    never called: decode runs attend_with_sinks."""
    config = engine.model.config
    assert (config.architecture, config.attention_sinks, config.attention_bias) == (
        "gpt_oss",
        True,
        True,
    )
    assert config.layer_types == tuple(LAYER_TYPES) and config.sliding_window == WINDOW
    yarn = {k: v for k, v in YARN.items() if k != "rope_theta"}
    assert config.rope_scaling == yarn | {"truncate": False} and config.rope_theta == 10000.0
    assert (config.num_experts, config.experts_per_token, config.swiglu_limit) == (8, 2, LIMIT)
    assert engine.model.decode_step is None and "sinks" in compiled_problem(engine.model)

    def no_kernel(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the compiled decode kernel has no sinks")

    monkeypatch.setattr(cpu_kernels, "paged_decode", no_kernel)
    worst = assert_matches(engine, reference, token_prompts(VOCAB, PROMPT_LENGTHS))
    print(f"largest prefill logit error {worst:.2e}")


def test_gpt_oss_one_file_folder_matches_transformers(
    tmp_path: Path, reference: torch.nn.Module
) -> None:
    ours = our_engine(save_folder(reference, tmp_path))
    assert_matches(ours, reference, token_prompts(VOCAB, [7, 30], seed=4), tokens=16)


def test_sinks_and_the_clamp_change_the_answer(reference: torch.nn.Module) -> None:
    """The checks mean something: without sinks, or with no clamp, the same weights answer
    otherwise."""
    prompt = token_prompts(VOCAB, [40])[0]
    expected = greedy(reference, prompt, 16)
    no_sinks = gpt_oss_model(gpt_oss_config())
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert greedy(no_sinks, prompt, 16) != expected
    assert greedy(gpt_oss_model(gpt_oss_config(swiglu_limit=1e4)), prompt, 16) != expected


def test_chunked_prefill_and_prefix_hits_keep_sinks_and_windows(
    engine: LLMEngine, reference: torch.nn.Module
) -> None:
    """Prompts prefilled 16 tokens a step over their cached chunks; then a prompt whose
    first 32 tokens are cached from another (a prefix hit) answers as transformers."""
    cfg = engine.model.config
    layout = KVLayout(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    kv = KVCache(layout, 64, engine.model.device)
    limits = SchedulerLimits(8, 64, 16, 512)
    chunked = LLMEngine(engine.model, engine.tokenizer, kv, limits, True)
    first, second = token_prompts(VOCAB, [70, 33], seed=1)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in (first, first[:32] + second):
        cached = 0
        tokens: list[int] = []
        for out in chunked.stream(prompt, params):
            tokens += out.token_ids
            cached = max(cached, out.cached_tokens)
        assert tokens == greedy(reference, prompt, 24)
    assert cached == 32


def test_tensor_parallel_shards_match_transformers(
    folder: Path, reference: torch.nn.Module
) -> None:
    """Two shards, a KV head (its query heads and their sinks) each; experts split by
    column (96 = 64 + 32); the o and down biases added once."""
    prompts = token_prompts(VOCAB, [10, 30, 75], seed=2)
    assert_shards_match(folder, prompts, [reference] * len(prompts))


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_appliance_serve_answers_as_transformers(
    folder: Path, reference: torch.nn.Module, mode: str
) -> None:
    from transformers import AutoTokenizer

    prompts = token_prompts(VOCAB, [30, 60], seed=3)
    texts = served_completions(folder, {"APPLIANCE_MODE": mode}, prompts)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert texts == [tokenizer.decode(greedy(reference, p, 24)) for p in prompts]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config 'mxfp4'"),
        ({"layer_types": ["sliding_attention", "chunked_attention", "x"]}, "layer_types"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 of 8 experts"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "needs original_max"),
    ],
)
def test_what_is_not_run_is_refused(fields: dict, words: str) -> None:
    cfg = gpt_oss_config(100).to_dict() | fields
    with pytest.raises(ModelLoadError) as excinfo:
        from_hf_config(cfg, "g")
    assert words in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_mxfp4_expert_blocks_in_a_folder_are_refused(tmp_path: Path, folder: Path) -> None:
    from safetensors.torch import save_file

    for path in folder.iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    blocks = torch.zeros(EXPERTS, 192, 2, 16, dtype=torch.uint8)
    save_file(
        {"model.layers.0.mlp.experts.gate_up_proj_blocks": blocks}, tmp_path / "m.safetensors"
    )
    with pytest.raises(ModelLoadError, match="MXFP4"):
        our_engine(tmp_path)


def gguf_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as llama.cpp's converter writes it: experts de-interleaved and
    transposed to [experts, out, in], each projection (and its bias) stacked apart; the
    sinks as attn_sinks.weight."""
    out = {}
    for name, tensor in model.state_dict().items():
        base = name.rpartition(".")[0]
        if name.endswith("experts.gate_up_proj"):
            out[base + ".gate_proj.weight"] = tensor[..., ::2].transpose(1, 2)
            out[base + ".up_proj.weight"] = tensor[..., 1::2].transpose(1, 2)
        elif name.endswith("experts.gate_up_proj_bias"):
            out[base + ".gate_proj.bias"] = tensor[..., ::2]
            out[base + ".up_proj.bias"] = tensor[..., 1::2]
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = tensor.transpose(1, 2)
        elif name.endswith("experts.down_proj_bias"):
            out[base + ".down_proj.bias"] = tensor
        elif name.endswith("sinks"):
            out[name + ".weight"] = tensor
        else:
            out[name] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def gguf_metadata(vocab: int) -> dict[str, int | float | str | list[bool]]:
    return {
        "block_count": len(LAYER_TYPES),
        "context_length": 512,
        "embedding_length": 64,
        "feed_forward_length": 96,
        "expert_feed_forward_length": 96,
        "expert_count": EXPERTS,
        "expert_used_count": TOP_K,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 64,
        "attention.value_length": 64,
        "attention.sliding_window": WINDOW,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 10000.0,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 128,
        "rope.scaling.yarn_beta_fast": 8.0,
        "rope.scaling.yarn_beta_slow": 1.0,
        "vocab_size": vocab,
    }


@pytest.fixture(scope="module")
def toy_reference() -> torch.nn.Module:
    """The architecture over the toy tokenizer's vocabulary (for GGUF files), with YaRN's
    correction range truncated, as llama.cpp always computes it; limit 7, llama.cpp's."""
    return gpt_oss_model(gpt_oss_config(len(TOY_TOKENS), truncate=True, swiglu_limit=7.0))


def test_gpt_oss_gguf_names_config_and_answers(
    tmp_path: Path, toy_reference: torch.nn.Module
) -> None:
    vocab = len(TOY_TOKENS)
    tensors = gguf_tensors(toy_reference)
    path = write_gguf(
        toy_reference,
        tmp_path / "g.gguf",
        gguf.MODEL_ARCH.GPT_OSS,
        gguf_metadata(vocab),
        tensors=tensors,
    )
    config = gguf_file.read_model_config(gguf_file.open_gguf(path), path)
    assert (config.architecture, config.attention_sinks, config.num_experts) == (
        "gpt_oss",
        True,
        EXPERTS,
    )
    assert config.layer_types == tuple(LAYER_TYPES) and config.sliding_window == WINDOW
    assert config.rope_scaling is not None and config.rope_scaling["truncate"]
    names = set(gguf_file.read_weights(path, config))
    assert {"model.layers.0.self_attn.sinks", "model.layers.0.mlp.experts.up_proj.bias"} <= names
    ours = our_engine(path, cache_dir=tmp_path / "cache", weights="dense")
    assert_matches(ours, toy_reference, token_prompts(vocab, [5, 13, 40], seed=7))


def test_mxfp4_experts_in_a_gguf_are_dequantized(
    tmp_path: Path, toy_reference: torch.nn.Module
) -> None:
    """Experts stored as MXFP4 blocks (as llama.cpp ships gpt-oss) answer as transformers
    does with the same weights rounded to MXFP4."""
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    tensors = gguf_tensors(toy_reference)
    rounded = copy.deepcopy(toy_reference)
    state = rounded.state_dict()
    for name, tensor in list(tensors.items()):
        if name.endswith("_proj.weight") and ".experts." in name:
            blocks = gguf.quants.quantize(tensor.numpy(), mxfp4)
            tensors[name] = torch.from_numpy(gguf.quants.dequantize(blocks, mxfp4).copy())
    with torch.no_grad():
        for layer in range(len(LAYER_TYPES)):
            experts = f"model.layers.{layer}.mlp.experts."
            gate, up = tensors[experts + "gate_proj.weight"], tensors[experts + "up_proj.weight"]
            # [experts, columns, 2, hidden] -> rows g0, u0, g1, ...: [experts, hidden, 2 * cols]
            fused = torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2)
            state[experts + "gate_up_proj"].copy_(fused)
            down = tensors[experts + "down_proj.weight"].transpose(1, 2)
            state[experts + "down_proj"].copy_(down)
    vocab = len(TOY_TOKENS)
    types = {n: mxfp4 for n in tensors if n.endswith("_proj.weight") and ".experts." in n}
    path = write_gguf(
        rounded,
        tmp_path / "mx.gguf",
        gguf.MODEL_ARCH.GPT_OSS,
        gguf_metadata(vocab),
        tensors=tensors,
        types=types,
    )
    ours = our_engine(path, cache_dir=tmp_path / "cache")
    assert_matches(ours, rounded, token_prompts(vocab, [9, 33], seed=8), tokens=16)


def test_the_quantized_path_keeps_the_expert_biases(folder: Path, engine: LLMEngine) -> None:
    """Float weights quantized to Q8_0 at load: experts and o keep their biases, and the
    prefill logits stay close to the dense model's at most positions (Q8_0 errs by 2-5%
    of a position's largest logit here; where it flips a token's top-2 experts, by ~20%)."""
    quantized = our_engine(folder, weights="quantized", quantize="q8_0")
    assert quantized.model.decode_step is None
    layer = quantized.model.layers[0]
    linears = (layer.mlp.experts[0].gate_up_proj, layer.mlp.experts[0].down_proj)
    assert all(isinstance(x, QuantLinear) and x.bias is not None for x in linears)
    assert layer.self_attn.o_proj.bias is not None
    prompts = token_prompts(VOCAB, [20, 50], seed=6)
    for ours, theirs in zip(
        our_prefill_logits(quantized, prompts), our_prefill_logits(engine, prompts), strict=True
    ):
        errors = (ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)  # [positions]
        assert errors.median().item() < 0.06 and errors.max().item() < 0.3
