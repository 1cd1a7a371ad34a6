"""The conformance cases: for each model family in the registry, the small random
transformers models it is tested on (one case a variant: Qwen3 and Mistral are llama's,
Phi-3 and Phi-4-mini phi3's, Mixtral and Qwen3-MoE mixtral's), how their random weights
are made to show every part is applied, and how each is written as llama.cpp writes it
to a GGUF."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from family_configs import tiny_config
from gguf_builder import tiny_gguf_metadata
from random_models import TOY_TOKENS, random_model, write_gguf

VOCAB = 49152  # the embedded model's tokenizer, which save_folder copies
TOY_VOCAB = len(TOY_TOKENS)  # a GGUF's toy tokenizer
EXPERTS, TOP_K = 8, 2
WINDOW = 24  # Mistral's
GEMMA3_WINDOW = 12  # Gemma 3's and gpt-oss's
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
PHI3_HEADS, LONGROPE_ORIGINAL, CONTEXT, PARTIAL = 4, 64, 256, 0.75
GPT_OSS_LIMIT = 1.5
# YaRN over a short pretraining length, so the ramp between the scaled and unscaled
# pairs falls inside the head (beta_fast 8: pairs turning < 8 times over 128 blend).
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
YARN |= {"beta_fast": 8.0, "beta_slow": 1.0, "rope_theta": 10000.0}

GgufMetadata = dict[str, int | float | str | list[bool]]


@dataclass(frozen=True)
class Case:
    """One tested variant of a family: `config(vocab, **fields)` its transformers config,
    `model(config)` a seeded random reference of it, `toy_fields` what its GGUF twin (over
    the toy tokenizer) changes, `gguf(model, path, quantize)` writes a model as a GGUF."""

    name: str
    family: str  # its registry.Family's name
    config: Callable[..., Any]
    gguf: Callable[[torch.nn.Module, Path, bool], Path]
    model: Callable[[Any], torch.nn.Module] = random_model
    toy_fields: Mapping[str, Any] = field(default_factory=dict)

    def reference(self, vocab: int = VOCAB, **fields: Any) -> torch.nn.Module:
        return self.model(self.config(vocab, **fields))

    def toy(self, **fields: Any) -> torch.nn.Module:
        """The reference over the toy tokenizer's vocabulary, as its GGUF holds it."""
        return self.reference(TOY_VOCAB, **(dict(self.toy_fields) | fields))


def _random_params(
    model: torch.nn.Module, ranges: Mapping[tuple[str, ...], tuple[str, float, float]]
) -> torch.nn.Module:
    """`model` with the parameters whose names end with a key drawn anew ("uniform" or
    "normal" with these two arguments), the first key that matches."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            for ends, (draw, a, b) in ranges.items():
                if name.endswith(ends):
                    getattr(param, f"{draw}_")(a, b)
                    break
    return model


def with_random_head_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Qwen3's q/k norms' default weights are ones: random ones show they are applied."""
    return _random_params(model, {("q_norm.weight", "k_norm.weight"): ("uniform", 0.5, 1.5)})


def _plain_gguf(arch: gguf.MODEL_ARCH, metadata: Callable[[Any], GgufMetadata]) -> Any:
    def write(model: torch.nn.Module, path: Path, quantize: bool = False) -> Path:
        return write_gguf(model, path, arch, metadata(model.config), quantize=quantize)

    return write


# ------------------------------------------------------------------ Qwen3 (llama's)

QWEN3_LAYERS, QWEN3_HEADS, QWEN3_KV_HEADS, QWEN3_HEAD_DIM = 2, 4, 2, 64  # not 64 / 4


def qwen3_config(vocab: int) -> Any:
    return tiny_config(
        "Qwen3Config",
        vocab,
        num_hidden_layers=QWEN3_LAYERS,
        num_attention_heads=QWEN3_HEADS,
        num_key_value_heads=QWEN3_KV_HEADS,
        head_dim=QWEN3_HEAD_DIM,
        tie_word_embeddings=False,
        initializer_range=0.2,
        rope_theta=1000000.0,
    )


def qwen3_metadata(config: Any) -> GgufMetadata:
    return tiny_gguf_metadata(config) | {
        "attention.key_length": QWEN3_HEAD_DIM,
        "attention.value_length": QWEN3_HEAD_DIM,
    }


# ------------------------------------------------------------------ Mistral (llama's)

MISTRAL_HEAD_DIM = 64  # a head size the compiled decode kernel takes


def mistral_config(vocab: int, window: int | None = WINDOW) -> Any:
    return tiny_config(
        "MistralConfig",
        vocab,
        head_dim=MISTRAL_HEAD_DIM,
        sliding_window=window,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )


def mistral_metadata(config: Any) -> GgufMetadata:
    """A llama-layout GGUF (as llama.cpp writes Mistral) whose metadata has the window."""
    return tiny_gguf_metadata(config) | {
        "attention.key_length": MISTRAL_HEAD_DIM,
        "attention.value_length": MISTRAL_HEAD_DIM,
        "attention.sliding_window": WINDOW,
    }


# ------------------------------------------------------------------ Phi-3, Phi-4-mini


def longrope_factors(seed: int, hidden: int) -> tuple[list[float], list[float]]:
    """Short and long LongRoPE factors, one per turned pair of a head's dimensions."""
    pairs = int(hidden // PHI3_HEADS * PARTIAL) // 2
    rng = np.random.default_rng(seed)
    return [float(f) for f in 1 + rng.random(pairs)], [float(f) for f in 2 + 6 * rng.random(pairs)]


def phi3_config(vocab: int, kind: str, *, hidden: int = 64, long_only: bool = False) -> Any:
    """ "phi3" as Phi-3-mini-4k (no scaling, whole-head RoPE) or "phi4mini" as Phi-4-mini
    (LongRoPE with a pretraining length of 64 in a 256-token context, RoPE over 3/4 of
    each head, tied embeddings); with `long_only`, its short factors replaced by the long
    ones (transformers then uses the long at every length)."""
    extra: dict[str, Any] = {}
    if kind == "phi4mini":
        short, long = longrope_factors(1, hidden)
        scaling = {"type": "longrope", "short_factor": long if long_only else short}
        extra = {"partial_rotary_factor": PARTIAL, "rope_scaling": scaling | {"long_factor": long}}
    return tiny_config(
        "Phi3Config",
        vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=PHI3_HEADS,
        max_position_embeddings=CONTEXT,
        original_max_position_embeddings=LONGROPE_ORIGINAL,
        tie_word_embeddings=kind == "phi4mini",
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        **extra,
    )


def long_only(reference: torch.nn.Module, vocab: int, hidden: int = 64) -> torch.nn.Module:
    """`reference` (a Phi-4-mini) with LongRoPE's long factors at every length."""
    model = random_model(phi3_config(vocab, "phi4mini", hidden=hidden, long_only=True))
    model.load_state_dict(reference.state_dict())
    return model


def phi3_gguf(model: torch.nn.Module, path: Path, quantize: bool = False) -> Path:
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


# ------------------------------------------------------------------ Gemma 3

GEMMA3_HEAD_DIM = 64  # the compiled decode kernel's size


def gemma3_config(vocab: int, **fields: Any) -> Any:
    return tiny_config(
        "Gemma3TextConfig",
        vocab,
        **{
            "num_hidden_layers": len(LAYER_TYPES),
            "head_dim": GEMMA3_HEAD_DIM,
            "sliding_window": GEMMA3_WINDOW,
            "layer_types": LAYER_TYPES,
            "query_pre_attn_scalar": 32,  # not head_dim: the scale is its own
            "initializer_range": 0.2,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        }
        | fields,
    )


def gemma3_model(config: Any) -> torch.nn.Module:
    """A random model whose norm weights are random too (Gemma's are zeros: 1 + 0). The
    norms after attention and the MLP scale up: else the scaled embedding dominates the
    residual stream and greedy decoding repeats the last token whatever the layers do."""
    post = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
    ranges = {post: ("uniform", 2.0, 5.0), ("norm.weight",): ("uniform", -0.5, 0.5)}
    return _random_params(random_model(config), ranges)


def gemma3_metadata(config: Any) -> GgufMetadata:
    return tiny_gguf_metadata(config) | {
        "attention.key_length": GEMMA3_HEAD_DIM,
        "attention.value_length": GEMMA3_HEAD_DIM,
        "attention.sliding_window": GEMMA3_WINDOW,
        "attention.sliding_window_pattern": [t == "sliding_attention" for t in LAYER_TYPES],
        "rope.scaling.type": "linear",
        "rope.scaling.factor": 2.0,
    }


# ------------------------------------------------------------------ Mixtral, Qwen3-MoE


def mixtral_config(vocab: int) -> Any:
    return tiny_config(
        "MixtralConfig",
        vocab,
        intermediate_size=96,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


def qwen3_moe_config(
    vocab: int, norm_topk_prob: bool = False, mlp_only_layers: tuple[int, ...] = (1,)
) -> Any:
    return tiny_config(
        "Qwen3MoeConfig",
        vocab,
        intermediate_size=128,  # the dense layer's
        moe_intermediate_size=64,
        num_hidden_layers=3,
        head_dim=32,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,  # False: Mixtral tests the renormalized weights
        mlp_only_layers=list(mlp_only_layers),  # (1,): a dense MLP between routed layers
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


def moe_gguf_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as a GGUF converter sees it: each projection's experts
    stacked apart ([experts, rows, in]; transformers keeps gate and up fused)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            out[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = tensor
        else:
            out[name] = tensor
    return out


def moe_metadata(config: Any) -> GgufMetadata:
    moe_config = config.model_type == "qwen3_moe"
    return tiny_gguf_metadata(config) | {
        "attention.key_length": config.head_dim or 16,
        "attention.value_length": config.head_dim or 16,
        "expert_count": EXPERTS,
        "expert_used_count": TOP_K,
        **({"expert_feed_forward_length": config.moe_intermediate_size} if moe_config else {}),
    }


def _moe_gguf(arch: gguf.MODEL_ARCH) -> Any:
    """A Mixtral as a "llama" with stacked experts, a Qwen3-MoE as "qwen3moe"."""

    def write(model: torch.nn.Module, path: Path, quantize: bool = False) -> Path:
        metadata, tensors = moe_metadata(model.config), moe_gguf_tensors(model)
        return write_gguf(model, path, arch, metadata, quantize=quantize, tensors=tensors)

    return write


# ------------------------------------------------------------------ gpt-oss

GPT_OSS_HEAD_DIM = 64


def gpt_oss_config(vocab: int, truncate: bool = False, **fields: Any) -> Any:
    return tiny_config(
        "GptOssConfig",
        vocab,
        **{
            "intermediate_size": 96,
            "num_hidden_layers": len(LAYER_TYPES),
            "head_dim": GPT_OSS_HEAD_DIM,
            "num_local_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "sliding_window": GEMMA3_WINDOW,
            "layer_types": LAYER_TYPES,  # TINY's 512 positions: YaRN's factor x original
            "swiglu_limit": GPT_OSS_LIMIT,  # small: the random activations reach it
            "initializer_range": 0.2,
            "rope_parameters": YARN | {"truncate": truncate},
        }
        | fields,
    )


def gpt_oss_model(config: Any) -> torch.nn.Module:
    """A random model whose sinks and biases are random and nonzero (init zeroes the
    experts' biases) and whose sinks are large enough to take a share of each softmax."""
    ranges = {("sinks",): ("normal", 0.0, 2.0), ("bias", "_bias"): ("normal", 0.0, 0.5)}
    return _random_params(random_model(config), ranges)


def gpt_oss_gguf_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
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


def gpt_oss_metadata(config: Any) -> GgufMetadata:
    return tiny_gguf_metadata(config) | {
        "expert_feed_forward_length": 96,
        "expert_count": EXPERTS,
        "expert_used_count": TOP_K,
        "attention.key_length": GPT_OSS_HEAD_DIM,
        "attention.value_length": GPT_OSS_HEAD_DIM,
        "attention.sliding_window": GEMMA3_WINDOW,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 128,
        "rope.scaling.yarn_beta_fast": 8.0,
        "rope.scaling.yarn_beta_slow": 1.0,
    }


def gpt_oss_gguf(
    model: torch.nn.Module,
    path: Path,
    quantize: bool = False,
    tensors: Mapping[str, torch.Tensor] | None = None,
    types: Mapping[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """llama.cpp's gpt-oss names; `tensors` (gpt_oss_gguf_tensors' names) in place of the
    model's, `types` the block formats some are stored in (MXFP4 experts)."""
    tensors = gpt_oss_gguf_tensors(model) if tensors is None else tensors
    metadata = gpt_oss_metadata(model.config)
    arch = gguf.MODEL_ARCH.GPT_OSS
    return write_gguf(model, path, arch, metadata, quantize=quantize, tensors=tensors, types=types)


# ------------------------------------------------------------------ the cases

CASES = {
    case.name: case
    for case in (
        Case(
            "qwen3",
            "llama",
            qwen3_config,
            _plain_gguf(gguf.MODEL_ARCH.QWEN3, qwen3_metadata),
            model=lambda config: with_random_head_norms(random_model(config)),
        ),
        Case(
            "mistral", "llama", mistral_config, _plain_gguf(gguf.MODEL_ARCH.LLAMA, mistral_metadata)
        ),
        Case("phi3", "phi3", lambda vocab, **f: phi3_config(vocab, "phi3", **f), phi3_gguf),
        Case("phi4mini", "phi3", lambda vocab, **f: phi3_config(vocab, "phi4mini", **f), phi3_gguf),
        Case(
            "gemma3",
            "gemma3",
            gemma3_config,
            _plain_gguf(gguf.MODEL_ARCH.GEMMA3, gemma3_metadata),
            model=gemma3_model,
            # Scores scaled by head_dim ** -0.5 as llama.cpp scales them (no scalar in a GGUF).
            toy_fields={"query_pre_attn_scalar": GEMMA3_HEAD_DIM},
        ),
        Case("mixtral", "mixtral", mixtral_config, _moe_gguf(gguf.MODEL_ARCH.LLAMA)),
        Case(
            "qwen3_moe",
            "mixtral",
            qwen3_moe_config,
            _moe_gguf(gguf.MODEL_ARCH.QWEN3MOE),
            model=lambda config: with_random_head_norms(random_model(config)),
            # llama.cpp's Qwen3-MoE has no dense layers and always renormalizes.
            toy_fields={"norm_topk_prob": True, "mlp_only_layers": ()},
        ),
        Case(
            "gpt_oss",
            "gpt_oss",
            gpt_oss_config,
            gpt_oss_gguf,
            model=gpt_oss_model,
            # YaRN's correction range truncated, as llama.cpp always computes it; its limit 7.
            toy_fields={"truncate": True, "swiglu_limit": 7.0},
        ),
    )
}
