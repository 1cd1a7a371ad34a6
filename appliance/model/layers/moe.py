"""Routed experts in place of a layer's MLP (Mixtral, Qwen3-MoE, gpt-oss): a router picks
each token's top-k experts, and only those experts run, each once a step over the tokens
routed to it (expert_groups), so a decode step reads the routed experts' weights and no
others. Each expert is an MLP (layers/mlp.py). Under tensor parallelism experts split by
column as the MLP does (tensor_parallel.py says why).
"""

from __future__ import annotations

import torch
from torch import nn

from appliance.model.layers.mlp import MLP, GatedActivation, silu_and_mul


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


class SparseMoE(nn.Module):
    """A routed-experts block in place of a layer's MLP; as the MLP, under tensor
    parallelism it returns this shard's partial sum (every shard routes alike)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        columns: int,
        *,
        normalize: bool = True,
        softmax_after_top_k: bool = False,
        bias: bool = False,
        activation: GatedActivation = silu_and_mul,
    ) -> None:
        """`columns`: this shard's of each expert. The router takes the top k of the
        softmax, renormalized where `normalize` (Mixtral, Qwen3-MoE), or with
        `softmax_after_top_k` the softmax of the top k logits (gpt-oss). `bias`: on the
        router and every expert's projections."""
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=bias)
        self.experts = nn.ModuleList(
            MLP(hidden, columns, bias=bias, activation=activation) for _ in range(num_experts)
        )
        self.top_k = top_k
        self.normalize = normalize
        self.softmax_after_top_k = softmax_after_top_k

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
        """[tokens, hidden] -> each token's expert weights (float32) and experts [tokens, k]."""
        if not self.softmax_after_top_k:
            return route(self.gate(x), self.top_k, self.normalize)
        # The k largest router logits, softmaxed among themselves (GptOssTopKRouter).
        top, experts = torch.topk(self.gate(x).float(), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts
