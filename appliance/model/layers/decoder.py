"""A decoder layer made of the parts its family chose (attention, an MLP or routed experts,
norms): pre-norm (Llama and most), or Gemma's four norms around each block. Both take the
residual stream and the previous layer's output `delta` and give their own output and the
stream, so the add and the next norm run as one."""

from __future__ import annotations

import torch
from torch import nn

from appliance.model.layers.attention import Attention
from appliance.model.layers.norms import OffsetRMSNorm, RMSNorm
from appliance.model.layers.paged_attention import AttentionBatch
from appliance.model.tensor_parallel import AllReduce


def sum_partials(all_reduce: AllReduce, partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The group's sum of a row-parallel output. A quantized shard's partials are float64
    (QuantMatrix): their sum is rounded through float32, as one process's product rounds."""
    total = all_reduce(partial)
    return total.float().to(dtype) if total.dtype == torch.float64 else total


class DecoderLayer(nn.Module):
    """norm -> attention -> add -> norm -> MLP (or experts); `post_attention_layernorm` is
    the norm before the MLP (Hugging Face's name). `local_rope`: the layer turns q and k by
    the model's local RoPE table (Gemma's sliding layers), else its main one."""

    def __init__(
        self,
        self_attn: Attention,
        mlp: nn.Module,
        input_layernorm: RMSNorm,
        post_attention_layernorm: RMSNorm,
        all_reduce: AllReduce,
        *,
        local_rope: bool = False,
    ) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp
        self.all_reduce = all_reduce
        self.local_rope = local_rope

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
        h = sum_partials(self.all_reduce, self.self_attn(h, rope, kv_layer, batch), h.dtype)
        h, residual = self.post_attention_layernorm(residual, h)
        return sum_partials(self.all_reduce, self.mlp(h), h.dtype), residual


class SandwichDecoderLayer(nn.Module):
    """Gemma's: a norm before and after attention and before and after the MLP, each
    block's output normed before it joins the residual stream. A shard's row-parallel
    partial sums are summed before the norm that follows them."""

    def __init__(
        self,
        self_attn: Attention,
        mlp: nn.Module,
        norms: tuple[OffsetRMSNorm, OffsetRMSNorm, OffsetRMSNorm, OffsetRMSNorm],
        all_reduce: AllReduce,
        *,
        local_rope: bool = False,
    ) -> None:
        super().__init__()
        self.input_layernorm = norms[0]
        self.self_attn = self_attn
        self.post_attention_layernorm = norms[1]
        self.pre_feedforward_layernorm = norms[2]
        self.mlp = mlp
        self.post_feedforward_layernorm = norms[3]
        self.all_reduce = all_reduce
        self.local_rope = local_rope

    def forward(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_layer: torch.Tensor,
        batch: AttentionBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward."""
        if delta is not None:
            residual = residual + delta
        dtype = residual.dtype
        h = self.self_attn(self.input_layernorm(residual)[0], rope, kv_layer, batch)
        residual = residual + self.post_attention_layernorm(self._sum(h, dtype))[0]
        h = self.mlp(self.pre_feedforward_layernorm(residual)[0])
        return self.post_feedforward_layernorm(self._sum(h, dtype))[0], residual

    def _sum(self, partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return sum_partials(self.all_reduce, partial, dtype)
