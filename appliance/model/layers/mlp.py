"""The gated MLP (gate/up fused, an activation of the gate times up, down), whole or one
tensor-parallel shard's columns; a routed expert is one (layers/moe.py). The activations
it is built with: SiLU (Llama and most), GELU tanh (Gemma's GeGLU), gpt-oss's clamped
SwiGLU."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from appliance.model import cpu_kernels

# [tokens, 2 * columns] (rows [gate; up] of the fused projection) -> [tokens, columns]
GatedActivation = Callable[[torch.Tensor], torch.Tensor]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the compiled decode step's own kernel on the CPU where it takes the
    tensor, else in place on the fused output (a fresh silu(gate) * up is up to 1.5x
    slower on a CPU)."""
    if cpu_kernels.silu_takes(gate_up):
        return cpu_kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU: gelu (tanh approximation) of the gate times up; never the SiLU kernel."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


class ClampedSwiGLU:
    """gpt-oss's: gate.clamp(max=limit) * sigmoid(alpha * gate) * (up.clamp(-limit, limit) + 1)."""

    def __init__(self, limit: float, alpha: float) -> None:
        self.limit = limit
        self.alpha = alpha

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [tokens, columns] each
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu


class MLP(nn.Module):
    """This shard's `columns` of the intermediate width; down_proj gives a partial sum."""

    def __init__(
        self,
        hidden: int,
        columns: int,
        *,
        bias: bool = False,
        activation: GatedActivation = silu_and_mul,
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * columns, bias=bias)
        self.down_proj = nn.Linear(columns, hidden, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden] (a shard's partial sum under TP)."""
        return self.down_proj(self.activation(self.gate_up_proj(x)))
