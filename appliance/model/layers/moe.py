"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen3-MoE): a router picks each
token's top-k experts, and only those experts run, each once a step over the tokens
routed to it (expert_groups), so a decode step reads the routed experts' weights and
no others. The attention, norms and the dense layers Qwen3-MoE keeps are the decoder's
own (model/llama.py).

Weights load under one set of names, `model.layers.L.mlp.gate.weight` (the router) and
`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight` (Qwen3-MoE's own), whatever
the files call them: MoEWeights renames Mixtral's `block_sparse_moe.experts.E.w1/w3/w2`
and cuts stacked 3-D tensors (transformers' fused `experts.gate_up_proj`/`down_proj`, a
GGUF's `ffn_{gate,up,down}_exps`) into one expert at a time. Under tensor parallelism
experts split by column as the MLP does (tensor_parallel.py says why).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from appliance.model import cpu_kernels
from appliance.model.errors import ModelLoadError
from appliance.model.formats.weight_parts import WeightParts
from appliance.model.model_config import ModelConfig
from appliance.model.quant import QuantWeight
from appliance.model.tensor_parallel import Shard, shard_plan


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, experts] -> (weights [tokens, k] float32, experts [tokens, k]):
    the k experts of highest softmax (in float32), their weights renormalized to sum to 1
    where `normalize`, as transformers' Mixtral and Qwen3-MoE routers do."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def expert_groups(
    experts: torch.Tensor, num_experts: int
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """The routed experts [tokens, k] grouped by expert, in expert order, for each expert
    with at least one token: (expert, its tokens' rows, the slot 0..k-1 that chose it).
    The counts are read on the host (one sync a layer on a GPU), which is what lets a
    step run only the experts with tokens; so CUDA graphs do not capture MoE steps."""
    k = experts.shape[1]
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    groups, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            picks = order[start : start + count]
            groups.append((expert, picks // k, picks % k))
        start += count
    return groups


class Expert(nn.Module):
    """One expert: the MLP (gate/up fused, SiLU, down) over this shard's `columns`."""

    def __init__(self, hidden: int, columns: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * columns, bias=False)
        self.down_proj = nn.Linear(columns, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_kernels.silu_takes(gate_up):
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class SparseMoE(nn.Module):
    """A routed-experts block in place of a layer's MLP; as the MLP, under tensor
    parallelism it returns this shard's partial sum (every shard routes alike)."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        columns = len(shard_plan(config, shard).expert_columns)
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(config.hidden_size, columns) for _ in range(config.num_experts)
        )
        self.top_k = config.experts_per_token
        self.normalize = config.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden]: each token's experts' outputs, weighted,
        summed in expert order (as transformers sums them)."""
        weights, chosen = self.route(x)
        out: torch.Tensor | None = None
        for expert, tokens, slots in expert_groups(chosen, len(self.experts)):
            part = self.experts[expert](x[tokens])
            part = part * weights[tokens, slots, None].to(part.dtype)
            if out is None:  # a quantized shard's partial sums are float64
                out = torch.zeros(x.shape[0], part.shape[1], dtype=part.dtype, device=x.device)
            out.index_add_(0, tokens, part)
        assert out is not None  # every token routes to top_k >= 1 experts
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, hidden] -> each token's expert weights and experts (see route())."""
        return route(self.gate(x), self.top_k, self.normalize)


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


def gguf_facts(meta: dict[str, Any], arch: str, names: set[str], path: Path) -> dict[str, Any]:
    """A mixture-of-experts file's routed experts (llama.cpp's Mixtral is a "llama" with
    expert_count; "qwen3moe"): the layers with a router route, the others keep a dense
    MLP. Weights renormalized unless expert_weights_norm says not (llama.cpp always
    renormalizes Mixtral's and Qwen3-MoE's)."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    layers = int(meta[f"{arch}.block_count"])
    used = int(meta.get(f"{arch}.expert_used_count") or 0)
    if not 0 < used <= experts:
        raise ModelLoadError(path, f"{arch}.expert_used_count {used} of {experts} experts")
    width = meta.get(f"{arch}.expert_feed_forward_length") or meta[f"{arch}.feed_forward_length"]
    if any(re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", n) for n in names):
        old = "experts stored one tensor each (an old Mixtral GGUF) are not supported"
        raise ModelLoadError(path, f"{old}; convert it again")
    return {
        "num_experts": experts,
        "experts_per_token": used,
        "expert_intermediate_size": int(width),
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)),
        "dense_layers": tuple(
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names
        ),
    }
