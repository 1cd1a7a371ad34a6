"""4-bit weights kept as the GGUF stores them (Q4_0 / Q4_1), for memory-bound decode.

A decode step at batch 1 reads every weight once: 4-bit weights read 4x fewer bytes than
bfloat16 ones. torch's int4 CPU kernel computes `x @ ((q - 8) * scale + zero).T` per group
of 32 inputs, which holds Q4_1 (`d * q + m`, so scale = d, zero = m + 8d) and Q4_0
(`d * (q - 8)`, zero = 0) exactly, up to rounding scale and zero to the activation dtype.
It only beats dense bfloat16 matmuls for a few rows (benchmarks/engine_bench.py), so each
projection keeps its dense weight too and picks per call.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

GROUP = 32  # GGUF's Q4_0 / Q4_1 block: 32 weights sharing one scale (and min)
# At or below this many rows the int4 kernel is faster than dense bfloat16 on the CPU
# (measured 4.5 vs 20.5 ms for all layers at 1 row, 12 vs 24 at 8, 47 vs 35 at 32).
INT4_MAX_ROWS = 8


def split_q4_blocks(raw: np.ndarray, q4_1: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_0/Q4_1 rows [out, blocks * bytes] -> q uint8 [out, in] (0..15), scale and
    zero float32 [out, in / 32] in the kernel's `(q - 8) * scale + zero` form."""
    block_bytes = 20 if q4_1 else 18
    blocks = raw.reshape(raw.shape[0], -1, block_bytes)  # [out, groups, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if q4_1 else None
    packed = blocks[..., block_bytes - 16 :]
    # Low nibbles are a block's first 16 weights, high nibbles its last 16.
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(raw.shape[0], -1)
    zero = m + 8 * d if m is not None else np.zeros_like(d)
    return q, d, zero


class Int4Switch:
    """Whether this step may use the 4-bit weights: decode steps only. A prefill that
    ended on a few rows (the tail of a chunked or prefix-cached prompt) would otherwise
    compute its last rows with slightly different weights than the same prompt prefilled
    whole, and greedy outputs would depend on chunking and on what the cache held."""

    def __init__(self) -> None:
        self.on = True


class Int4Linear(nn.Module):
    """A projection with both a dense weight and its 4-bit form; few decode rows use 4 bits."""

    def __init__(
        self,
        dense: nn.Linear,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        switch: Int4Switch,
    ) -> None:
        super().__init__()
        self.dense = dense
        self.switch = switch
        dtype = dense.weight.dtype
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # [in / 32, out, 2]: the kernel's per-group (scale, zero) layout
        self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.scales_zeros = self.scales_zeros.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > INT4_MAX_ROWS or not self.switch.on:
            return self.dense(x)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed, GROUP, self.scales_zeros
        )
        return out if self.dense.bias is None else out + self.dense.bias


# Our fused projections and the GGUF-named parts they are made of, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def attach_int4(model: nn.Module, int4: dict[str, torch.Tensor]) -> int:
    """Give every projection whose parts are all 4-bit an Int4Linear, all under one
    `model.int4_switch`; returns how many."""
    switch = model.int4_switch = Int4Switch()
    attached = 0
    for index, layer in enumerate(model.layers):
        for fused, parts in _FUSED.items():
            names = [f"model.layers.{index}.{p}.weight" for p in parts]
            if not all(f"{n}.q4" in int4 for n in names):
                continue
            q, scale, zero = (
                torch.cat([int4[f"{n}.{k}"] for n in names]) for k in ("q4", "scale", "zero")
            )
            owner, attr = fused.split(".")
            module = getattr(layer, owner)
            setattr(module, attr, Int4Linear(getattr(module, attr), q, scale, zero, switch))
            attached += 1
    return attached


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float weight [out, in] that 4-bit (q, scale, zero) stand for."""
    groups = q.shape[1] // GROUP
    q = q.view(q.shape[0], groups, GROUP).float()
    return ((q - 8) * scale[..., None] + zero[..., None]).view(q.shape[0], -1)
