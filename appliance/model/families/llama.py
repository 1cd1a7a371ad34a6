"""The Llama-family / Qwen2 / Qwen3 decoder, run over flat token batches and a paged KV
cache."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from appliance.model import cpu_kernels
from appliance.model.decode_step import CompiledDecode
from appliance.model.errors import ModelLoadError
from appliance.model.layers.moe import SparseMoE
from appliance.model.layers.paged_attention import AttentionBatch, paged_attention, rotate_and_store
from appliance.model.layers.rotary import RotaryEmbedding
from appliance.model.model_config import ModelConfig
from appliance.model.tensor_parallel import (
    WHOLE_MODEL,
    AllReduce,
    Shard,
    no_reduce,
    shard_plan,
    shard_state,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(
        self, residual: torch.Tensor, delta: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds `delta` (when given) to the residual stream `residual` [tokens, hidden];
        returns (the norm of the sum, the sum). On the CPU the compiled kernel does both
        in one pass and updates `residual` in place."""
        if cpu_kernels.norm_takes(delta, residual, self.weight):
            return cpu_kernels.add_rms_norm(delta, residual, self.weight, self.eps, checked=True)
        if delta is not None:
            residual = residual + delta
        # F.rms_norm accumulates 16-bit inputs in float32, as the reference does.
        return F.rms_norm(residual, (residual.shape[-1],), self.weight, self.eps), residual


class Attention(nn.Module):
    """This shard's heads: q/k/v column-parallel in, o row-parallel out (a partial sum)."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        plan = shard_plan(config, shard)
        self.num_heads = len(plan.q_heads)
        self.num_kv_heads = len(plan.kv_heads)
        self.head_dim = config.head_dim
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_rows, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5
        self.window = config.sliding_window
        # gpt-oss's sink logit per query head [heads] (model/gpt_oss.py); None: none.
        self.sinks: torch.Tensor | None = None
        # Qwen3: one RMSNorm over each head of q and of k, after the projection, before RoPE.
        self.q_norm = HeadNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = HeadNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_layer: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        # [tokens, q_heads + 2 * kv_heads, head_dim]
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            kv_start = self.num_heads + self.num_kv_heads
            self.q_norm.apply_(qkv[:, : self.num_heads])
            self.k_norm.apply_(qkv[:, self.num_heads : kv_start])
        q, k, v = rotate_and_store(
            qkv, rope, kv_layer[0], kv_layer[1], batch.slot_mapping, self.num_heads
        )
        out = paged_attention(
            q, k, v, kv_layer[0], kv_layer[1], batch, self.scale, self.window, self.sinks
        )
        return self.o_proj(out.flatten(1))


class HeadNorm(nn.Module):
    """RMSNorm over the last dimension of each head (Qwen3's q_norm and k_norm)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)
        self.eps = eps

    def apply_(self, heads: torch.Tensor) -> None:
        """Normalise `heads` [tokens, n, head_dim] in place (a view into the fused qkv,
        which the rotation then reads). On the CPU by the compiled kernel the compiled
        decode step runs on the same rows, so both answer alike."""
        rows = heads.reshape(-1, heads.shape[-1])  # [tokens * n, head_dim], a copy
        if cpu_kernels.norm_takes(None, rows, self.weight):
            normed = cpu_kernels.add_rms_norm(None, rows, self.weight, self.eps, checked=True)[0]
            heads.copy_(normed.view_as(heads))
            return
        # In float32, cast back, then weighted, as transformers' Qwen3RMSNorm does.
        normed = F.rms_norm(rows.float(), (rows.shape[-1],), eps=self.eps)
        heads.copy_((normed.to(heads.dtype) * self.weight).view_as(heads))


class MLP(nn.Module):
    """This shard's intermediate columns; down_proj gives a partial sum."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        columns = len(shard_plan(config, shard).mlp_columns)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * columns, bias=False)
        self.down_proj = nn.Linear(columns, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [tokens, 2 * columns]
        if cpu_kernels.silu_takes(gate_up):  # the compiled decode step's own SiLU
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        # In place on the fused output: on CPU a fresh silu(gate) * up is up to 1.5x slower.
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, all_reduce: AllReduce) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = MLP(config, shard)  # CausalLM swaps in routed experts
        self.all_reduce = all_reduce

    def forward(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_layer: torch.Tensor,
        batch: AttentionBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds the previous layer's output `delta` (None before the first layer) to the
        residual stream; returns (this layer's output, the stream), its own output left
        for the next norm to add (the add and the norm run as one)."""
        h, residual = self.input_layernorm(residual, delta)
        h = self._sum(self.self_attn(h, rope, kv_layer, batch), h.dtype)
        h, residual = self.post_attention_layernorm(residual, h)
        return self._sum(self.mlp(h), h.dtype), residual

    def _sum(self, partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return sum_partials(self.all_reduce, partial, dtype)


def sum_partials(all_reduce: AllReduce, partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The group's sum of a row-parallel output. A quantized shard's partials are float64
    (QuantMatrix): their sum is rounded through float32, as one process's product rounds."""
    total = all_reduce(partial)
    return total.float().to(dtype) if total.dtype == torch.float64 else total


class CausalLM(nn.Module):
    """The whole model, or one tensor-parallel shard of it (`shard`, whose partial sums
    `all_reduce` adds up over the group). forward() gives hidden states, whole on every
    shard; logits() the next-token scores."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        shard: Shard = WHOLE_MODEL,
        all_reduce: AllReduce = no_reduce,
    ) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        self.dtype = dtype
        self.device = device
        self.max_positions = max_positions
        # An explicit (empty) weight skips normal_ init, which on meta tensors imports
        # torch's compiler stack and costs a second at every start.
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        # An nn.Embedding, or the QuantEmbedding attach_quant swaps in.
        self.embed_tokens: nn.Module = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=embedding
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, shard, all_reduce) for _ in range(config.num_layers)
        )
        for index, layer in enumerate(self.layers):  # Mixtral, Qwen3-MoE (model/moe.py)
            if config.sparse_layer(index):
                layer.mlp = SparseMoE(config, shard)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # None while tied to the embedding; attach_quant and pack_linears may swap in theirs.
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rope: RotaryEmbedding | None = None  # built by load_weights, on the real device
        # Decode-only steps in one compiled call, where the model allows (build_model).
        self.decode_step: CompiledDecode | None = None
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions [tokens]; kv_cache [layers, 2, blocks, block_size, kv_heads,
        head_dim]. Returns hidden states [tokens, hidden]."""
        residual, delta = self.embed_tokens(input_ids), None
        if self.rope is None:
            raise RuntimeError("the model has no weights yet: load_weights builds its RoPE")
        rope = self.rope.at(positions)
        if self.decode_step is not None and self.decode_step.takes(batch):
            return self.decode_step(residual, rope, batch, kv_cache)
        for index, layer in enumerate(self.layers):
            delta, residual = layer(residual, delta, rope, kv_cache[index], batch)
        return self.norm(residual, delta)[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> float32 [rows, vocab]."""
        if self.lm_head is None:  # tied to the embedding
            return F.linear(hidden, self.embedding_weight()).float()
        return self.lm_head(hidden).float()

    def embedding_weight(self) -> torch.Tensor:
        """The float embedding's weight [vocab, hidden] (a quantized one has none)."""
        weight = self.embed_tokens.weight  # nn.Module's __getattr__ is typed Tensor | Module
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"the embedding's weight is a {type(weight).__name__}")
        return weight

    def load_weights(self, weights: Mapping[str, torch.Tensor], source: str) -> None:
        """Take Hugging Face-named float weights: this shard's part of each is copied into
        its parameter, in the model's dtype and on its device, as it is read, and q/k/v
        and gate/up straight into their rows of the fused parameter. `weights` may read
        each tensor only when asked for (loader.ModelFiles); one with `release(name)` is
        told when a tensor is copied. So loading holds the model's own parameters and one
        tensor being copied, never a full-size copy of the model. Parameters are
        allocated here: the model may be built on the meta device."""
        plan = self._load_plan()
        self._check_names(plan, weights, source)
        for name, parts in plan.items():
            self._load_parameter(name, parts, weights, source)
        factors = weights["rope_freqs"].float().clone() if "rope_freqs" in weights else None
        self.rope = RotaryEmbedding(
            self.config, self.max_positions, self.dtype, self.device, factors
        )

    def _load_plan(self) -> dict[str, list[tuple[str, int]]]:
        """Each parameter's Hugging Face sources, in row order, with the rows of this
        shard's part of each."""
        plan = shard_plan(self.config, self.shard)
        d = self.config.head_dim
        rows = {
            "q_proj": len(plan.q_heads) * d,
            "k_proj": len(plan.kv_heads) * d,
            "v_proj": len(plan.kv_heads) * d,
            "gate_proj": len(plan.mlp_columns),
            "up_proj": len(plan.mlp_columns),
        }
        expert = len(plan.expert_columns)
        out = {}
        for name, param in self.named_parameters():
            source = name if name.startswith("lm_head.") else "model." + name
            fused = next((f for f in _FUSED if f".{f}." in name), None)
            sizes = rows | {"gate_proj": expert, "up_proj": expert} if ".experts." in name else rows
            if fused is None:
                out[name] = [(source, param.shape[0] if param.dim() else 1)]
            else:
                out[name] = [(source.replace(fused, p), sizes[p]) for p in _FUSED[fused]]
        return out

    def _check_names(
        self,
        plan: dict[str, list[tuple[str, int]]],
        weights: Mapping[str, torch.Tensor],
        source: str,
    ) -> None:
        """Refuse weights that do not name exactly the parameters' sources (a tied model
        may bring an LM head; a GGUF may bring RoPE factors)."""
        wanted = {part for parts in plan.values() for part, _ in parts}
        extra = {"rope_freqs"} | ({"lm_head.weight"} if self.config.tie_word_embeddings else set())
        missing = sorted(wanted - set(weights))
        unexpected = sorted(set(weights) - wanted - extra)
        if missing or unexpected:
            raise ModelLoadError(
                source,
                f"weights do not fit the architecture (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]})",
            )

    def _load_parameter(
        self,
        name: str,
        parts: list[tuple[str, int]],
        weights: Mapping[str, torch.Tensor],
        source: str,
    ) -> None:
        """Allocate one parameter and copy this shard's part of each of its sources into its
        rows, one source in memory at a time. Always a copy: a source may view a mapped
        file, which a user could rewrite under a running worker."""
        shape = self.get_parameter(name).shape
        target, start = None, 0
        for part, rows in parts:
            tensor = shard_state({part: weights[part]}, self.config, self.shard)[part]
            if target is None:
                dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
                target = torch.empty(shape, dtype=dtype, device=self.device)
            into = target[start : start + rows] if len(parts) > 1 else target
            if tensor.shape != into.shape:
                raise ModelLoadError(
                    source,
                    f"weight {part} has shape {tuple(tensor.shape)}, expected {tuple(into.shape)}",
                )
            into.copy_(tensor)
            del tensor  # before the next source is read
            _release(weights, part)
            start += rows
        assert target is not None  # every parameter has a source: _load_plan lists one at least
        owner, _, leaf = name.rpartition(".")
        setattr(self.get_submodule(owner), leaf, nn.Parameter(target, requires_grad=False))


# Our fused parameters and the Hugging Face projections they are made of, in row order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _release(weights: Mapping[str, torch.Tensor], name: str) -> None:
    """Tell `weights` that its tensor `name` is copied (safetensors_file.MappedTensors.release)."""
    release = getattr(weights, "release", None)
    if release is not None:
        release(name)
