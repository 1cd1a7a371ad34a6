"""Gemma 3 text's architecture facts, read from a Hugging Face config.json (transformers
4 or 5 layout). What this server does not run is refused, one line each, never ignored."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from appliance.model.errors import ModelLoadError
from appliance.model.model_config import ModelConfig, check_rope_scaling, check_sliding_window

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma3_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """A `gemma3_text` config (Gemma3ForCausalLM) as a ModelConfig; transformers'
    Gemma3TextConfig defaults stand in for keys a config leaves out."""
    _refuse_unsupported(cfg, source)
    num_heads = cfg.get("num_attention_heads", 8)
    num_layers = cfg.get("num_hidden_layers", 26)
    global_rope, local_rope = _rope(cfg, source)
    eos = cfg.get("eos_token_id", 1)
    window = check_sliding_window(cfg.get("sliding_window", 4096), source)
    return ModelConfig(
        architecture="gemma3",
        vocab_size=cfg.get("vocab_size", 262_208),
        hidden_size=cfg.get("hidden_size", 2304),
        intermediate_size=cfg.get("intermediate_size", 9216),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or 256,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(global_rope.get("rope_theta", 1_000_000.0)),
        max_position_embeddings=cfg.get("max_position_embeddings", 131_072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_scaling=check_rope_scaling(global_rope, source),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        qk_norm=True,
        sliding_window=window,
        layer_types=_layer_types(cfg, num_layers, source) if window is not None else (),
        local_rope_theta=float(local_rope.get("rope_theta", 10_000.0)),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=_positive(cfg.get("final_logit_softcapping"), source),
    )


def _refuse_unsupported(cfg: dict[str, Any], source: str) -> None:
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(
            source, "attn_logit_softcapping (attention score capping) is not supported"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(source, "use_bidirectional_attention is not supported")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(
            source, f"hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)"
        )


def _layer_types(cfg: dict[str, Any], num_layers: int, source: str) -> tuple[str, ...]:
    """Each layer's kind: `layer_types`, or (older configs) every `sliding_window_pattern`th
    layer full, the rest sliding, as transformers derives them."""
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ModelLoadError(
            source, f"layer_types must name {num_layers} layers {SLIDING!r} or {FULL!r}"
        )
    return tuple(types)


def _rope(cfg: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The global (full-attention) and local (sliding) layers' RoPE parameters, each a
    dict with rope_theta and any scaling. transformers 5 nests them per layer kind in
    rope_parameters; 4 has rope_theta, rope_scaling and rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        global_rope = dict(params.get(FULL) or {})
        local_rope = dict(params.get(SLIDING) or {})
    else:
        global_rope = dict(cfg.get("rope_scaling") or {})
        global_rope.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local_rope = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    kind = local_rope.get("rope_type") or local_rope.get("type") or "default"
    if kind != "default":
        raise ModelLoadError(source, f"RoPE scaling {kind!r} on sliding layers is not supported")
    return global_rope, local_rope


def _positive(value: Any, source: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ModelLoadError(source, f"final_logit_softcapping must be positive, got {value!r}")
    return float(value)


def gemma3_gguf_facts(config: ModelConfig, meta: dict[str, Any], source: str) -> ModelConfig:
    """A gemma3 GGUF's facts as llama.cpp reads them (llama-model.cpp), over `config`
    (what every GGUF says, its window included): with a window, every sixth layer full
    and the rest sliding (or as `attention.sliding_window_pattern` says: a period, or a
    flag a layer, true for sliding), sliding layers' RoPE base 10000 (or
    `rope.freq_base_swa`); scores scaled by head_dim ** -0.5, but by (hidden / heads) **
    -0.5 in the 62-layer 27B model, whose query_pre_attn_scalar the file does not carry."""
    if meta.get("gemma3.attn_logit_softcapping"):
        raise ModelLoadError(
            source, "attn_logit_softcapping (attention score capping) is not supported"
        )
    types: tuple[str, ...] = ()
    if config.sliding_window is not None:
        pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            types = tuple(SLIDING if flag else FULL for flag in pattern)
        else:
            cfg = {"sliding_window_pattern": int(pattern)}
            types = tuple(_layer_types(cfg, config.num_layers, source))
        if len(types) != config.num_layers:
            raise ModelLoadError(
                source, "gemma3.attention.sliding_window_pattern has the wrong length"
            )
    scalar = config.head_dim
    if config.num_layers == 62:
        scalar = config.hidden_size // config.num_heads
    cap = meta.get("gemma3.final_logit_softcapping")
    return replace(
        config,
        architecture="gemma3",
        qk_norm=True,
        layer_types=types,
        local_rope_theta=float(meta.get("gemma3.rope.freq_base_swa", 10_000.0))
        if types
        else config.rope_theta,
        query_pre_attn_scalar=float(scalar),
        final_logit_softcapping=float(cap) if cap else None,
    )
