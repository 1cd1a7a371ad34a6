"""Products by GGUF block-quantized weights on the GPU, the blocks read in place: a
Triton GEMV for decode (a few token rows times a [rows, in_features] weight), memory
bound, so the weight is read as the file stores it (Q8_0: 8.5 bits a weight, Q4_0: 4.5)
and dequantized in registers, never written out in bfloat16.

Block layouts (GGML's, as appliance/model/quant.py reads and writes them): a row of the
weight is its in_features / 32 blocks of 32 values, each block a float16 scale d (two
bytes, little-endian) and then
- Q8_0: 32 signed bytes q, value d * q (34 bytes a block);
- Q4_0: 16 bytes, byte j holding value j in its low nibble and value j + 16 in its high
  one, value d * (nibble - 8) (18 bytes a block).

Grid: (row tiles, tokens). A program takes ROWS output rows for one token row of x and
walks the input BLOCKS blocks (BLOCKS * 32 values) a step: the scales as [ROWS, BLOCKS],
the quants as [ROWS, BLOCKS, 32], x's slice as [BLOCKS, 32], a float32 sum. Under
Triton's interpreter (TRITON_INTERPRET=1) the same kernel runs on CPU tensors; the tests
compare it with the dequantizer and the CPU kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

# GGML type ids (quant.FORMATS) -> (the kernel's FORMAT, bytes a block).
_FORMATS = {8: (0, 34), 2: (1, 18)}  # Q8_0, Q4_0
_VALUES = 32  # values a block, both formats
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _quant_gemv_kernel(
    x_ptr,  # [tokens, in_features] float
    w_ptr,  # [rows, row_bytes] uint8: each row's blocks
    out_ptr,  # [tokens, rows] like x
    rows,
    in_features,
    stride_xt,
    stride_wr,
    stride_ot,
    FORMAT: tl.constexpr,  # 0: Q8_0, 1: Q4_0
    BLOCK_BYTES: tl.constexpr,  # 34 (Q8_0) or 18 (Q4_0)
    ROWS: tl.constexpr,  # output rows a program
    BLOCKS: tl.constexpr,  # blocks of 32 values a loop step
):
    row_tile = tl.program_id(0)
    token = tl.program_id(1)
    r = row_tile * ROWS + tl.arange(0, ROWS)  # [ROWS]
    r_ok = r < rows
    j = tl.arange(0, 32)  # a value's place in its block
    num_blocks = in_features // 32
    acc = tl.zeros([ROWS], dtype=tl.float32)
    w_rows = w_ptr + r.to(tl.int64)[:, None] * stride_wr  # [ROWS, 1]
    for first in range(0, num_blocks, BLOCKS):
        b = first + tl.arange(0, BLOCKS)  # [BLOCKS]
        b_ok = b < num_blocks
        ok = r_ok[:, None] & b_ok[None, :]  # [ROWS, BLOCKS]
        block = w_rows + b[None, :] * BLOCK_BYTES  # [ROWS, BLOCKS]: each block's first byte
        # The scale: a little-endian float16 from two bytes, bit for bit.
        lo = tl.load(block, mask=ok, other=0).to(tl.uint16)
        hi = tl.load(block + 1, mask=ok, other=0).to(tl.uint16)
        d = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)  # [ROWS, BLOCKS]
        if FORMAT == 0:
            byte = tl.load(block[:, :, None] + 2 + j[None, None, :], mask=ok[:, :, None], other=0)
            q = byte.to(tl.int8, bitcast=True).to(tl.float32)  # [ROWS, BLOCKS, 32]
        else:
            # Values j and j + 16 share byte j % 16: low nibble, then high.
            byte = tl.load(
                block[:, :, None] + 2 + (j % 16)[None, None, :], mask=ok[:, :, None], other=0
            )
            nibble = tl.where(j[None, None, :] < 16, byte & 15, byte >> 4)
            q = nibble.to(tl.float32) - 8.0
        xs = tl.load(
            x_ptr + token * stride_xt + b[:, None] * 32 + j[None, :], mask=b_ok[:, None], other=0.0
        ).to(tl.float32)  # [BLOCKS, 32]
        acc += tl.sum(tl.sum(q * xs[None, :, :], axis=2) * d, axis=1)
    tl.store(out_ptr + token * stride_ot + r, acc.to(out_ptr.dtype.element_ty), mask=r_ok)


@dataclass(frozen=True)
class QuantLaunch:
    """One launch of the GEMV: grid, arguments in the kernel's order, constexprs and
    compile options (the compile table builds the same)."""

    kernel: Any  # a triton.JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    options: dict[str, Any]


def gemv_launch(
    x: torch.Tensor, blocks: torch.Tensor, format_id: int, in_features: int, out: torch.Tensor
) -> QuantLaunch:
    """The launch quant_gemv makes for these (checked) arguments."""
    kind, block_bytes = _FORMATS[format_id]
    rows = blocks.shape[0]
    # 16 rows x 8 blocks: [16, 8, 32] quants, 32 a thread on 4 warps, 64 registers on
    # sm_80 and sm_90a (64 rows x 4 blocks took 218-255: two programs an SM at most); a
    # row's 8 blocks a step are 272 contiguous bytes in Q8_0, and a 4096-row weight
    # makes 256 programs a token, two for each of an H100's SMs. Untimed: no GPU yet.
    tile_rows, tile_blocks = 16, 8
    args = (x, blocks, out, rows, in_features, x.stride(0), blocks.stride(0), out.stride(0))
    options = {
        "FORMAT": kind,
        "BLOCK_BYTES": block_bytes,
        "ROWS": tile_rows,
        "BLOCKS": tile_blocks,
        "num_warps": 4,
        "num_stages": 2,
    }
    grid = (triton.cdiv(rows, tile_rows), x.shape[0])
    return QuantLaunch(_quant_gemv_kernel, grid, args, options)


def quant_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    format_id: int,
    in_features: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [tokens, in_features] times a block-quantized weight (`blocks` [rows, row_bytes]
    uint8 of GGML type `format_id`: 8 Q8_0, 2 Q4_0) transposed -> [tokens, rows] in x's
    dtype (float32 sums). For decode's few rows: each token row reads the weight again
    (from L2 after the first)."""
    if format_id not in _FORMATS:
        raise ValueError(f"quant_gemv takes Q8_0 (8) or Q4_0 (2) blocks, not GGML type {format_id}")
    if x.dtype not in _DTYPES or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [tokens, {in_features}] of {_DTYPES}: {x.dtype} {x.shape}")
    block_bytes = _FORMATS[format_id][1]
    if in_features % _VALUES or blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError("blocks must be 2-D uint8 rows of whole 32-value blocks")
    if blocks.shape[1] != in_features // _VALUES * block_bytes or blocks.stride(1) != 1:
        raise ValueError(f"rows of {blocks.shape[1]} bytes do not hold {in_features} values")
    if x.stride(1) != 1:
        raise ValueError("x needs contiguous rows")
    if out is None:
        out = torch.empty(x.shape[0], blocks.shape[0], dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or blocks.shape[0] == 0:
        return out
    launch = gemv_launch(x, blocks, format_id, in_features, out)
    launch.kernel[launch.grid](*launch.args, **launch.options)
    return out
