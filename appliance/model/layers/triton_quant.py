"""Products by GGUF block-quantized weights on the GPU, the blocks read in place and
dequantized in registers, never written out in bfloat16: a Triton GEMV for decode (a few
token rows times a [rows, in_features] weight; memory bound, so the weight is read as the
file stores it: Q8_0 8.5 bits a weight, Q4_1 5, Q4_0 4.5, Q6_K 6.56, Q5_K 5.5, Q4_K 4.5)
and a GEMM for prefill's rows (a weight tile dequantized to x's dtype, then a tensor-core
dot).

Block layouts (GGML's, as appliance/model/quant.py and the CPU kernels read them). The
32-value formats: a float16 scale d (two bytes, little-endian), then
- Q8_0: 32 signed bytes q, value d * q (34 bytes a block);
- Q4_0: 16 bytes, byte j holding value j in its low nibble and value j + 16 in its high
  one, value d * (nibble - 8) (18 bytes a block);
- Q4_1: a float16 min m after d, then Q4_0's 16 bytes, value d * nibble + m (20 bytes).
The K-quants, 256 values a super-block:
- Q4_K (144 bytes): d, dmin (float16), 12 bytes of eight 6-bit scales and mins (one per
  32 values, llama.cpp's get_scale_min_k4), 128 bytes of nibbles: bytes 32c..32c+31
  hold sub-blocks 2c (low nibbles) and 2c + 1 (high); value d * sc * nibble - dmin * m;
- Q5_K (176 bytes): Q4_K's d, dmin and 12 scale bytes, then qh[32], then Q4_K's 128 bytes
  of nibbles; value l of sub-block s (0-7) takes bit s of qh[l] as its fifth bit (q =
  nibble | bit << 4, 0-31); value d * sc * q - dmin * m;
- Q6_K (210 bytes): ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16] (one per 16
  values), d (float16) last; in each half of 128 values, group g of 32 takes its low
  bits from ql's half (g % 2: which 32 bytes, g // 2: which nibble) and its high bits
  from qh[l] >> 2g; value d * scale * (q - 32).
Every weight comes out as the CPU dequantizer's float32, bit for bit (the products of a
float16 scale and a small integer are exact in float32 (Q5_K's widest: 11 + 6 + 5 bits),
and each value rounds once).

GEMV grid: (row tiles, tokens). A program takes ROWS output rows for one token row of x
and walks the input a step at a time: 32-value formats BLOCKS blocks a step (scales as
[ROWS, BLOCKS], quants as [ROWS, BLOCKS, 32]), K-quants one super-block a step (scales
as [ROWS, SUBS], quants as [ROWS, SUBS, SUBLEN]), float32 sums. GEMM grid: (row tiles of
x, row tiles of the weight): [BM, BN] of the output, the weight dequantized [BN, BK] a
step (BK a multiple of 32; for the K-quants a part of one super-block), the dot in x's
dtype with float32 sums (IEEE for float32; under the interpreter 16-bit operands are
widened after the same rounding, UPCAST).
Under Triton's interpreter (TRITON_INTERPRET=1) the same kernels run on CPU tensors; the
tests compare them with the dequantizer and the CPU kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class _Format:
    """A GGML block format as the kernels take it."""

    kind: int  # the kernels' FORMAT constexpr
    block_bytes: int
    values: int  # values a block


# GGML type ids (quant.FORMATS) -> the kernels' view of the format.
_FORMATS = {
    8: _Format(0, 34, 32),  # Q8_0
    2: _Format(1, 18, 32),  # Q4_0
    3: _Format(2, 20, 32),  # Q4_1
    12: _Format(3, 144, 256),  # Q4_K
    14: _Format(4, 210, 256),  # Q6_K
    13: _Format(5, 176, 256),  # Q5_K
}
_GEMM_FORMATS = (8, 2, 3, 12, 14, 13)  # every format the GEMV takes
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Token rows from which a product runs as the GEMM: below, the GEMV reads the weight once
# per row (from L2 after the first), where the GEMM's row tile of 16 would idle. A guess,
# untimed: no GPU yet.
GEMM_TOKENS = 8


@triton.jit
def _half(ptr, mask):
    """The little-endian float16 at ptr (bytes), bit for bit, as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _block32_weights(block, ok, j, FORMAT: tl.constexpr):
    """A 32-value format's weights, float32 [R, B, 32]: `block` the blocks' first bytes
    [R, B], `ok` their mask [R, B], j the values' places [1, 1, 32]."""
    d = _half(block, ok)[:, :, None]
    at = block[:, :, None]
    mask = ok[:, :, None]
    if FORMAT == 0:  # Q8_0
        byte = tl.load(at + 2 + j, mask=mask, other=0)
        w = byte.to(tl.int8, bitcast=True).to(tl.float32) * d
    else:
        # Values j and j + 16 share byte j % 16: low nibble, then high.
        first = 2 if FORMAT == 1 else 4
        byte = tl.load(at + first + j % 16, mask=mask, other=0)
        nibble = tl.where(j < 16, byte & 15, byte >> 4).to(tl.float32)
        if FORMAT == 1:  # Q4_0
            w = (nibble - 8.0) * d
        else:  # Q4_1: d * q + m
            w = nibble * d + _half(block + 2, ok)[:, :, None]
    return w


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
    FORMAT: tl.constexpr,  # 0: Q8_0, 1: Q4_0, 2: Q4_1
    BLOCK_BYTES: tl.constexpr,  # 34, 18 or 20
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
        w = _block32_weights(block, ok, j[None, None, :], FORMAT)  # [ROWS, BLOCKS, 32]
        xs = tl.load(
            x_ptr + token * stride_xt + b[:, None] * 32 + j[None, :], mask=b_ok[:, None], other=0.0
        ).to(tl.float32)  # [BLOCKS, 32]
        acc += tl.sum(tl.sum(w * xs[None, :, :], axis=2), axis=1)
    tl.store(out_ptr + token * stride_ot + r, acc.to(out_ptr.dtype.element_ty), mask=r_ok)


@triton.jit
def _kquant_weights(block, r_ok, s, t, FORMAT: tl.constexpr):
    """Some of a K-quant super-block's weights, float32 [R, S, SUBLEN]: `block` the rows'
    super-blocks' first bytes [R, 1], `r_ok` their mask [R], s the scales' sub-blocks
    [S] (Q4_K, Q5_K: values 32s.., Q6_K: values 16s..), t a value's place in one [SUBLEN]."""
    ok2 = r_ok[:, None] & (s[None, :] >= 0)  # [R, S]
    ok3 = ok2[:, :, None]
    if FORMAT != 4:  # Q4_K (3), Q5_K (5): sub-block s is values 32s..32s+31
        d = _half(block, r_ok[:, None])  # [R, 1]
        dmin = _half(block + 2, r_ok[:, None])
        scales = block + 4
        a = tl.load(scales + s[None, :], mask=ok2, other=0).to(tl.int32)  # q[s]
        b = tl.load(scales + 4 + s[None, :], mask=ok2, other=0).to(tl.int32)  # q[s + 4]
        c = tl.load(scales + (s % 4)[None, :], mask=ok2, other=0).to(tl.int32)  # q[s - 4]
        low = s[None, :] < 4
        sc = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4)).to(tl.float32)
        mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4)).to(tl.float32)
        quants = 16 if FORMAT == 3 else 48  # Q5_K: qh[32] between the scales and nibbles
        byte = tl.load(
            block[:, :, None] + quants + (s // 2 * 32)[None, :, None] + t[None, None, :],
            mask=ok3,
            other=0,
        )
        q = tl.where((s % 2 == 0)[None, :, None], byte & 15, byte >> 4).to(tl.int32)
        if FORMAT == 5:  # the fifth bit: bit s of qh[t], one byte for all 8 sub-blocks
            qh = tl.load(
                block[:, :, None] + 16 + t[None, None, :], mask=r_ok[:, None, None], other=0
            )
            q = q | (((qh.to(tl.int32) >> s[None, :, None]) & 1) << 4)  # [R, S, SUBLEN]
        w = (d * sc)[:, :, None] * q.to(tl.float32) - (dmin * mn)[:, :, None]  # [R, S, SUBLEN]
    else:  # Q6_K: scale s covers values 16s..16s+15, of half h, group g, at place
        h = s // 8
        g = s % 8 // 2
        place = (s % 2 * 16)[:, None] + t[None, :]  # [S, SUBLEN]
        low_at = (h * 64 + g % 2 * 32)[:, None] + place
        ql = tl.load(block[:, :, None] + low_at[None, :, :], mask=ok3, other=0).to(tl.int32)
        nibble = tl.where((g < 2)[None, :, None], ql & 15, ql >> 4)
        high_at = 128 + (h * 32)[:, None] + place
        qh = tl.load(block[:, :, None] + high_at[None, :, :], mask=ok3, other=0).to(tl.int32)
        high = (qh >> (2 * g)[None, :, None]) & 3
        q = (nibble | (high << 4)) - 32
        sc = tl.load(block + 192 + s[None, :], mask=ok2, other=0)
        sc = sc.to(tl.int8, bitcast=True).to(tl.float32)  # [R, S]
        d = _half(block + 208, r_ok[:, None])  # [R, 1]
        w = (d * sc)[:, :, None] * q.to(tl.float32)
    return w


@triton.jit
def _kquant_gemv_kernel(
    x_ptr,  # [tokens, in_features] float
    w_ptr,  # [rows, row_bytes] uint8: each row's super-blocks
    out_ptr,  # [tokens, rows] like x
    rows,
    in_features,
    stride_xt,
    stride_wr,
    stride_ot,
    FORMAT: tl.constexpr,  # 3: Q4_K, 4: Q6_K, 5: Q5_K
    BLOCK_BYTES: tl.constexpr,  # 144, 210 or 176
    ROWS: tl.constexpr,  # output rows a program
    SUBS: tl.constexpr,  # scales a super-block: 8 (Q4_K, Q5_K) or 16 (Q6_K)
    SUBLEN: tl.constexpr,  # values a scale: 32 or 16
):
    row_tile = tl.program_id(0)
    token = tl.program_id(1)
    r = row_tile * ROWS + tl.arange(0, ROWS)  # [ROWS]
    r_ok = r < rows
    s = tl.arange(0, SUBS)  # [SUBS]: a scale's sub-block
    t = tl.arange(0, SUBLEN)  # [SUBLEN]: a value's place in it
    acc = tl.zeros([ROWS], dtype=tl.float32)
    w_rows = w_ptr + r.to(tl.int64)[:, None] * stride_wr  # [ROWS, 1]
    for sb in range(0, in_features // 256):
        block = w_rows + sb * BLOCK_BYTES  # [ROWS, 1]
        xs = tl.load(x_ptr + token * stride_xt + sb * 256 + s[:, None] * SUBLEN + t[None, :])
        xs = xs.to(tl.float32)  # [SUBS, SUBLEN]
        w = _kquant_weights(block, r_ok, s, t, FORMAT)  # [ROWS, SUBS, SUBLEN]
        acc += tl.sum(tl.sum(w * xs[None, :, :], axis=2), axis=1)
    tl.store(out_ptr + token * stride_ot + r, acc.to(out_ptr.dtype.element_ty), mask=r_ok)


@triton.jit
def _quant_gemm_kernel(
    x_ptr,  # [tokens, in_features] float
    w_ptr,  # [rows, row_bytes] uint8
    out_ptr,  # [tokens, rows] like x
    tokens,
    rows,
    in_features,
    stride_xt,
    stride_wr,
    stride_ot,
    FORMAT: tl.constexpr,  # 0: Q8_0, 1: Q4_0, 2: Q4_1, 3: Q4_K, 4: Q6_K, 5: Q5_K
    BLOCK_BYTES: tl.constexpr,
    SUBLEN: tl.constexpr,  # values a scale: 32 (and the 32-value formats), 16 (Q6_K)
    BM: tl.constexpr,  # token rows a program
    BN: tl.constexpr,  # weight rows (output columns) a program
    BK: tl.constexpr,  # input values a step, a multiple of 32
    IEEE: tl.constexpr,  # float32 dots in full precision (else the dtype's tensor cores)
    UPCAST: tl.constexpr,  # widen 16-bit dot operands to float32 (the interpreter)
):
    m = tl.program_id(0) * BM + tl.arange(0, BM)  # [BM]
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
    m_ok, n_ok = m < tokens, n < rows
    kb = tl.arange(0, BK // 32)  # [BK / 32]: the step's blocks
    j = tl.arange(0, 32)
    k = tl.arange(0, BK)  # [BK]
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wr  # [BN, 1]
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xt  # [BM, 1]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for first in range(0, in_features, BK):
        if FORMAT < 3:
            b = first // 32 + kb  # [BK / 32]
            b_ok = b < in_features // 32
            ok = n_ok[:, None] & b_ok[None, :]  # [BN, BK / 32]
            w = _block32_weights(w_rows + b[None, :] * BLOCK_BYTES, ok, j[None, None, :], FORMAT)
        else:  # BK values of one super-block (BK divides 256 and in_features is whole ones)
            block = w_rows + first // 256 * BLOCK_BYTES  # [BN, 1]
            s = first % 256 // SUBLEN + tl.arange(0, BK // SUBLEN)  # [BK / SUBLEN]
            w = _kquant_weights(block, n_ok, s, tl.arange(0, SUBLEN), FORMAT)
        w = tl.reshape(w, [BN, BK]).to(x_ptr.dtype.element_ty)  # value first + i at i
        x_ok = m_ok[:, None] & (first + k < in_features)[None, :]
        xs = tl.load(x_rows + first + k[None, :], mask=x_ok, other=0.0)  # [BM, BK]
        if UPCAST:  # the same rounded operands, as float32
            w = w.to(tl.float32)
            xs = xs.to(tl.float32)
        if IEEE or UPCAST:
            acc = tl.dot(xs, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(xs, tl.trans(w), acc)
    out = out_ptr + m.to(tl.int64)[:, None] * stride_ot + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _quant_rows_kernel(
    ids_ptr,  # [count] int64: the rows to look up (token ids)
    w_ptr,  # [rows, row_bytes] uint8: each row's blocks
    out_ptr,  # [count, in_features] float
    count,
    in_features,
    stride_wr,
    stride_or,
    FORMAT: tl.constexpr,  # 0-5 as the GEMM's
    BLOCK_BYTES: tl.constexpr,
    ROWS: tl.constexpr,  # looked-up rows a program
    BLOCKS: tl.constexpr,  # 32-value blocks a program (the 32-value formats)
    SUBS: tl.constexpr,  # scales a super-block (the K-quants)
    SUBLEN: tl.constexpr,  # values a scale
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    r_ok = r < count
    ids = tl.load(ids_ptr + r, mask=r_ok, other=0)
    w_rows = w_ptr + ids.to(tl.int64)[:, None] * stride_wr  # [ROWS, 1]
    out_rows = out_ptr + r.to(tl.int64)[:, None, None] * stride_or  # [ROWS, 1, 1]
    if FORMAT < 3:
        b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)  # [BLOCKS]
        ok = r_ok[:, None] & (b < in_features // 32)[None, :]  # [ROWS, BLOCKS]
        j = tl.arange(0, 32)[None, None, :]
        w = _block32_weights(w_rows + b[None, :] * BLOCK_BYTES, ok, j, FORMAT)
        at = out_rows + b[None, :, None] * 32 + j  # [ROWS, BLOCKS, 32]
        w = tl.where(w == 0.0, 0.0, w)  # d * 0 with d < 0 is -0.0; the dequantizer's is +0.0
        tl.store(at, w.to(out_ptr.dtype.element_ty), mask=ok[:, :, None])
    else:  # one super-block of each row a program
        sb = tl.program_id(1)
        s = tl.arange(0, SUBS)
        t = tl.arange(0, SUBLEN)
        w = _kquant_weights(w_rows + sb * BLOCK_BYTES, r_ok, s, t, FORMAT)  # [ROWS, SUBS, SUBLEN]
        at = out_rows + sb * 256 + s[None, :, None] * SUBLEN + t[None, None, :]
        w = tl.where(w == 0.0, 0.0, w)  # as above
        tl.store(at, w.to(out_ptr.dtype.element_ty), mask=r_ok[:, None, None])


@dataclass(frozen=True)
class QuantLaunch:
    """One launch of a quantized product: grid, arguments in the kernel's order,
    constexprs and compile options (the compile table builds the same)."""

    kernel: Any  # a triton.JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    options: dict[str, Any]


def gemv_launch(
    x: torch.Tensor, blocks: torch.Tensor, format_id: int, in_features: int, out: torch.Tensor
) -> QuantLaunch:
    """The launch quant_gemv makes for these (checked) arguments."""
    fmt = _FORMATS[format_id]
    rows = blocks.shape[0]
    args = (x, blocks, out, rows, in_features, x.stride(0), blocks.stride(0), out.stride(0))
    common = {"FORMAT": fmt.kind, "BLOCK_BYTES": fmt.block_bytes, "num_warps": 4, "num_stages": 2}
    # 16 rows a program: a 4096-row weight makes 256 programs a token, two for each of an
    # H100's SMs. Untimed: no GPU yet.
    tile_rows = 16
    grid = (triton.cdiv(rows, tile_rows), x.shape[0])
    if fmt.values == 32:
        # 16 rows x 8 blocks: [16, 8, 32] quants, 32 a thread on 4 warps, 64 registers on
        # sm_80 and sm_90a (64 rows x 4 blocks took 218-255: two programs an SM at most);
        # a row's 8 blocks a step are 272 contiguous bytes in Q8_0.
        options = {**common, "ROWS": tile_rows, "BLOCKS": 8}
        return QuantLaunch(_quant_gemv_kernel, grid, args, options)
    # One super-block of 256 values a row a step: [16, 256] weights, as the 32-value
    # formats' 8 blocks.
    subs, sublen = (16, 16) if fmt.kind == 4 else (8, 32)
    options = {**common, "ROWS": tile_rows, "SUBS": subs, "SUBLEN": sublen}
    return QuantLaunch(_kquant_gemv_kernel, grid, args, options)


def gemm_launch(
    x: torch.Tensor, blocks: torch.Tensor, format_id: int, in_features: int, out: torch.Tensor
) -> QuantLaunch:
    """The launch quant_gemm makes for these (checked) arguments."""
    fmt = _FORMATS[format_id]
    tokens, rows = x.shape[0], blocks.shape[0]
    wide = x.dtype != torch.float32
    # 16-bit: [16, 64] outputs, 64 values a step (two blocks): the dequantized [64, 64]
    # tile and x's [16, 64] feed the tensor cores, on 8 warps (no spill on the four
    # architectures; [32, 64] on 4 warps hit 255 registers and spilled 24 B a thread on
    # sm_80, and on 8 warps ptxas held sm_90a to 80 registers and spilled 8 B). float32
    # dots run IEEE on the FMA units: a [16, 32] tile, 32 values a step, 4 warps.
    # Untimed: no GPU yet.
    bm, bn, bk, warps = (16, 64, 64, 8) if wide else (16, 32, 32, 4)
    args = (
        x,
        blocks,
        out,
        tokens,
        rows,
        in_features,
        x.stride(0),
        blocks.stride(0),
        out.stride(0),
    )
    options = {
        "FORMAT": fmt.kind,
        "BLOCK_BYTES": fmt.block_bytes,
        "SUBLEN": 16 if fmt.kind == 4 else 32,
        "BM": bm,
        "BN": bn,
        "BK": bk,
        "IEEE": not wide,
        # The interpreter (CPU tensors) computes no bfloat16 tl.dot (numpy has none;
        # triton-lang/triton#11584): see triton_attention's UPCAST.
        "UPCAST": wide and x.device.type == "cpu",
        "num_warps": warps,
        "num_stages": 2,
    }
    grid = (triton.cdiv(tokens, bm), triton.cdiv(rows, bn))
    return QuantLaunch(_quant_gemm_kernel, grid, args, options)


def _checked(x: torch.Tensor, blocks: torch.Tensor, format_id: int, in_features: int) -> _Format:
    """The format of these arguments (ValueError naming what does not fit)."""
    if format_id not in _FORMATS:
        names = "Q8_0 (8), Q4_0 (2), Q4_1 (3), Q4_K (12), Q5_K (13) or Q6_K (14)"
        raise ValueError(f"the Triton products take {names} blocks, not GGML type {format_id}")
    if x.dtype not in _DTYPES or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [tokens, {in_features}] of {_DTYPES}: {x.dtype} {x.shape}")
    fmt = _FORMATS[format_id]
    if in_features % fmt.values or blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(f"blocks must be 2-D uint8 rows of whole {fmt.values}-value blocks")
    if blocks.shape[1] != in_features // fmt.values * fmt.block_bytes or blocks.stride(1) != 1:
        raise ValueError(f"rows of {blocks.shape[1]} bytes do not hold {in_features} values")
    if x.stride(1) != 1:
        raise ValueError("x needs contiguous rows")
    return fmt


def _run(
    make: Any,
    x: torch.Tensor,
    blocks: torch.Tensor,
    format_id: int,
    in_features: int,
    out: torch.Tensor | None,
) -> torch.Tensor:
    _checked(x, blocks, format_id, in_features)
    if out is None:
        out = torch.empty(x.shape[0], blocks.shape[0], dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or blocks.shape[0] == 0:
        return out
    launch = make(x, blocks, format_id, in_features, out)
    launch.kernel[launch.grid](*launch.args, **launch.options)
    return out


def quant_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    format_id: int,
    in_features: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [tokens, in_features] times a block-quantized weight (`blocks` [rows, row_bytes]
    uint8 of GGML type `format_id`: 8 Q8_0, 2 Q4_0, 3 Q4_1, 12 Q4_K, 13 Q5_K, 14 Q6_K)
    transposed
    -> [tokens, rows] in x's dtype (float32 sums). For decode's few rows: each token row
    reads the weight again (from L2 after the first)."""
    return _run(gemv_launch, x, blocks, format_id, in_features, out)


def quant_gemm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    format_id: int,
    in_features: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """quant_gemv's product for prefill's many rows (every format it takes): each weight tile
    dequantized once for BM rows and multiplied on the tensor cores in x's dtype (the
    weight rounded to it, as the dense path's would be)."""
    if format_id not in _GEMM_FORMATS:
        raise ValueError(f"quant_gemm takes no blocks of GGML type {format_id}")
    return _run(gemm_launch, x, blocks, format_id, in_features, out)


def quant_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    format_id: int,
    in_features: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The product a quantized linear layer runs on the GPU: the GEMM from GEMM_TOKENS
    rows on, the GEMV below."""
    if x.shape[0] >= GEMM_TOKENS and format_id in _GEMM_FORMATS:
        return quant_gemm(x, blocks, format_id, in_features, out)
    return quant_gemv(x, blocks, format_id, in_features, out)


def rows_launch(
    blocks: torch.Tensor, format_id: int, in_features: int, ids: torch.Tensor, out: torch.Tensor
) -> QuantLaunch:
    """The launch quant_rows makes for these (checked) arguments."""
    fmt = _FORMATS[format_id]
    count = ids.shape[0]
    # 4 rows a program (a prompt's tokens; decode looks up one a sequence), 8 blocks or one
    # super-block of each: [4, 256] values, as the GEMV's tiles. Untimed: no GPU yet.
    tile_rows, tile_blocks = 4, 8
    subs, sublen = (16, 16) if fmt.kind == 4 else (8, 32)
    steps = triton.cdiv(in_features // 32, tile_blocks) if fmt.values == 32 else in_features // 256
    args = (ids, blocks, out, count, in_features, blocks.stride(0), out.stride(0))
    options = {
        "FORMAT": fmt.kind,
        "BLOCK_BYTES": fmt.block_bytes,
        "ROWS": tile_rows,
        "BLOCKS": tile_blocks,
        "SUBS": subs,
        "SUBLEN": sublen,
        "num_warps": 4,
        "num_stages": 1,
    }
    return QuantLaunch(_quant_rows_kernel, (triton.cdiv(count, tile_rows), steps), args, options)


def quant_rows(
    blocks: torch.Tensor,
    format_id: int,
    in_features: int,
    ids: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows `ids` of a block-quantized weight (an embedding table's tokens), dequantized on
    the weight's device: [len(ids), in_features] in `dtype`, each value the CPU
    dequantizer's float32 rounded once to `dtype`. Only the looked-up rows are read: the
    table stays in its blocks."""
    if dtype not in _DTYPES:
        raise ValueError(f"quant_rows writes {_DTYPES}, not {dtype}")
    ids = ids.to(device=blocks.device, dtype=torch.int64).contiguous().view(-1)
    x = torch.empty(0, in_features, dtype=dtype, device=blocks.device)  # checks the weight
    _checked(x, blocks, format_id, in_features)
    # The interpreter (CPU tensors) rounds float32 to bfloat16 toward zero (numpy has no
    # bfloat16); a GPU rounds to nearest even, as the dequantizer does: there the kernel
    # writes float32 and torch rounds it.
    interpreted = blocks.device.type == "cpu" and dtype == torch.bfloat16
    written = torch.float32 if interpreted else dtype
    out = torch.empty(ids.shape[0], in_features, dtype=written, device=blocks.device)
    if ids.shape[0] == 0:
        return out.to(dtype)
    launch = rows_launch(blocks, format_id, in_features, ids, out)
    launch.kernel[launch.grid](*launch.args, **launch.options)
    return out.to(dtype)
