"""RMS norms: over the hidden size, adding the previous layer's output first (RMSNorm),
over each head of q or k (HeadNorm: Qwen3, Gemma 3), and Gemma's (1 + weight) variants."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from appliance.model import cpu_kernels


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


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the float32 norm of x times (1 + weight), cast to x's dtype; called
    as RMSNorm is (adding `delta` first, returning the norm and the sum)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(
        self, residual: torch.Tensor, delta: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            residual = residual + delta
        normed = F.rms_norm(residual.float(), (residual.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(residual.dtype), residual


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


class OffsetHeadNorm(HeadNorm):
    """HeadNorm (its in-place interface) with Gemma's (1 + weight) float32 norm."""

    def apply_(self, heads: torch.Tensor) -> None:
        """Normalise `heads` [tokens, n, head_dim] in place (a view into the fused qkv)."""
        normed = F.rms_norm(heads.float(), (heads.shape[-1],), eps=self.eps)
        heads.copy_(normed * (1.0 + self.weight.float()))
