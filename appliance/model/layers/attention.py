"""Self-attention over the paged KV cache, this shard's heads: q/k/v column-parallel in, o
row-parallel out (a partial sum). What a family varies is said when it is built: biases,
a norm over each head of q and k, the score scale, a sliding window, sink logits."""

from __future__ import annotations

import torch
from torch import nn

from appliance.model.layers.norms import HeadNorm
from appliance.model.layers.paged_attention import AttentionBatch, paged_attention, rotate_and_store
from appliance.model.model_config import ModelConfig
from appliance.model.tensor_parallel import Shard, shard_plan


class Attention(nn.Module):
    """`qkv_bias`, `o_bias`: biases on the q/k/v and the o projections. `head_norm`: the
    norm over each head of q and of k after the projection, before RoPE (Qwen3, Gemma 3);
    None: none. `scale`: of the scores (None: head_dim ** -0.5). `window`: each query
    attends to the last this many keys (None: its whole context). `sinks`: a learned
    sink logit per query head joins each softmax (gpt-oss), loaded as `self_attn.sinks`."""

    def __init__(
        self,
        config: ModelConfig,
        shard: Shard,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        head_norm: type[HeadNorm] | None = None,
        scale: float | None = None,
        window: int | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        plan = shard_plan(config, shard)
        self.num_heads = len(plan.q_heads)
        self.num_kv_heads = len(plan.kv_heads)
        self.head_dim = config.head_dim
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_rows, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * config.head_dim, config.hidden_size, bias=o_bias)
        self.scale = scale if scale is not None else config.head_dim**-0.5
        self.window = window
        # [this shard's query heads]: allocated by load_weights, as every parameter is.
        self.sinks = (
            nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if sinks else None
        )
        eps = config.rms_norm_eps
        self.q_norm = head_norm(config.head_dim, eps) if head_norm is not None else None
        self.k_norm = head_norm(config.head_dim, eps) if head_norm is not None else None

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
