"""Mixtral-style mixtures of experts: Mixtral (config.json model_type "mixtral"; a
llama.cpp "llama" or "mixtral" GGUF with expert_count) and Qwen3-MoE ("qwen3_moe", GGUF
"qwen3moe"). Llama's layers (Qwen3's head norms for Qwen3-MoE) with routed experts in
place of the MLP (layers/moe.py): each token's top-k experts of highest router softmax,
renormalized where norm_topk_prob; Qwen3-MoE's mlp_only_layers and decoder_sparse_step
keep a dense MLP.

Weights load under one set of names, `model.layers.L.mlp.gate.weight` (the router) and
`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight` (Qwen3-MoE's own), whatever
the files call them: MoEWeights renames Mixtral's `block_sparse_moe.experts.E.w1/w3/w2`
and cuts stacked 3-D tensors (transformers' fused `experts.gate_up_proj`/`down_proj`, a
GGUF's `ffn_{gate,up,down}_exps`) into one expert at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from appliance.model.causal_lm import CausalLM
from appliance.model.families import llama
from appliance.model.formats.weight_parts import WeightParts
from appliance.model.layers.moe import SparseMoE
from appliance.model.model_config import ModelConfig, check_top_k
from appliance.model.quant import QuantWeight
from appliance.model.tensor_parallel import shard_plan

# config.json model_type -> the layout its attention runs as.
LAYOUTS = {"mixtral": "llama", "qwen3_moe": "qwen3"}


def from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """A Mixtral or Qwen3-MoE config.json: llama's facts and the routed experts."""
    arch = cfg["model_type"]
    return llama.hf_config(cfg, source, LAYOUTS[arch], **_experts(cfg, arch, source))


def _experts(cfg: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    layers = cfg["num_hidden_layers"]
    if arch == "mixtral":
        dense: tuple[int, ...] = ()
        experts, size, norm = cfg["num_local_experts"], cfg["intermediate_size"], True
    else:
        # Published configs say num_experts; transformers 5 writes num_local_experts.
        experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
        size = cfg["moe_intermediate_size"]
        norm = bool(cfg.get("norm_topk_prob", False))
        step, only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(layers) if i in only or experts == 0 or (i + 1) % step)
    top_k = cfg["num_experts_per_tok"]
    check_top_k(top_k, experts, source)
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "expert_intermediate_size": size,
        "norm_topk_prob": norm,
        "dense_layers": dense,
    }


class MixtralForCausalLM(CausalLM):
    """Llama's layers, routed experts in place of the MLP where config.sparse_layer()."""

    def build_layer(self, index: int) -> nn.Module:
        config, shard = self.config, self.shard
        if config.sparse_layer(index):
            feed_forward: nn.Module = SparseMoE(
                config.hidden_size,
                config.num_experts,
                config.experts_per_token,
                len(shard_plan(config, shard).expert_columns),
                normalize=config.norm_topk_prob,
            )
        else:
            feed_forward = llama.mlp(config, shard)
        return llama.decoder_layer(config, shard, self.all_reduce, feed_forward)


MODEL = MixtralForCausalLM


def weights(weights: Mapping[str, torch.Tensor], config: ModelConfig) -> Mapping[str, torch.Tensor]:
    """The files' weights under the names the decoder loads (MoEWeights)."""
    return MoEWeights(weights, config)


_PART = r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\."
# Per-expert names a file may use -> ours; Mixtral's w1 (gate), w3 (up), w2 (down).
_RENAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Stacked [experts, rows, in] tensors -> the projections they hold, in row order.
_STACKED = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "gate_proj": ("gate_proj",),
    "up_proj": ("up_proj",),
    "down_proj": ("down_proj",),
}

_STACKED_NAME = _PART + rf"({'|'.join(_STACKED)})(?:\.weight)?"

Source = tuple[str, int | None, slice | None]  # name in the files, expert, rows


def _sources(names: Iterable[str], config: ModelConfig) -> dict[str, Source]:
    """Each name the decoder loads -> where it lies in the files."""
    out: dict[str, Source] = {}
    width = config.expert_intermediate_size
    for name in names:
        single = re.fullmatch(_PART + r"(\d+)\.(w[123]|\w+_proj)\.weight", name)
        stacked = re.fullmatch(_STACKED_NAME, name)
        if single:
            layer, expert, part = single.groups()
            out[_name(layer, expert, _RENAMES.get(part, part))] = (name, None, None)
        elif stacked:
            layer, fused = stacked.groups()
            parts = _STACKED[fused]
            for expert in range(config.num_experts):
                for index, part in enumerate(parts):
                    rows = slice(index * width, (index + 1) * width) if len(parts) > 1 else None
                    out[_name(layer, str(expert), part)] = (name, expert, rows)
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = (name, None, None)
    return out


def _name(layer: str, expert: str, part: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight"


class MoEWeights(WeightParts):
    """A mixture-of-experts model's weights under the names the decoder loads. A stacked
    source is read an expert at a time from a GGUF (GGUFWeights.rows), else viewed
    (mapped files) and kept until its last expert's part is released."""

    def __init__(self, weights: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
        super().__init__(weights, _sources(weights, config))

    def __getitem__(self, name: str) -> torch.Tensor:
        source, expert, rows = self._parts[name]
        if expert is None:
            return self._weights[source]
        read_rows = getattr(self._weights, "rows", None)
        if read_rows is not None:  # a GGUF read from the file: this expert's rows alone
            per = self._weights.shape(source)[1]  # type: ignore[attr-defined]
            tensor = read_rows(source, expert * per, (expert + 1) * per)
        else:
            tensor = self.held(source)[expert]
        return tensor if rows is None else tensor[rows]


def loaded_names(names: Iterable[str], config: ModelConfig) -> list[str]:
    """The names the decoder loads, for a mixture-of-experts model's `names`."""
    return list(_sources(names, config))


def split_quant(quant: dict[str, QuantWeight], config: ModelConfig) -> dict[str, QuantWeight]:
    """A GGUF's block-quantized weights under the names the decoder loads: a stacked
    expert tensor (its rows expert after expert) cut into each expert's rows."""
    out = {}
    for name, (source, expert, rows) in _sources(quant, config).items():
        weight = quant[source]
        if expert is not None:
            per = weight.rows // config.num_experts
            weight = weight.row_slice(slice(expert * per, (expert + 1) * per))
            if rows is not None:
                weight = weight.row_slice(rows)
        out[name] = weight
    return out
