"""The attention kernels: decode attention read in place from the paged cache
(paged_decode, csrc/paged_decode.c) and the rotary embedding fused with storing a step's
keys and values (rope_store, csrc/rope_store.c), each with the check that says whether it
takes given tensors (`*_takes()`; else the model runs torch ops).

SDPA spends microseconds of set-up per (sequence, KV head) on top of a gather of the
padded context; a rotation and two cache writes are several passes and dispatches per
layer (benchmarks/cpu_kernels_bench.py).
"""

from __future__ import annotations

import torch

from appliance.model.cpu_kernels.loading import DTYPES, compiled, threads

HEAD_SIZES = (64, 128)  # decode attention is compiled for these (unrolled into registers)
MAX_GROUP = 64  # query heads per KV head that decode attention takes (paged_decode.c)


def decodes_ragged(device: torch.device, dtype: torch.dtype, head_dim: int, group: int = 1) -> bool:
    """Whether decode attention on this device, dtype, head size and number of query
    heads per KV head runs on the kernel, which takes sequences of any mix of context
    lengths in one call (SDPA pads them all to the longest, so the model runner first
    groups them by length)."""
    return (
        compiled() is not None
        and device.type == "cpu"
        and dtype in DTYPES
        and head_dim in HEAD_SIZES
        and 1 <= group <= MAX_GROUP
    )


def _decode_problem(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """Why paged_decode() cannot take these tensors, or "" when it can."""
    if q.dim() != 3 or k_cache.dim() != 4:
        return "q must be [n, heads, head_dim] and the caches [blocks, block, kv_heads, dim]"
    if not decodes_ragged(q.device, q.dtype, q.shape[2]):
        return "the kernel runs float32 or bfloat16 CPU tensors of head size 64 or 128"
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k_cache.shape[2]
    grouped = kv_heads >= 1 and heads % kv_heads == 0 and 1 <= heads // kv_heads <= MAX_GROUP
    if k_cache.shape[3] != head_dim or not grouped:
        return (
            f"{heads} query heads of {head_dim} do not fit a cache of {kv_heads} KV heads "
            f"of {k_cache.shape[3]}"
        )
    if any(
        c.shape != k_cache.shape or c.dtype != q.dtype or c.device != q.device
        for c in (k_cache, v_cache)
    ):
        return "the key and value caches must match each other and the queries' dtype"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "the caches must be contiguous"
    if q.stride(1) != head_dim or q.stride(2) != 1:
        return "each query row's heads must be contiguous"
    return ""


def decode_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether paged_decode() can run this decode: CPU tensors of one dtype and head size
    it knows, the caches contiguous and each query row's heads contiguous."""
    return not _decode_problem(q, k_cache, v_cache)


def _contiguous_indices(
    block_tables: torch.Tensor, context_lens: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block tables [n, width] and context lengths [n] of n queries, contiguous for
    the kernel; raises ValueError for any other shape, dtype or device."""
    for name, t, dims in (("block tables", block_tables, 2), ("context lengths", context_lens, 1)):
        if t.dtype != torch.int64 or t.device.type != "cpu" or t.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D int64 CPU tensor")
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    if tables.shape[0] != n or lens.shape[0] != n:
        raise ValueError(f"{n} queries need {n} block tables and context lengths")
    return tables, lens


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    checked: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """q [n, heads, head_dim] (one token per sequence); caches [blocks, block_size,
    kv_heads, head_dim]; block_tables [n, width] and context_lens [n] int64 -> [n, heads,
    head_dim]. Each query attends to its sequence's first context_lens[i] cached tokens,
    or the last `window` of them (a sliding window).
    The kernel checks each context and block id it reads through against the cache.
    `checked`: decode_takes() said yes to q and the caches."""
    problem = "" if checked else _decode_problem(q, k_cache, v_cache)
    if problem:
        raise ValueError(problem)
    n, heads, head_dim = q.shape
    blocks, block_size, kv_heads, _ = k_cache.shape
    tables, lens = _contiguous_indices(block_tables, context_lens, n)
    out = torch.empty(n, heads, head_dim, dtype=q.dtype, device=q.device)
    kernels = compiled()
    assert kernels is not None  # decode_takes() found them loaded
    kernels.paged_decode(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        n,
        heads,
        kv_heads,
        head_dim,
        blocks,
        block_size,
        tables.shape[1],
        q.stride(0),
        window or 0,
        scale,
        DTYPES[q.dtype],
        threads(),
    )
    return out


def _rope_problem(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> str:
    """Why rope_store() cannot take these tensors, or "" when it can."""
    if compiled() is None or qkv.device.type != "cpu" or qkv.dtype not in DTYPES:
        return "the kernel runs float32 or bfloat16 CPU tensors"
    if qkv.dim() != 3 or k_cache.dim() != 4 or qkv.shape[2] % 32:
        return "qkv must be [tokens, heads, head_dim], head_dim a multiple of 32"
    tokens, _, head_dim = qkv.shape
    if k_cache.shape[3] != head_dim or qkv.shape[1] < 2 * k_cache.shape[2]:
        return f"qkv {tuple(qkv.shape)} does not fit a cache of {tuple(k_cache.shape)}"
    tensors = (qkv, cos, sin, k_cache, v_cache)
    if any(
        t.dtype != qkv.dtype or t.device != qkv.device or not t.is_contiguous() for t in tensors
    ):
        return "qkv, cos, sin and the caches must be contiguous, of one dtype and device"
    if v_cache.shape != k_cache.shape or cos.shape != sin.shape:
        return "the caches, and cos and sin, must match each other"
    if cos.numel() != tokens * head_dim // 2:
        return f"cos and sin {tuple(cos.shape)} are not [tokens, head_dim / 2]"
    if slots.dtype != torch.int64 or slots.device.type != "cpu" or slots.shape != (tokens,):
        return "slots must be [tokens] int64 on the CPU"
    return ""


def rope_store_takes(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> bool:
    """Whether rope_store() can run on these."""
    return not _rope_problem(qkv, cos, sin, slots, k_cache, v_cache)


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
    checked: bool = False,
) -> None:
    """Rotates the `heads` query heads and the key heads of qkv [tokens, heads + 2 *
    kv_heads, head_dim] in place (rotate-half layout, cos/sin [tokens, ..., head_dim /
    2]), then stores each token's key and value heads in cache slot slots[t] (block *
    block_size + offset) of the caches [blocks, block_size, kv_heads, head_dim]. The
    kernel checks every slot against the cache. `checked`: rope_store_takes() said yes."""
    problem = "" if checked else _rope_problem(qkv, cos, sin, slots, k_cache, v_cache)
    if problem:
        raise ValueError(problem)
    kv_heads = k_cache.shape[2]
    if qkv.shape[1] != heads + 2 * kv_heads:
        raise ValueError(f"qkv has {qkv.shape[1]} heads, not {heads} + 2 x {kv_heads}")
    kernels = compiled()
    assert kernels is not None  # rope_store_takes() found them loaded
    kernels.rope_store(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        qkv.shape[0],
        heads,
        kv_heads,
        qkv.shape[2],
        k_cache.shape[0] * k_cache.shape[1],
        DTYPES[qkv.dtype],
        threads(),
    )
