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

With SPLIT (flash-decoding, for decode and verify launches that leave SMs idle: the
split count is triton_splits.decode_splits'), grid axis 2 runs over (tile, part): each
program walks one part of its keys and writes that part's softmax (running max, sum,
unnormalized output, float32) to a workspace; _split_reduce_kernel then folds the
parts of each (token, query head), and the sink, into the output.

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

from appliance.model.layers.triton_splits import H100_SMS, MAX_SPLITS, decode_splits

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
    part_out_ptr,  # [tokens, heads, splits, HEAD_PAD] float32: written only if SPLIT
    part_m_ptr,  # [tokens, heads, splits] float32 (a part's running max): only if SPLIT
    part_l_ptr,  # [tokens, heads, splits] float32 (a part's sum): only if SPLIT
    splits,  # parts each program's keys are split into (1 unless SPLIT)
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
    SPLIT: tl.constexpr,  # write a partial softmax per part (flash-decoding), no output
    UPCAST: tl.constexpr,  # widen 16-bit dot operands to float32 (the interpreter)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" keeps float32 exact (no
    # TF32); None, the backend's default, for 16-bit inputs
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    part = 0
    if SPLIT:  # grid axis 2 runs tile-major over (tile, part)
        part = tile % splits
        tile = tile // splits

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
    if SPLIT:
        # This part's share of the keys, in whole tiles: the parts of a short context
        # past its end walk nothing and write an empty softmax (max -inf, sum 0).
        span = tl.cdiv(tl.cdiv(key_end - key_begin, splits), BLOCK_N) * BLOCK_N
        key_begin = key_begin + part * span
        key_end = tl.minimum(key_end, key_begin + span)
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
        if WINDOWED or SPLIT:
            # Not so in a window, nor in a part of the keys: a row may see nothing of the
            # first tiles (or of its part). Its max stays -inf; exponents against 0 then
            # give 0 for what it has not seen, not NaN.
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

    if SPLIT:
        # The part's softmax as it stands: _split_reduce_kernel rescales and sums the
        # parts of each row (and adds the sink there).
        heads_total = tl.num_programs(1) * GROUP
        slot = ((q_start + token) * heads_total + head) * splits + part  # [ROWS]
        tl.store(part_m_ptr + slot, m_i, mask=row_ok)
        tl.store(part_l_ptr + slot, l_i, mask=row_ok)
        tl.store(part_out_ptr + slot[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])
    else:
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


@triton.jit
def _split_reduce_kernel(
    part_out_ptr,  # [tokens, heads, splits, HEAD_PAD] float32: each part's unnormalized output
    part_m_ptr,  # [tokens, heads, splits] float32: each part's running max (base 2)
    part_l_ptr,  # [tokens, heads, splits] float32: each part's sum of exponentials
    sinks_ptr,  # [heads] float32: each query head's sink logit; read only if SINKS
    out_ptr,  # [tokens, heads, head_dim]
    heads,
    splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,  # splits rounded up to a power of two
    SINKS: tl.constexpr,
):
    """One (token, query head) a program: the parts' softmaxes folded into one, as the
    online softmax folds tiles (each part rescaled from its max to the common one)."""
    row = tl.program_id(0)  # token * heads + head
    token = row // heads
    head = row % heads
    parts = tl.arange(0, SPLIT_PAD)
    part_ok = parts < splits
    slot = row * splits + parts  # [SPLIT_PAD]
    m = tl.load(part_m_ptr + slot, mask=part_ok, other=float("-inf"))
    sums = tl.load(part_l_ptr + slot, mask=part_ok, other=0.0)
    # Finite: the part holding the row's own key saw at least that key.
    m_all = tl.max(m, axis=0)
    if SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    weight = tl.math.exp2(m - m_all)  # [SPLIT_PAD]; 0 for an empty part (max -inf)
    total = tl.sum(sums * weight, axis=0)
    if SINKS:
        total += tl.math.exp2(sink - m_all)
    dims = tl.arange(0, HEAD_PAD)
    acc = tl.load(
        part_out_ptr + slot[:, None] * HEAD_PAD + dims[None, :], mask=part_ok[:, None], other=0.0
    )  # [SPLIT_PAD, HEAD_PAD]
    out = tl.sum(acc * weight[:, None], axis=0) / total  # [HEAD_PAD]
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
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
    splits: int | None = None,
    sm_count: int | None = None,
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
    [heads]: each query head's sink logit, in its softmax's denominator (gpt-oss).

    `splits`: parts each sequence's keys are split into (flash-decoding: a partial
    softmax per part, then one reduce launch); None lets decode_splits choose from the
    launch's programs, the table's width and `sm_count` (the device's SMs; an H100's
    where there is no GPU). Only a launch on the decode tiles (a token's or a verify
    chunk's few rows a sequence) splits; a prefill launch has programs enough."""
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
    if splits is not None and not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be 1 to {MAX_SPLITS}, not {splits}")
    if block_tables.shape[0] == 0 or tokens == 0:
        return out
    if splits is None:
        sms = sm_count or (
            torch.cuda.get_device_properties(q.device).multi_processor_count
            if q.device.type == "cuda"
            else H100_SMS
        )
        splits = choose_splits(q, k_cache, block_tables, query_len, sms)
    launches = kernel_launches(
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
        splits=splits,
    )
    for launch in launches:
        launch.kernel[launch.grid](*launch.args, **launch.options)
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
    decode_rows = _decode_rows(group)
    if dtype == torch.float32:
        # IEEE float32 dots run on the FMA units, not the tensor cores, and hold far more
        # in registers: 64 rows x 64 keys spilled 14-75 KB a thread. The varlen prefill
        # (one launch a step) spilled 4-20 B a thread at 32 rows (head 64, Triton 3.6;
        # heads 128 and 256 on sm_80, 3.9) and at 8 warps of 16 x 16 at head 256 (3.6),
        # where ptxas held 8 warps to 64-80 registers: 16 rows x 32 keys on 8 warps, and
        # 16 x 16 on 4 at head 256 (108 registers), spill nothing on all four, both.
        if prefill:
            if head_pad <= 128:
                return Tiles(16, 32, num_warps=8, num_stages=2)
            return Tiles(16, 16, num_warps=4, num_stages=2)
        return Tiles(decode_rows, 32, num_warps=8, num_stages=2)
    if not prefill:
        return Tiles(decode_rows, 64, num_warps=4, num_stages=3)
    # A 16-bit prefill: 64 (token, head) pairs a program on the tensor cores. Keys of 64
    # at head 128 reached 255 registers and spilled on Ampere/Ada; at head 256 three
    # pipelined stages of 64 keys took 104 KiB of shared memory on Ampere/Ada, over
    # sm_86/89's limit, and 4 warps spilled even with 32 keys: 8 share its accumulator.
    if head_pad <= 128:
        return Tiles(64, 64 if head_pad <= 64 else 32, num_warps=4, num_stages=3)
    return Tiles(64, 32, num_warps=8, num_stages=2)


def _decode_rows(group: int) -> int:
    """A decode program's rows: one token's group of query heads, padded to tl.dot's 16."""
    return int(triton.next_power_of_2(max(_MIN_DOT, group)))


def is_prefill(query_len: int, group: int) -> bool:
    """Whether a launch of up to `query_len` tokens a sequence runs the prefill tiles:
    when its rows a sequence (tokens x query heads of a KV head) overflow a decode
    program's. A decode, and a speculative verify chunk of a few tokens at a small GQA
    group, stay on the decode tiles (and may split over the context)."""
    return query_len * group > _decode_rows(group)


def choose_splits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_len: int,
    sm_count: int,
) -> int:
    """decode_splits for this launch: 1 on the prefill tiles; else from its programs
    (sequences x KV heads x row tiles) and its longest possible context (the tables'
    width in keys: known on the host, no read of the device's context lengths)."""
    group = q.shape[1] // k_cache.shape[2]
    if is_prefill(query_len, group):
        return 1
    rows = tiles_for(q.dtype, triton.next_power_of_2(q.shape[2]), group, False).rows
    programs = block_tables.shape[0] * k_cache.shape[2] * triton.cdiv(query_len * group, rows)
    return decode_splits(programs, block_tables.shape[1] * k_cache.shape[1], sm_count)


@dataclass(frozen=True)
class KernelLaunch:
    """One launch of a kernel: the kernel, its grid, its arguments in the kernel's order,
    and its constexprs and compile options (num_warps, num_stages) by name.
    paged_attention runs it; tests/model/layers/test_triton_compile.py compiles the same
    specializations for GPUs that are not here (benchmarks/triton_compile_table.py)."""

    kernel: Any  # a triton.JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    options: dict[str, Any]


def kernel_launches(
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
    splits: int = 1,
) -> tuple[KernelLaunch, ...]:
    """The launches paged_attention makes for these (checked) arguments: the attention
    kernel, and with `splits` > 1 the reduce after it (the parts' workspace allocated
    here); `interpreted`: under Triton's interpreter (CPU tensors), where 16-bit dots are
    widened (UPCAST)."""
    tokens, heads, head_dim = q.shape
    group = heads // k_cache.shape[2]
    head_pad = triton.next_power_of_2(head_dim)
    tiles = tiles_for(q.dtype, head_pad, group, prefill=is_prefill(query_len, group))
    sinks32 = sinks.float().contiguous() if sinks is not None else None
    unread = context_lens  # stands in for a pointer the specialization never reads
    split = splits > 1
    if split:
        part_out = torch.empty(
            tokens, heads, splits, head_pad, dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(2, tokens, heads, splits, dtype=torch.float32, device=q.device)
        parts: tuple[Any, ...] = (part_out, part_ml[0], part_ml[1])
    else:
        parts = (unread, unread, unread)
    args = (
        q,
        out,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_starts if query_starts is not None else unread,  # read only if VARLEN
        sinks32 if sinks32 is not None else unread,  # read only if SINKS
        *parts,
        splits,
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
        "SINKS": sinks is not None and not split,  # a split's sink is the reduce's
        "SPLIT": split,
        "UPCAST": interpreted and q.dtype == torch.bfloat16,
        "PRECISION": "ieee" if q.dtype == torch.float32 else None,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }
    row_tiles = triton.cdiv(query_len * group, tiles.rows)
    grid = (block_tables.shape[0], k_cache.shape[2], row_tiles * splits)
    attention = KernelLaunch(_paged_attention_kernel, grid, args, options)
    if not split:
        return (attention,)
    reduce = KernelLaunch(
        _split_reduce_kernel,
        (tokens * heads,),
        (
            *parts,
            sinks32 if sinks32 is not None else unread,
            out,
            heads,
            splits,
            out.stride(0),
            out.stride(1),
        ),
        {
            "HEAD_DIM": head_dim,
            "HEAD_PAD": head_pad,
            "SPLIT_PAD": triton.next_power_of_2(splits),
            "SINKS": sinks is not None,
            "num_warps": 4,
            "num_stages": 1,
        },
    )
    return (attention, reduce)


@dataclass(frozen=True)
class SegmentRun:
    """Prefill segments attended in one varlen launch: consecutive rows of the step's
    batch, one kind (prompt chunks, or verify chunks), their metadata on the device."""

    start: int  # first row of the run in the step's batch
    stop: int  # one past its last row
    query_len: int  # the longest segment's tokens (sizes the grid)
    query_starts: torch.Tensor  # [segs + 1] int64, rows relative to `start`
    block_tables: torch.Tensor  # [segs, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [segs] int64


def segment_runs(batch: AttentionBatch, device: torch.device) -> list[SegmentRun]:
    """The step's prefill segments as varlen launches: the prompt chunks (rows before
    batch.prompt_rows) in one, the speculative verify chunks after them in another,
    each split further only where its rows are not consecutive. The metadata of every
    run goes up in one host-to-device copy (pinned, not blocking) and the tables are
    packed on the device (one cat, one scatter): a few launches a step, then one launch
    a layer a run."""
    segments = batch.prefills
    if not segments:
        return []
    kinds = [batch.prompt_rows is None or seg.start < batch.prompt_rows for seg in segments]
    groups: list[list[int]] = []  # indices into segments, each group one run
    for i, seg in enumerate(segments):
        prev = segments[i - 1] if i else None
        joins = (
            prev is not None and kinds[i] == kinds[i - 1] and prev.start + prev.length == seg.start
        )
        if joins:
            groups[-1].append(i)
        else:
            groups.append([i])
    widths = [int(seg.block_table.shape[0]) for seg in segments]
    width = max(widths)
    values: list[int] = []
    for group in groups:  # each run's query starts, relative to its first row
        base = segments[group[0]].start
        values.extend(segments[i].start - base for i in group)
        end = segments[group[-1]]
        values.append(end.start + end.length - base)
    values.extend(seg.context_len for seg in segments)
    # Where each table entry goes in the padded [segs, width] table, flattened.
    values.extend(i * width + j for i, w in enumerate(widths) for j in range(w))
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()  # a copy from pageable memory would wait for the device
    meta = host.to(device, non_blocking=True)
    flat = torch.cat([seg.block_table for seg in segments]).to(torch.int64)  # [sum(widths)]
    n = len(segments)
    tables = torch.zeros(n * width, dtype=torch.int64, device=device)
    tables = tables.index_copy_(0, meta[-len(flat) :], flat).view(n, width)
    contexts = meta[len(values) - len(flat) - n : len(values) - len(flat)]
    runs: list[SegmentRun] = []
    offset = 0
    for group in groups:
        first, last = segments[group[0]], segments[group[-1]]
        runs.append(
            SegmentRun(
                start=first.start,
                stop=last.start + last.length,
                query_len=max(segments[i].length for i in group),
                query_starts=meta[offset : offset + len(group) + 1],
                block_tables=tables[group[0] : group[-1] + 1],
                context_lens=contexts[group[0] : group[-1] + 1],
            )
        )
        offset += len(group) + 1
    return runs


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    sm_count: int | None = None,
) -> torch.Tensor:
    """attention.paged_attention on the kernel: q [tokens, heads, head_dim] -> like q, the
    step's K/V already in the caches. One varlen launch for the step's prompt chunks and
    one for its verify chunks (segment_runs, made on the first layer and kept on the
    batch for the others), one per decode group (one group when the model runner makes
    one, as it may: the kernel takes any mix of context lengths); a launch on the decode
    tiles may split over the context and add its reduce. `window`: each query sees its
    last `window` keys only; `sinks` [heads]: each head's sink logit; `sm_count`: the
    SMs splits are chosen for (None: the device's)."""
    out = torch.empty_like(q)
    if batch.prefills:
        runs = batch.kernel_plan
        if not isinstance(runs, list):
            runs = batch.kernel_plan = segment_runs(batch, q.device)
        for run in runs:
            rows = slice(run.start, run.stop)
            paged_attention(
                q[rows],
                k_cache,
                v_cache,
                run.block_tables,
                run.context_lens,
                scale,
                query_len=run.query_len,
                query_starts=run.query_starts,
                out=out[rows],
                window=window,
                sinks=sinks,
                sm_count=sm_count,
            )
    decode_q, decode_out = q[batch.decode_start :], out[batch.decode_start :]
    for group in batch.decode_groups:
        in_order = group.rows is None  # every decode row, in order: written in place
        result = paged_attention(
            decode_q if group.rows is None else decode_q.index_select(0, group.rows),
            k_cache,
            v_cache,
            group.block_tables,
            group.context_lens,
            scale,
            out=decode_out if in_order else None,
            window=window,
            sinks=sinks,
            sm_count=sm_count,
        )
        if group.rows is not None:
            decode_out.index_copy_(0, group.rows, result)
    return out
