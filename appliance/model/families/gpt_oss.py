"""gpt-oss (config.json model_type "gpt_oss", GptOssForCausalLM; a llama.cpp "gpt-oss"
GGUF): pre-norm layers of layers/ parts, with gpt-oss's choices.

- Attention with biases on q/k/v and o, and a learned sink logit per query head that
  joins each softmax's denominator and adds no value (attention.py runs it on every
  path: attend_with_sinks on the CPU, the Triton kernel on CUDA; the compiled CPU decode
  step, which has no sinks, is refused: decode_step.compiled_problem).
- Layers alternate sliding-window and full attention (`layer_types`).
- YaRN RoPE (layers/rotary.py).
- Every layer's MLP is routed experts (layers/moe.py): a router with a bias, each
  token's top-k router logits softmaxed into its weights; experts with biases and a clamped SwiGLU:
  gate.clamp(max=limit) * sigmoid(alpha * gate) * (up.clamp(-limit, limit) + 1).

Under tensor parallelism heads split as llama's do and each shard keeps its heads'
sinks; experts split by column as layers/moe.py's do. The o and down projections are
row-parallel: their biases are added by the group's first shard alone
(tensor_parallel.shard_state), so the all-reduce adds each once.

Weights: under the names and layouts the decoder loads (GptOssWeights).

The decoder loads, per layer, the router as `mlp.gate.{weight,bias}` and each expert as
`mlp.experts.E.{gate,up,down}_proj.{weight,bias}` in nn.Linear's [out, in] layout. The
files hold them otherwise:

- a Hugging Face folder (transformers' GptOssForCausalLM): `mlp.router.*`, and every
  expert stacked, transposed and gate/up interleaved: `experts.gate_up_proj` [experts,
  hidden, 2 * columns] whose even columns are the gate's and odd ones the up's,
  `experts.gate_up_proj_bias` [experts, 2 * columns] alike, `experts.down_proj`
  [experts, columns, hidden], `experts.down_proj_bias` [experts, hidden];
- a llama.cpp GGUF (gguf_names gives its names): `mlp.gate.*`, and each projection's
  experts stacked apart, de-interleaved and [experts, out, in] already
  (`mlp.experts.{gate,up,down}_proj.{weight,bias}`, ffn_*_exps).

A stacked source is read once for all its experts (a folder's: views of the mapped
file), or from a GGUF an expert's rows at a time. A folder's MXFP4 experts
(`*_blocks`, `*_scales`) are refused: they are not dequantized here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from appliance.model.causal_lm import CausalLM
from appliance.model.errors import ModelLoadError
from appliance.model.families.mixtral import loaded_names, split_quant
from appliance.model.formats.weight_parts import WeightParts
from appliance.model.layers.attention import Attention
from appliance.model.layers.decoder import DecoderLayer
from appliance.model.layers.mlp import ClampedSwiGLU
from appliance.model.layers.moe import SparseMoE
from appliance.model.layers.norms import RMSNorm
from appliance.model.model_config import (
    FULL,
    SLIDING,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    check_rope_scaling,
    check_sliding_window,
    check_top_k,
    eos_ids,
    parse_layer_types,
)
from appliance.model.tensor_parallel import shard_plan

# A GGUF's block-quantized experts are cut as Mixtral's are (families/mixtral.py).
__all__ = ["MODEL", "from_hf", "gguf_facts", "loaded_names", "split_quant", "weights"]
ROPE_TYPES = (*SUPPORTED_ROPE_TYPES, "yarn")


class GptOssForCausalLM(CausalLM):
    """Pre-norm layers: attention with sinks, biases and this layer's window; experts."""

    def build_layer(self, index: int) -> nn.Module:
        config, shard = self.config, self.shard
        hidden, eps = config.hidden_size, config.rms_norm_eps
        attention = Attention(
            config,
            shard,
            qkv_bias=config.attention_bias,
            o_bias=True,
            window=config.layer_window(index),
            sinks=True,
        )
        limit = config.swiglu_limit if config.swiglu_limit is not None else 7.0
        experts = SparseMoE(
            hidden,
            config.num_experts,
            config.experts_per_token,
            len(shard_plan(config, shard).expert_columns),
            softmax_after_top_k=True,
            bias=True,
            activation=ClampedSwiGLU(limit, config.swiglu_alpha),
        )
        norms = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        return DecoderLayer(attention, experts, *norms, self.all_reduce)


MODEL = GptOssForCausalLM


def weights(weights: Mapping[str, torch.Tensor], config: ModelConfig) -> Mapping[str, torch.Tensor]:
    """The files' weights under the names and layouts the decoder loads (GptOssWeights)."""
    return GptOssWeights(weights, config)


ROPE_TYPES = (*SUPPORTED_ROPE_TYPES, "yarn")


def from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """A `gpt_oss` config (GptOssForCausalLM) as a ModelConfig; transformers' GptOssConfig
    defaults stand in for keys a config leaves out."""
    _refuse_unsupported(cfg, source)
    num_layers = cfg.get("num_hidden_layers", 36)
    num_heads = cfg.get("num_attention_heads", 64)
    experts = cfg.get("num_local_experts", cfg.get("num_experts", 128))
    top_k = cfg.get("num_experts_per_tok", 4)
    check_top_k(top_k, experts, source, routed=True)
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
        eos_token_ids=eos_ids(eos),
        sliding_window=check_sliding_window(cfg.get("sliding_window", 128), source),
        layer_types=parse_layer_types(cfg.get("layer_types"), num_layers, 2, source),
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


def gguf_facts(
    config: ModelConfig, meta: dict[str, Any], reader: object, path: Path | str
) -> ModelConfig:
    """A "gpt-oss" GGUF's facts as llama.cpp reads them (llama-model.cpp): layers
    alternate sliding and full from the first, sliding (its swa pattern of 2); YaRN from
    rope.scaling.* with beta_fast 32 and beta_slow 1 unless the file says others, and its
    correction range truncated to whole dimensions, as ggml_rope_yarn_corr_dims always
    does; the clamped SwiGLU's limit 7 (llama.cpp's own constant)."""
    source = str(path)
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


_EXPERTS = r"model\.layers\.(\d+)\.mlp\.experts\."
# A folder's stacked tensors -> (the projection, its kind, which of the interleaved
# columns it takes: 0 the gate's, 1 the up's; None all), transposed where a weight.
_FOLDER = {
    "gate_up_proj": (("gate_proj", "weight", 0), ("up_proj", "weight", 1)),
    "gate_up_proj_bias": (("gate_proj", "bias", 0), ("up_proj", "bias", 1)),
    "down_proj": (("down_proj", "weight", None),),
    "down_proj_bias": (("down_proj", "bias", None),),
}

# name in the files, expert, interleaved columns (0, 1 or None), transposed
Source = tuple[str, int | None, int | None, bool]


def _sources(names: Iterable[str], config: ModelConfig, where: str) -> dict[str, Source]:
    """Each name the decoder loads -> where it lies in the files."""
    out: dict[str, Source] = {}
    for name in names:
        folder = re.fullmatch(_EXPERTS + r"(\w+?)", name)
        stacked = re.fullmatch(_EXPERTS + r"(gate|up|down)_proj\.(weight|bias)", name)
        if name.endswith(("_blocks", "_scales")):
            raise ModelLoadError(
                where,
                f"{name} is an MXFP4-quantized expert tensor, which is not read from a "
                "folder: serve a GGUF of the model, or a folder saved dequantized",
            )
        if stacked:
            layer, part, kind = stacked.groups()
            for expert in range(config.num_experts):
                out[_name(layer, expert, f"{part}_proj", kind)] = (name, expert, None, False)
        elif folder and folder.group(2) in _FOLDER:
            layer, fused = folder.groups()
            for expert in range(config.num_experts):
                for part, kind, half in _FOLDER[fused]:
                    transposed = kind == "weight"
                    out[_name(layer, expert, part, kind)] = (name, expert, half, transposed)
        else:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = (name, None, None, False)
    return out


def _name(layer: str, expert: int, part: str, kind: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{part}.{kind}"


class GptOssWeights(WeightParts):
    """A gpt-oss model's weights (a folder's or a GGUF's, read on demand) under the names
    and layouts the decoder loads: one expert's part of a stacked tensor at a time."""

    def __init__(self, weights: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
        where = str(getattr(weights, "path", "gpt-oss weights"))
        super().__init__(weights, _sources(weights, config, where))

    def __getitem__(self, name: str) -> torch.Tensor:
        source, expert, half, transposed = self._parts[name]
        if expert is None:
            return self._weights[source]
        tensor = self._expert(source, expert)  # [in, 2 * columns] or [out, in], or 1-D
        if half is not None:
            tensor = tensor[..., half::2]  # the gate's columns (even) or the up's (odd)
        return tensor.transpose(0, 1) if transposed else tensor

    def _expert(self, source: str, expert: int) -> torch.Tensor:
        """One expert's slice of a stacked tensor: from a GGUF its rows alone are read."""
        read_rows = getattr(self._weights, "rows", None)
        if read_rows is None:
            return self.held(source)[expert]
        shape = self._weights.shape(source)  # type: ignore[attr-defined]
        per = math.prod(shape[1:-1])  # rows of one expert in the [rows, last] layout
        return read_rows(source, expert * per, (expert + 1) * per).view(shape[1:])
