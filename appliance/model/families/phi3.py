"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini (config.json model_type and GGUF architecture
"phi3"): llama's decoder (families/llama.py builds it), their weights under the names and
row orders it loads, and the facts a config.json and a GGUF keep of them.

Phi-3 fuses q/k/v (`qkv_proj`, rows [q; k; v]; a GGUF's `attn_qkv`) and gate/up
(`gate_up_proj`, rows [gate; up]; a GGUF's `ffn_up`, which holds both). They are cut here
into the q/k/v and gate/up projections the other families bring, which the decoder
copies straight into its own fused rows; so its tensor-parallel split (q/k/v by head,
gate/up by column), the quantized path and the compiled decode step take Phi-3 unchanged.

Partial RoPE (Phi-4-mini turns the first 3/4 of each head, pairing dimension i with
i + rotary_dim / 2): each head's Q and K rows are reordered at load so that the turned
dimensions pair as a whole head's do (i with i + head_dim / 2), the unturned ones in the
pairs left over, which the RoPE tables leave as they are (cos 1, sin 0: layers/rotary.py).
Q and K move alike, so every q.k (and the attention) is unchanged; V and the output
projection keep their order. The KV cache holds keys in that order, the same in every
worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader

from appliance.model.families import llama
from appliance.model.formats.gguf_file import dequantize_tensor
from appliance.model.formats.weight_parts import WeightParts
from appliance.model.model_config import ModelConfig, check_longrope
from appliance.model.quant import QuantWeight

# The decoder is llama's: the weights are cut to its layout.
MODEL = llama.LlamaForCausalLM


def from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """A phi3 config.json: llama's facts, a partial RoPE allowed (reordered at load)."""
    return llama.hf_config(cfg, source, "phi3", partial_rotary=True)


def weights(weights: Mapping[str, torch.Tensor], config: ModelConfig) -> Mapping[str, torch.Tensor]:
    """The files' weights under the names and row orders the decoder loads (Phi3Weights)."""
    return Phi3Weights(weights, config)


# Our fused sources and the projections they hold, in row order.
_FUSED = {
    ".self_attn.qkv_proj.": ("q_proj", "k_proj", "v_proj"),
    ".mlp.gate_up_proj.": ("gate_proj", "up_proj"),
}
# A GGUF's LongRoPE factors, under the names gguf_file gives them; the facts carry them.
ROPE_FACTOR_NAMES = ("rope_factors_long", "rope_factors_short")


def _part_rows(config: ModelConfig) -> dict[str, slice]:
    """Each projection's rows in its fused source."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    ff = config.intermediate_size
    return {
        "q_proj": slice(0, q),
        "k_proj": slice(q, q + kv),
        "v_proj": slice(q + kv, q + 2 * kv),
        "gate_proj": slice(0, ff),
        "up_proj": slice(ff, 2 * ff),
    }


def _sources(names: Iterable[str], config: ModelConfig) -> dict[str, tuple[str, slice | None]]:
    """Each name the decoder loads -> (the source's name, its rows there; None: all)."""
    rows = _part_rows(config)
    out: dict[str, tuple[str, slice | None]] = {}
    for name in names:
        if name in ROPE_FACTOR_NAMES:
            continue
        fused = next((key for key in _FUSED if key in name), None)
        if fused is None:
            out[name] = (name, None)
            continue
        head, _, tail = name.partition(fused)
        module = fused.strip(".").rpartition(".")[0]  # "self_attn" or "mlp"
        for part in _FUSED[fused]:
            out[f"{head}.{module}.{part}.{tail}"] = (name, rows[part])
    return out


def loaded_names(names: Iterable[str], config: ModelConfig) -> list[str]:
    """The names the decoder loads, for a Phi-3 model's `names`."""
    return list(_sources(names, config))


def rotary_row_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """For each row of a reordered head, the row of the original head it takes: the
    turned halves a = [0, r/2), b = [r/2, r) and the rest p = [r, d) go to [a, p1, b, p2]
    (p1, p2 the halves of p), so a[i] pairs with b[i] across the head's halves."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    order = [*range(half), *range(rotary_dim, rotary_dim + rest)]
    order += [*range(half, rotary_dim), *range(rotary_dim + rest, head_dim)]
    return torch.tensor(order)


def _turned_heads(name: str, config: ModelConfig) -> int:
    """The heads whose rows a partial-RoPE model reorders in this weight, else 0."""
    if config.rotary_dim is None:
        return 0
    if ".self_attn.q_proj." in name:
        return config.num_heads
    return config.num_kv_heads if ".self_attn.k_proj." in name else 0


def _reorder(rows: torch.Tensor, heads: int, config: ModelConfig) -> torch.Tensor:
    """A Q or K weight's (or bias's, or blocks') rows reordered within each head."""
    assert config.rotary_dim is not None  # _turned_heads() said this model reorders
    order = rotary_row_order(config.head_dim, config.rotary_dim)
    shaped = rows.reshape(heads, config.head_dim, *rows.shape[1:])
    return shaped[:, order].reshape(rows.shape)


class Phi3Weights(WeightParts):
    """A Phi-3 model's weights (a folder's or a GGUF's, read on demand) under the names
    and row orders the decoder loads; a fused source is read once for all its parts."""

    def __init__(self, weights: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
        super().__init__(weights, _sources(weights, config))
        self._config = config

    def __getitem__(self, name: str) -> torch.Tensor:
        source, rows = self._parts[name]
        tensor = self._weights[source] if rows is None else self.held(source)[rows]
        heads = _turned_heads(name, self._config)
        return _reorder(tensor, heads, self._config) if heads else tensor


def split_quant(quant: dict[str, QuantWeight], config: ModelConfig) -> dict[str, QuantWeight]:
    """A GGUF's block-quantized weights under the names and row orders the decoder loads
    (whole rows move: blocks stay whole)."""
    out = {}
    for name, (source, rows) in _sources(quant, config).items():
        weight = quant[source] if rows is None else quant[source].row_slice(rows)
        heads = _turned_heads(name, config)
        if heads:
            blocks = _reorder(weight.blocks, heads, config)
            weight = QuantWeight(weight.format, blocks, weight.in_features, True)
        out[name] = weight
    return out


def gguf_facts(
    config: ModelConfig, meta: dict[str, Any], reader: GGUFReader, path: Path
) -> ModelConfig:
    """What a llama.cpp "phi3" GGUF says beyond the common facts: the turned dimensions of
    a head (rope.dimension_count, less than the head for Phi-4-mini), and LongRoPE, whose
    short and long factors are the tensors rope_factors_short/long with the pretraining
    length and attention factor in rope.scaling.*."""
    factors = {
        name: dequantize_tensor(t, path).tolist()
        for t in reader.tensors
        if (name := t.name.removesuffix(".weight")) in ROPE_FACTOR_NAMES
    }
    dims = meta.get("phi3.rope.dimension_count")
    head_dim = config.head_dim
    facts: dict[str, Any] = {"rotary_dim": int(dims) if dims and int(dims) < head_dim else None}
    if factors:
        original = meta.get("phi3.rope.scaling.original_context_length")
        attn = meta.get("phi3.rope.scaling.attn_factor")
        facts["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": factors.get("rope_factors_short"),
            "long_factor": factors.get("rope_factors_long"),
            "original_max_position_embeddings": int(original) if original else None,
            "attention_factor": float(attn) if attn is not None else None,
        }
    config = dataclasses.replace(config, **facts)
    check_longrope(config, str(path))
    return config
