"""Paged attention in Triton: decode and chunked prefill read K/V in place through the
block table (the attention of the CUDA path; attention.py routes CUDA tensors here).

One kernel serves both. A step's query rows lie flat ([tokens, heads, head_dim]); each
sequence owns a run of them, the last `query_len` positions of its context, whose earlier
tokens (a cached prefix, earlier chunks) are already in the paged pool like this step's.
A decode is the run of one. Keys are gathered slot by slot from the pool through the
sequence's block table inside the kernel, so no prefix is copied out and no [heads,
queries, context] score matrix is ever stored: scores live one tile at a time in
registers, folded by an online softmax (running max and sum in float32).

Grid: (sequence, KV head, query-row tile). A program takes ROWS query rows of one KV head:
the (token, query head) pairs of that head's GQA group, token-major, so one key tile
loaded serves every query head that shares it; a decode's few rows (its one token's
group) are padded to tl.dot's 16, masked. It walks the keys in tiles of BLOCK_N positions, up to the
last key its rows may see (causal within the chunk). With SINKS (gpt-oss), each query
head's sink logit joins the softmax's sum at the end, as one more key with no value.

Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) runs the same
kernel on CPU tensors; the tests use it. It computes no bfloat16 tl.dot (numpy has no
bfloat16; triton-lang/triton#11584), so there bfloat16 operands are widened to float32
after the same rounding the GPU path does (UPCAST).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:  # attention.py imports this module when it first runs on CUDA
    from appliance.model.layers.paged_attention import AttentionBatch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_DOT = 16  # tl.dot needs at least 16 rows on NVIDIA GPUs


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [tokens, heads, head_dim]
    out_ptr,  # [tokens, heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache_ptr,  # like k_cache (same strides)
    block_tables_ptr,  # [seqs, max_blocks] int: the sequence's blocks in order
    context_lens_ptr,  # [seqs] int: tokens in the cache after this step
    query_starts_ptr,  # [seqs + 1] int: each sequence's first row; read only if VARLEN
    sinks_ptr,  # [heads] float32: each query head's sink logit; read only if SINKS
    query_len,  # queries per sequence (uniform), or the longest (VARLEN)
    qk_scale,  # softmax scale * log2(e): the kernel exponentiates in base 2
    window,  # with WINDOWED: each query sees its last `window` keys only
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (tl.arange)
    GROUP: tl.constexpr,  # query heads per KV head
    ROWS: tl.constexpr,  # (token, query head) pairs per program, a power of two >= 16
    BLOCK_N: tl.constexpr,  # keys per loop step
    VARLEN: tl.constexpr,  # query runs from query_starts, else query_len rows per sequence
    WINDOWED: tl.constexpr,  # a sliding window (`window`)
    SINKS: tl.constexpr,  # a sink logit per query head in each softmax's denominator
    UPCAST: tl.constexpr,  # widen 16-bit dot operands to float32 (the interpreter)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" keeps float32 exact (no
    # TF32); None, the backend's default, for 16-bit inputs
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)

    if VARLEN:
        q_start = tl.load(query_starts_ptr + seq)
        q_len = tl.load(query_starts_ptr + seq + 1) - q_start
    else:
        q_start = seq * query_len
        q_len = query_len
    first_row = tile * ROWS
    if first_row >= q_len * GROUP:
        return  # a shorter run than the grid's longest: nothing left for this program
    context_len = tl.load(context_lens_ptr + seq)

    # The program's rows: pair r is query token r // GROUP, head kv_head * GROUP + r % GROUP.
    rows = first_row + tl.arange(0, ROWS)  # [ROWS]
    token = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = token < q_len
    # A query token's position in its sequence: the run is the context's last q_len tokens.
    q_pos = context_len - q_len + token  # [ROWS]
    dims = tl.arange(0, HEAD_PAD)  # [HEAD_PAD]
    dim_ok = dims < HEAD_DIM

    q_offsets = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(
        q_ptr + q_offsets + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0
    )  # [ROWS, HEAD_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    # Online softmax state, float32 whatever the inputs: running max (base 2), running
    # sum of exponentials, and the unnormalized output.
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], dtype=tl.float32)

    # Causal: the program's last valid token sees keys up to its own position, none later.
    last_token = tl.minimum(q_len - 1, (first_row + ROWS - 1) // GROUP)
    key_end = context_len - q_len + last_token + 1
    key_begin = 0
    if WINDOWED:  # from the tile of the first key the program's first token sees
        first_pos = context_len - q_len + first_row // GROUP
        key_begin = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    table = block_tables_ptr + seq * stride_bt
    for key_start in range(key_begin, key_end, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions in the sequence
        key_ok = keys < key_end
        # Each key's slot: its block from the table (any ids, any order), then the offset.
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0)  # [BLOCK_N]
        kv_offsets = (
            block.to(tl.int64)[:, None] * stride_cb
            + (keys % BLOCK_SIZE)[:, None] * stride_cs
            + kv_head * stride_ch
            + dims[None, :]
        )  # [BLOCK_N, HEAD_PAD]
        # Masked loads: slots past the context (a partly filled last block, padding of
        # the table) are never read, whatever they hold.
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_PAD]
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [ROWS, BLOCK_N]
        visible = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
        if WINDOWED:
            visible = visible & (keys[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        # Key 0 is visible to every row (q_pos >= 0; padding rows have q_pos >= context_len),
        # so the first tile makes every row's max finite and later all-masked tiles give
        # exp2(-inf) = 0, never NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [ROWS]
        m_base = m_new
        if WINDOWED:
            # Not so in a window: a row may see nothing of the first tiles. Its max stays
            # -inf; exponents against 0 then give 0 for what it has not seen, not NaN.
            m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_base)  # rescales what was summed under the old max
        p = tl.math.exp2(s - m_base[:, None])  # [ROWS, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # The probabilities enter the second product in the cache's dtype, as in flash
        # attention: a 16-bit dot on the tensor cores, float32 accumulation.
        p_dot = p.to(v_cache_ptr.dtype.element_ty)
        if UPCAST:
            p_dot = p_dot.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=PRECISION)
        m_i = m_new

    if SINKS:
        # The sink (natural log, so times log2(e), as qk_scale is) joins the sum as one
        # more key whose value is zero: the max moves to cover it, the sum gains its term.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
        m_sink = tl.maximum(m_i, sink)  # [ROWS], finite: the sink is
        rescale = tl.math.exp2(m_i - m_sink)
        l_i = l_i * rescale + tl.math.exp2(sink - m_sink)
        acc = acc * rescale[:, None]
    out = acc / l_i[:, None]  # [ROWS, HEAD_PAD]
    o_offsets = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(
        out_ptr + o_offsets + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    query_len: int = 1,
    query_starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [tokens, heads, head_dim] over the paged caches [num_blocks,
    block_size, kv_heads, head_dim] -> like q (written into `out` when given, which may be
    a view such as a row slice of a larger output).

    Sequence i has context_lens[i] tokens in the cache (this step's included), in the
    blocks block_tables[i] ([seqs, max_blocks], any ids in any order, padding past the
    context ignored). Its queries are the last positions of that context, causal among
    themselves: rows i * query_len .. (i + 1) * query_len of q (decode: query_len 1), or,
    with query_starts [seqs + 1], rows query_starts[i] .. query_starts[i + 1] with
    query_len the longest run (it sizes the grid). Integer tensors may be int32 or int64;
    nothing here reads a device tensor back to the host. `window`: each query sees its
    last `window` keys only (itself included), as a sliding-window model's do. `sinks`
    [heads]: each query head's sink logit, in its softmax's denominator (gpt-oss)."""
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q and caches must share one of {_DTYPES}: {q.dtype}, {k_cache.dtype}")
    if heads % kv_heads or k_cache.shape[3] != head_dim or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"q of {heads} heads x {head_dim} does not fit caches {tuple(k_cache.shape)} "
            f"with strides {k_cache.stride()} and {v_cache.stride()}"
        )
    if out is None:
        out = torch.empty_like(q)
    # The kernel steps the head dimension by 1; heads and tokens go by their strides.
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("q, out and the caches need a contiguous head dimension")
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)} for {heads} query heads")
    if block_tables.shape[0] == 0 or tokens == 0:
        return out
    launch = kernel_launch(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        out,
        query_len=query_len,
        query_starts=query_starts,
        window=window,
        sinks=sinks,
        interpreted=q.device.type == "cpu",  # a CPU tensor only runs under the interpreter
    )
    _paged_attention_kernel[launch.grid](*launch.args, **launch.options)
    return out


@dataclass(frozen=True)
class Tiles:
    """A launch's tile sizes and compile options: ROWS (query rows a program), BLOCK_N
    (keys a loop step), num_warps and num_stages (software pipelining of the K/V loads)."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int


def tiles_for(dtype: torch.dtype, head_pad: int, group: int, prefill: bool) -> Tiles:
    """The tiles for this dtype, padded head size, GQA group and phase: tiles that ptxas
    fits in registers without spilling on sm_80, sm_86, sm_89 and sm_90a, and whose
    shared memory fits sm_86/sm_89's 99 KiB a block (benchmarks/triton_compile_table.py
    measures every variant; tests/model/layers/test_triton_compile.py holds them to it)."""
    decode_rows = triton.next_power_of_2(max(_MIN_DOT, group))  # one token's group of heads
    if dtype == torch.float32:
        # IEEE float32 dots run on the FMA units, not the tensor cores, and hold far more
        # in registers: 64 rows x 64 keys spilled 14-75 KB a thread. 8 warps over 32 rows
        # (16 at head 256) and 32 keys spill nothing.
        rows = (32 if head_pad <= 128 else 16) if prefill else decode_rows
        return Tiles(rows, 32, num_warps=8, num_stages=2)
    if not prefill:
        return Tiles(decode_rows, 64, num_warps=4, num_stages=3)
    # A 16-bit prefill: 64 (token, head) pairs a program on the tensor cores. Keys of 64
    # at head 128 reached 255 registers and spilled on Ampere/Ada; at head 256 three
    # pipelined stages of 64 keys took 104 KiB of shared memory on Ampere/Ada, over
    # sm_86/89's limit, and 4 warps spilled even with 32 keys: 8 share its accumulator.
    if head_pad <= 128:
        return Tiles(64, 64 if head_pad <= 64 else 32, num_warps=4, num_stages=3)
    return Tiles(64, 32, num_warps=8, num_stages=2)


@dataclass(frozen=True)
class KernelLaunch:
    """One launch of the kernel: its grid, its arguments in the kernel's order, and its
    constexprs and compile options (num_warps, num_stages) by name. paged_attention runs
    it; tests/model/layers/test_triton_compile.py compiles the same specializations for
    GPUs that are not here (benchmarks/triton_compile_table.py)."""

    grid: tuple[int, int, int]
    args: tuple[Any, ...]
    options: dict[str, Any]


def kernel_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    query_len: int,
    query_starts: torch.Tensor | None,
    window: int | None,
    sinks: torch.Tensor | None,
    interpreted: bool,
) -> KernelLaunch:
    """The launch paged_attention makes for these (checked) arguments; `interpreted`:
    under Triton's interpreter (CPU tensors), where 16-bit dots are widened (UPCAST)."""
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[2]
    head_pad = triton.next_power_of_2(head_dim)
    tiles = tiles_for(q.dtype, head_pad, group, prefill=query_len > 1)
    args = (
        q,
        out,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_starts if query_starts is not None else context_lens,  # unread unless VARLEN
        sinks.float().contiguous() if sinks is not None else context_lens,  # unread unless SINKS
        query_len,
        scale * math.log2(math.e),
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
    )
    options = {
        "BLOCK_SIZE": k_cache.shape[1],
        "HEAD_DIM": head_dim,
        "HEAD_PAD": head_pad,
        "GROUP": group,
        "ROWS": tiles.rows,
        "BLOCK_N": tiles.block_n,
        "VARLEN": query_starts is not None,
        "WINDOWED": window is not None,
        "SINKS": sinks is not None,
        "UPCAST": interpreted and q.dtype == torch.bfloat16,
        "PRECISION": "ieee" if q.dtype == torch.float32 else None,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }
    grid = (block_tables.shape[0], k_cache.shape[2], triton.cdiv(query_len * group, tiles.rows))
    return KernelLaunch(grid, args, options)


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """attention.paged_attention on the kernel: q [tokens, heads, head_dim] -> like q, the
    step's K/V already in the caches. One launch per prefill segment and per decode group
    (one group when the model runner makes one, as it may: the kernel takes any mix of
    context lengths). `window`: each query sees its last `window` keys only; `sinks`
    [heads]: each head's sink logit."""
    out = torch.empty_like(q)
    for seg in batch.prefills:
        rows = slice(seg.start, seg.start + seg.length)
        # A fill kernel, not a host-to-device copy: no sync with the device.
        context_len = torch.full((1,), seg.context_len, dtype=torch.int32, device=q.device)
        paged_attention(
            q[rows],
            k_cache,
            v_cache,
            seg.block_table[None],  # [1, blocks]
            context_len,
            scale,
            query_len=seg.length,
            out=out[rows],
            window=window,
            sinks=sinks,
        )
    decode_q, decode_out = q[batch.decode_start :], out[batch.decode_start :]
    for group in batch.decode_groups:
        if group.rows is None:  # every decode row, in order: written in place
            tables, lens = group.block_tables, group.context_lens
            paged_attention(
                decode_q,
                k_cache,
                v_cache,
                tables,
                lens,
                scale,
                out=decode_out,
                window=window,
                sinks=sinks,
            )
        else:
            result = paged_attention(
                decode_q.index_select(0, group.rows),
                k_cache,
                v_cache,
                group.block_tables,
                group.context_lens,
                scale,
                window=window,
                sinks=sinks,
            )
            decode_out.index_copy_(0, group.rows, result)
    return out
