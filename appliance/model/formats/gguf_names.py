"""A GGUF's tensor names as Hugging Face names them, and the Q/K row order llama.cpp
gives a llama file's projections undone (so every format loads into one model layout)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from appliance.model.errors import ModelLoadError
from appliance.model.model_config import ModelConfig

LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3's fused q/k/v
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's per-head norms
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Routed experts (layers/moe.py): the router, each projection's experts stacked.
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}
# phi3's ffn_up holds gate and up, as Phi-3's own gate_up_proj does.
PHI3_NAMES = LAYER_NAMES | {"ffn_up.weight": "mlp.gate_up_proj.weight"}
# Gemma 3's four norms a layer: llama.cpp's ffn_norm is its pre-feedforward norm there.
GEMMA3_NAMES = LAYER_NAMES | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# gpt-oss (families/gpt_oss.py): biases on o, the router and each projection's stacked
# experts, a sink logit per head, and the norm before the experts as llama.cpp names it.
GPT_OSS_NAMES = LAYER_NAMES | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp.bias": "mlp.gate.bias",
    "ffn_gate_exps.bias": "mlp.experts.gate_proj.bias",
    "ffn_up_exps.bias": "mlp.experts.up_proj.bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj.bias",
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
    "rope_factors_long.weight": "rope_factors_long",  # Phi-3's LongRoPE (read as facts)
    "rope_factors_short.weight": "rope_factors_short",
}


def hf_name(gguf_name: str, path: Path, architecture: str = "llama") -> str:
    """A tensor's Hugging Face name (`architecture`: the ModelConfig's); a phi3 file's
    ffn_up holds gate and up (gate_up_proj)."""
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    names = {"gemma3": GEMMA3_NAMES, "gpt_oss": GPT_OSS_NAMES, "phi3": PHI3_NAMES}.get(
        architecture, LAYER_NAMES
    )
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    raise ModelLoadError(path, f"unexpected tensor {gguf_name!r}")


def rope_heads(name: str, config: ModelConfig) -> int:
    """The heads of a llama Q or K projection (whose rows llama.cpp reorders), else 0."""
    if config.architecture != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return 0
    return config.num_heads if "q_proj" in name else config.num_kv_heads


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the row order llama.cpp gives Q/K projections for its interleaved RoPE.

    GGUF stores each head's rows as (pair, 2) interleaved; Hugging Face's rotate-half
    RoPE wants the two halves of the head contiguous.
    """
    rows = weight.shape[0]
    # [heads, half, 2, in] -> [heads, 2, half, in]
    shaped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)
