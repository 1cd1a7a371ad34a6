"""gpt-oss (GptOssForCausalLM, a llama.cpp "gpt-oss" GGUF): llama.py's decoder with
gpt-oss's differences.

- Attention with biases on q/k/v and o, and a learned sink logit per query head that
  joins each softmax's denominator and adds no value (attention.py runs it on every
  path: attend_with_sinks on the CPU, the Triton kernel on CUDA; the compiled CPU decode
  step, which has no sinks, is refused: decode_step.compiled_problem).
- Layers alternate sliding-window and full attention (`layer_types`).
- YaRN RoPE (rope.py).
- Every layer's MLP is routed experts: a router with a bias, each token's top-k router
  logits softmaxed into its weights; experts with biases and a clamped SwiGLU:
  gate.clamp(max=limit) * sigmoid(alpha * gate) * (up.clamp(-limit, limit) + 1).

Under tensor parallelism heads split as llama's do and each shard keeps its heads'
sinks; experts split by column as moe.py's do. The o and down projections are
row-parallel: their biases are added by the group's first shard alone
(tensor_parallel.shard_state), so the all-reduce adds each once.
"""

from __future__ import annotations

import torch
from torch import nn

from appliance.model.families.llama import Attention, CausalLM
from appliance.model.layers.moe import SparseMoE
from appliance.model.model_config import ModelConfig
from appliance.model.tensor_parallel import (
    WHOLE_MODEL,
    AllReduce,
    Shard,
    no_reduce,
    shard_plan,
)


class SinkAttention(Attention):
    """llama's attention with an o bias, this layer's window and a sink per query head."""

    def __init__(self, config: ModelConfig, shard: Shard, index: int) -> None:
        super().__init__(config, shard)
        self.o_proj = nn.Linear(self.num_heads * config.head_dim, config.hidden_size, bias=True)
        self.window = config.layer_window(index)
        # [this shard's query heads]: allocated by load_weights, as every parameter is.
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)


class SwiGLUExpert(nn.Module):
    """One expert over this shard's `columns`: gate/up fused (rows [gate; up], each with
    its bias), gpt-oss's clamped SwiGLU, down with its bias."""

    def __init__(self, hidden: int, columns: int, limit: float, alpha: float) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * columns, bias=True)
        self.down_proj = nn.Linear(columns, hidden, bias=True)
        self.limit = limit
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden] (a shard's partial sum under TP)."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [tokens, columns] each
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return self.down_proj((up + 1) * glu)


class GptOssMoE(SparseMoE):
    """SparseMoE with gpt-oss's router (a bias; softmax over the top-k logits) and experts."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__(config, shard)
        columns = len(shard_plan(config, shard).expert_columns)
        limit = config.swiglu_limit if config.swiglu_limit is not None else 7.0
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=True)
        self.experts = nn.ModuleList(
            SwiGLUExpert(config.hidden_size, columns, limit, config.swiglu_alpha)
            for _ in range(config.num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, hidden] -> (weights [tokens, k] float32, experts [tokens, k]): the k
        largest router logits, softmaxed among themselves, as GptOssTopKRouter does."""
        logits = self.gate(x).float()  # [tokens, experts]
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts


class GptOssCausalLM(CausalLM):
    """CausalLM with gpt-oss's attention (sinks, o bias, per-layer windows) and experts."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        shard: Shard = WHOLE_MODEL,
        all_reduce: AllReduce = no_reduce,
    ) -> None:
        super().__init__(config, dtype, device, max_positions, shard, all_reduce)
        for index, layer in enumerate(self.layers):
            layer.self_attn = SinkAttention(config, shard, index)
            layer.mlp = GptOssMoE(config, shard)
        self.requires_grad_(False)
