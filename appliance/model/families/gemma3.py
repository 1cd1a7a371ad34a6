"""Gemma 3 text (config.json model_type "gemma3_text", Gemma3ForCausalLM; GGUF "gemma3").
Its decoder, from layers/, differs from llama's so:

- RMSNorm scales by (1 + weight), computed in float32 and cast back (Gemma3RMSNorm);
  four norms a layer: before and after attention, before and after the MLP, each
  output normed before it joins the residual stream (SandwichDecoderLayer).
- q_norm and k_norm over each head, the same (1 + weight) norm.
- A GeGLU MLP: gelu (tanh approximation) of the gate times up.
- Embeddings scaled by sqrt(hidden_size) in the model's dtype.
- Attention scores scaled by query_pre_attn_scalar ** -0.5.
- Sliding layers attend within the window with RoPE base local_rope_theta, unscaled;
  full layers see the whole context with rope_theta and its scaling.
- Logits capped by final_logit_softcapping where the config has it.

The compiled whole-step decode (decode_step.py) runs Llama's layers only: a Gemma model
always runs these Python layers (compiled_problem refuses it). What this server does not
run of a config is refused, one line each, never ignored. A GGUF stores the norm weights
as 1 + weight (formats/gguf_file.py takes the 1 off).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from appliance.model.causal_lm import CausalLM
from appliance.model.errors import ModelLoadError
from appliance.model.layers.attention import Attention
from appliance.model.layers.decoder import SandwichDecoderLayer
from appliance.model.layers.mlp import MLP, gelu_tanh_and_mul
from appliance.model.layers.norms import OffsetHeadNorm, OffsetRMSNorm
from appliance.model.layers.rotary import RotaryEmbedding
from appliance.model.model_config import (
    FULL,
    SLIDING,
    ModelConfig,
    check_rope_scaling,
    check_sliding_window,
    eos_ids,
    parse_layer_types,
)
from appliance.model.tensor_parallel import shard_plan


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's layers, embedding scale, two RoPE tables and logit cap."""

    def build_layer(self, index: int) -> nn.Module:
        config, shard = self.config, self.shard
        hidden, eps = config.hidden_size, config.rms_norm_eps
        window = config.layer_window(index)
        attention = Attention(
            config,
            shard,
            qkv_bias=config.attention_bias,
            head_norm=OffsetHeadNorm,
            scale=(config.query_pre_attn_scalar or config.head_dim) ** -0.5,
            window=window,
        )
        columns = len(shard_plan(config, shard).mlp_columns)
        mlp = MLP(hidden, columns, activation=gelu_tanh_and_mul)
        norms = (
            OffsetRMSNorm(hidden, eps),
            OffsetRMSNorm(hidden, eps),
            OffsetRMSNorm(hidden, eps),
            OffsetRMSNorm(hidden, eps),
        )
        return SandwichDecoderLayer(
            attention, mlp, norms, self.all_reduce, local_rope=window is not None
        )

    def build_norm(self) -> OffsetRMSNorm:
        return OffsetRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the model's dtype first, as transformers does.
        scale = torch.tensor(self.config.hidden_size**0.5).to(embedded.dtype)
        return embedded * scale

    def build_local_rope(self) -> RotaryEmbedding | None:
        """The sliding layers' RoPE table: their base, no scaling."""
        local = dataclasses.replace(
            self.config,
            rope_theta=self.config.local_rope_theta or self.config.rope_theta,
            rope_scaling=None,
        )
        return RotaryEmbedding(local, self.max_positions, self.dtype, self.device)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> float32 [rows, vocab], capped where the config says."""
        logits = super().logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap).mul_(cap)


MODEL = Gemma3ForCausalLM


def from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
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
        eos_token_ids=eos_ids(eos),
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
    period = cfg.get("sliding_window_pattern", 6)
    return parse_layer_types(cfg.get("layer_types"), num_layers, period, source)


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


def gguf_facts(
    config: ModelConfig, meta: dict[str, Any], reader: object, path: Path | str
) -> ModelConfig:
    """A gemma3 GGUF's facts as llama.cpp reads them (llama-model.cpp), over `config`
    (what every GGUF says, its window included): with a window, every sixth layer full
    and the rest sliding (or as `attention.sliding_window_pattern` says: a period, or a
    flag a layer, true for sliding), sliding layers' RoPE base 10000 (or
    `rope.freq_base_swa`); scores scaled by head_dim ** -0.5, but by (hidden / heads) **
    -0.5 in the 62-layer 27B model, whose query_pre_attn_scalar the file does not carry."""
    source = str(path)
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
