"""Llama and the families shaped like it: Llama 2/3 (config.json model_type and GGUF
architecture "llama"), Mistral ("mistral": every layer within a sliding window), Qwen2
("qwen2": biases on q/k/v) and Qwen3 ("qwen3": an RMSNorm over each head of q and k).

Each layer: RMSNorm, attention, RMSNorm, a SiLU-gated MLP (layers/). The weights load
under Hugging Face's names as the files hold them; a GGUF's are renamed by
formats/gguf_names.py's table, its llama Q/K rows unpermuted there. The builder functions
here (attention, mlp, decoder_layer, hf_config) are what the other llama-shaped families
(phi3.py, mixtral.py) call for their own parts.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from appliance.model.causal_lm import CausalLM
from appliance.model.errors import ModelLoadError
from appliance.model.layers.attention import Attention
from appliance.model.layers.decoder import DecoderLayer
from appliance.model.layers.mlp import MLP
from appliance.model.layers.norms import HeadNorm, RMSNorm
from appliance.model.model_config import (
    ModelConfig,
    check_longrope,
    check_rope_scaling,
    check_sliding_window,
    eos_ids,
)
from appliance.model.tensor_parallel import AllReduce, Shard, shard_plan

# config.json model_type -> the layout it runs as (ModelConfig.architecture).
LAYOUTS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """A llama, mistral, qwen2 or qwen3 config.json (transformers 4 or 5 layout)."""
    return hf_config(cfg, source, LAYOUTS[cfg["model_type"]])


def hf_config(
    cfg: dict[str, Any], source: str, layout: str, *, partial_rotary: bool = False, **extra: Any
) -> ModelConfig:
    """The facts every llama-shaped config.json gives, for `layout` ("llama", "qwen2",
    "qwen3" or "phi3"), with a family's `extra` fields (its experts). A partial RoPE is
    refused unless `partial_rotary` (Phi-3's, whose weights are reordered for it)."""
    num_heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    rope_scaling = check_rope_scaling(scaling, source)
    if rope_scaling and rope_scaling["rope_type"] == "longrope":
        # Phi-3 keeps LongRoPE's pretraining length beside the scaling, not in it.
        original = cfg.get("original_max_position_embeddings")
        rope_scaling.setdefault("original_max_position_embeddings", original)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    config = ModelConfig(
        architecture=layout,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=layout == "qwen2" or bool(cfg.get("attention_bias", False)),
        rope_scaling=rope_scaling,
        eos_token_ids=eos_ids(cfg.get("eos_token_id")),
        qk_norm=layout == "qwen3",
        sliding_window=_sliding_window(cfg, layout, source),
        rotary_dim=_rotary_dim(cfg, rope, head_dim, source, partial_rotary),
        **extra,
    )
    check_longrope(config, source)
    return config


def _rotary_dim(
    cfg: dict[str, Any], rope: dict[str, Any], head_dim: int, source: str, allowed: bool
) -> int | None:
    """The dimensions of each head RoPE turns, from partial_rotary_factor (top level, or
    in transformers 5's rope_parameters), as transformers computes them; None for all.
    Phi-3's layout alone is run partially (families/phi3.py): elsewhere it is refused."""
    factor = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if factor is None or float(factor) == 1.0:
        return None
    dim = int(head_dim * float(factor))
    if not allowed:
        raise ModelLoadError(
            source, f"partial_rotary_factor {factor} is supported for phi3 models only"
        )
    if not 0 < dim < head_dim or dim % 2 or head_dim % 2:
        raise ModelLoadError(
            source,
            f"partial_rotary_factor {factor} gives {dim} of {head_dim} head dimensions: "
            "an even number between 0 and the head size is needed",
        )
    return dim


def _sliding_window(cfg: dict[str, Any], layout: str, source: str) -> int | None:
    """The window every layer attends within, or None. Mistral windows every layer; Qwen
    configs carry a `sliding_window` that only counts with `use_sliding_window`, and then
    for some layers only, which this server does not run: refused, never ignored."""
    window = cfg.get("sliding_window")
    if layout in ("qwen2", "qwen3"):
        sliding = [t for t in cfg.get("layer_types") or () if t != "full_attention"]
        if cfg.get("use_sliding_window") or sliding:
            raise ModelLoadError(
                source,
                "use_sliding_window (sliding-window layers in a Qwen model) is not supported",
            )
        return None
    return check_sliding_window(window, source)


def attention(config: ModelConfig, shard: Shard) -> Attention:
    """Llama's attention: q/k/v biases where the config has them (Qwen2), Qwen3's head
    norms, the config's window (Mistral) for every layer."""
    return Attention(
        config,
        shard,
        qkv_bias=config.attention_bias,
        head_norm=HeadNorm if config.qk_norm else None,
        window=config.sliding_window,
    )


def mlp(config: ModelConfig, shard: Shard) -> MLP:
    """The SiLU-gated MLP over this shard's intermediate columns."""
    return MLP(config.hidden_size, len(shard_plan(config, shard).mlp_columns))


def decoder_layer(
    config: ModelConfig, shard: Shard, all_reduce: AllReduce, feed_forward: nn.Module
) -> DecoderLayer:
    """A pre-norm layer of llama's attention and `feed_forward` (an MLP or experts)."""
    hidden, eps = config.hidden_size, config.rms_norm_eps
    return DecoderLayer(
        attention(config, shard),
        feed_forward,
        RMSNorm(hidden, eps),
        RMSNorm(hidden, eps),
        all_reduce,
    )


class LlamaForCausalLM(CausalLM):
    """Llama's decoder (Mistral, Qwen2, Qwen3, and Phi-3 once its weights are cut apart)."""

    def build_layer(self, index: int) -> nn.Module:
        return decoder_layer(self.config, self.shard, self.all_reduce, mlp(self.config, self.shard))


MODEL = LlamaForCausalLM
