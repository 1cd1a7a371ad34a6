"""gpt-oss's architecture facts, read from a Hugging Face config.json (model_type
"gpt_oss", transformers 4 or 5 layout) or a llama.cpp "gpt-oss" GGUF. What this server
does not run is refused, one line each, never ignored."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from appliance.model.errors import ModelLoadError
from appliance.model.model_config import (
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    check_rope_scaling,
    check_sliding_window,
)

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE_TYPES = (*SUPPORTED_ROPE_TYPES, "yarn")


def gpt_oss_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """A `gpt_oss` config (GptOssForCausalLM) as a ModelConfig; transformers' GptOssConfig
    defaults stand in for keys a config leaves out."""
    _refuse_unsupported(cfg, source)
    num_layers = cfg.get("num_hidden_layers", 36)
    num_heads = cfg.get("num_attention_heads", 64)
    experts = cfg.get("num_local_experts", cfg.get("num_experts", 128))
    top_k = cfg.get("num_experts_per_tok", 4)
    if not 0 < top_k <= experts:
        raise ModelLoadError(source, f"num_experts_per_tok {top_k} of {experts} experts")
    rope, theta = _rope(cfg)
    scaling = check_rope_scaling(rope, source, ROPE_TYPES)
    if scaling and scaling["rope_type"] == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if not scaling.get(key):
                raise ModelLoadError(source, f"yarn RoPE scaling needs {key}")
    eos = cfg.get("eos_token_id")
    width = cfg.get("intermediate_size", 2880)
    return ModelConfig(
        architecture="gpt_oss",
        vocab_size=cfg.get("vocab_size", 201_088),
        hidden_size=cfg.get("hidden_size", 2880),
        intermediate_size=width,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or 64,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 131_072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", True)),
        rope_scaling=scaling,
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        sliding_window=check_sliding_window(cfg.get("sliding_window", 128), source),
        layer_types=_layer_types(cfg.get("layer_types"), num_layers, source),
        attention_sinks=True,
        num_experts=experts,
        experts_per_token=top_k,
        expert_intermediate_size=width,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )


def _refuse_unsupported(cfg: dict[str, Any], source: str) -> None:
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ModelLoadError(
            source,
            f"quantization_config {method!r}: a folder's quantized experts (MXFP4 _blocks/"
            "_scales) are not read; serve a GGUF of it, or a folder saved dequantized",
        )
    if not cfg.get("attention_bias", True):
        raise ModelLoadError(source, "attention_bias false is not supported for gpt_oss")


def _layer_types(types: Any, num_layers: int, source: str) -> tuple[str, ...]:
    """Each layer's kind: `layer_types`, else (as transformers derives them) even layers
    sliding, odd ones full."""
    if types is None:
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ModelLoadError(
            source, f"layer_types must name {num_layers} layers {SLIDING!r} or {FULL!r}"
        )
    return tuple(types)


def _rope(cfg: dict[str, Any]) -> tuple[dict[str, Any] | None, float]:
    """The RoPE scaling (transformers 5's rope_parameters, or 4's rope_scaling) and base,
    GptOssConfig's YaRN (factor 32 over 4096, no truncation) where a config says none."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 150_000.0)
    if not (params.get("rope_type") or params.get("type")):
        params = {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        }
    return params, theta


def gpt_oss_gguf_facts(config: ModelConfig, meta: dict[str, Any], source: str) -> ModelConfig:
    """A "gpt-oss" GGUF's facts as llama.cpp reads them (llama-model.cpp): layers
    alternate sliding and full from the first, sliding (its swa pattern of 2); YaRN from
    rope.scaling.* with beta_fast 32 and beta_slow 1 unless the file says others, and its
    correction range truncated to whole dimensions, as ggml_rope_yarn_corr_dims always
    does; the clamped SwiGLU's limit 7 (llama.cpp's own constant)."""
    kind = meta.get("gpt-oss.rope.scaling.type")
    scaling: dict[str, Any] | None = None
    if kind == "yarn":
        original = meta.get("gpt-oss.rope.scaling.original_context_length")
        if not original:
            raise ModelLoadError(source, "yarn scaling needs rope.scaling.original_context_length")
        scaling = {
            "rope_type": "yarn",
            "factor": float(meta.get("gpt-oss.rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(original),
            "beta_fast": float(meta.get("gpt-oss.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get("gpt-oss.rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": True,
        }
    elif kind not in (None, "none"):
        raise ModelLoadError(source, f"unsupported RoPE scaling {kind!r} for gpt-oss (yarn)")
    types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(config.num_layers))
    return replace(
        config,
        architecture="gpt_oss",
        attention_bias=True,
        rope_scaling=scaling,
        layer_types=types if config.sliding_window is not None else (),
        attention_sinks=True,
        swiglu_limit=7.0,
        norm_topk_prob=True,
        dense_layers=(),
    )
