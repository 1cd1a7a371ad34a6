"""4-bit weights kept as the GGUF stores them (Q4_0 / Q4_1), for memory-bound decode.

A decode step at batch 1 reads every weight once: 4-bit weights read 4x fewer bytes than
bfloat16 ones. torch's int4 CPU kernel computes `x @ ((q - 8) * scale + zero).T` per group
of 32 inputs, which holds Q4_1 (`d * q + m`, so scale = d, zero = m + 8d) and Q4_0
(`d * (q - 8)`, zero = 0) exactly, up to rounding scale and zero to the activation dtype.
It only beats dense bfloat16 matmuls for a few rows (benchmarks/engine_bench.py), so each
projection keeps its dense weight too and picks per call.

The LM head (SmolLM2's tied embedding, Q8_0 in the file: 8 bits per weight, one scale d
per 32) is the largest matmul of a batch-1 step. It goes through the same kernel as two
4-bit halves: q + 128 = 16 * hi + lo with hi, lo in 0..15, so
d * q = (16d * (hi - 8) + 8d) + d * (lo - 8), each half centred on zero. Their weights
add up to the file's Q8_0 weight exactly, up to rounding d to the activation dtype; each
half's output is rounded to that dtype before the two are added. They read half the
bytes of the dense bfloat16 head.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from appliance.model.model_config import ModelConfig

GROUP = 32  # GGUF's Q4_0 / Q4_1 block: 32 weights sharing one scale (and min)
# At or below this many rows the int4 kernel is faster than dense bfloat16 on the CPU
# (measured 4.5 vs 20.5 ms for all layers at 1 row, 12 vs 24 at 8, 47 vs 35 at 32).
INT4_MAX_ROWS = 8


def split_q8_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q8_0 rows [out, blocks * 34] -> q int8 [out, in] and d float32 [out, in / 32]."""
    blocks = raw.reshape(raw.shape[0], -1, 34)  # [out, groups, 2 bytes of d + 32 of q]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    return q, d


def head_weight_name(config: ModelConfig) -> str:
    """The Hugging Face name of the weight the LM head multiplies by."""
    return "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


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

    def takes(self, x: torch.Tensor) -> bool:
        """Whether rows `x` [rows, in] go through a 4-bit kernel."""
        return self.on and x.shape[0] <= INT4_MAX_ROWS


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
        self.scales_zeros = _scales_zeros(scale, zero, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.switch.takes(x):
            return self.dense(x)
        out = int4_matmul(x, self.packed, self.scales_zeros)
        return out if self.dense.bias is None else out + self.dense.bias


class Q8Head(nn.Module):
    """The LM head from the file's Q8_0 weight, as two 4-bit halves (see the module doc)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        unsigned = q.to(torch.int32) + 128  # 0..255
        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        self.high = pack(unsigned >> 4, 1)
        self.low = pack(unsigned & 15, 1)
        # The kernel's weight is (nibble - 8) * scale + zero per group: 16d * (hi - 8) + 8d
        # for the high half, d * (lo - 8) for the low one (whose output stays small).
        self.high_scales = _scales_zeros(16 * d, 8 * d, dtype)
        self.low_scales = _scales_zeros(d, torch.zeros_like(d), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> float32 [rows, vocab]."""
        high = int4_matmul(x, self.high, self.high_scales)
        return high.float().add_(int4_matmul(x, self.low, self.low_scales))


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ the 4-bit weight [out, in].T -> [rows, out] in x's dtype."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, GROUP, scales_zeros)


def _scales_zeros(scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-group scale and zero [out, in / 32] -> the kernel's layout [in / 32, out, 2]."""
    return torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)


# Our fused projections and the GGUF-named parts they are made of, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def attach_int4(model: nn.Module, int4: dict[str, torch.Tensor]) -> int:
    """Give every projection whose parts are all 4-bit an Int4Linear, all under one
    `model.int4_switch`, and the LM head a Q8Head when the file's is Q8_0; returns how
    many projections went 4-bit."""
    switch = model.int4_switch = Int4Switch()
    head = head_weight_name(model.config)
    # The kernel packs output rows 16 at a time: another vocabulary keeps the dense head.
    if f"{head}.q8" in int4 and int4[f"{head}.q8"].shape[0] % 16 == 0:
        model.int4_head = Q8Head(int4[f"{head}.q8"], int4[f"{head}.q8_scale"], model.dtype)
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
