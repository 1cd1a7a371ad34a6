"""The compiled CPU kernels (csrc/): decode attention read in place from the paged cache,
and the residual add fused with the RMSNorm after it.

Both replace several small torch ops whose fixed costs dominate on the CPU at decode
sizes: SDPA spends microseconds of set-up per (sequence, KV head) on top of a gather
of the padded context; an add and a norm are half a dozen passes and dispatches per
layer (benchmarks/attention_bench.py, benchmarks/engine_bench.py). `pip install` builds
them (setup.py); where it could not, or for other devices, dtypes and shapes, the model
runs the torch ops instead: `*_takes()` says which.
"""

from __future__ import annotations

import torch

try:
    from appliance.model import _cpu_kernels
except ImportError:  # not built: no C compiler at install time
    _cpu_kernels = None

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
HEAD_SIZES = (64, 128)  # decode attention is compiled for these (unrolled into registers)


def available() -> bool:
    """Whether the kernels were built for this install."""
    return _cpu_kernels is not None


def decodes_ragged(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether decode attention on this device, dtype and head size runs on the kernel,
    which takes sequences of any mix of context lengths in one call (SDPA pads them all
    to the longest, so the model runner first groups them by length)."""
    return (
        _cpu_kernels is not None
        and device.type == "cpu"
        and dtype in _DTYPES
        and head_dim in HEAD_SIZES
    )


def decode_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether paged_decode() can run this decode: CPU tensors of one dtype and head size
    it knows, the caches contiguous and each query row's heads contiguous."""
    return (
        decodes_ragged(q.device, q.dtype, q.shape[2])
        and k_cache.dtype == q.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.stride(2) == 1
        and q.stride(1) == q.shape[2]
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [n, heads, head_dim] (one token per sequence); caches [blocks, block_size,
    kv_heads, head_dim]; block_tables [n, width] and context_lens [n] int64 -> [n, heads,
    head_dim]. Each query attends to its sequence's first context_lens[i] cached tokens.
    The kernel checks each context and block id it reads through against the cache."""
    n, heads, head_dim = q.shape
    blocks, block_size, kv_heads, _ = k_cache.shape
    if k_cache.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(
            f"{heads} query heads of {head_dim} do not fit a cache of {kv_heads} KV heads "
            f"of {k_cache.shape[3]}"
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"value cache {tuple(v_cache.shape)} does not match the key cache")
    rows_contiguous = q.stride(1) == head_dim and q.stride(2) == 1
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and rows_contiguous):
        raise ValueError("the caches and each query row must be contiguous")
    for name, t in (("block tables", block_tables), ("context lengths", context_lens)):
        if t.dtype != torch.int64 or t.device.type != "cpu":
            raise ValueError(f"{name} must be int64 on the CPU")
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    if tables.shape[0] != n or lens.shape != (n,):
        raise ValueError(f"{n} queries need {n} block tables and context lengths")
    out = torch.empty(n, heads, head_dim, dtype=q.dtype)
    _cpu_kernels.paged_decode(
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
        scale,
        _DTYPES[q.dtype],
        torch.get_num_threads(),
    )
    return out


def norm_takes(residual: torch.Tensor) -> bool:
    """Whether add_rms_norm() can run on rows like `residual` [rows, dim]."""
    return (
        _cpu_kernels is not None
        and residual.device.type == "cpu"
        and residual.dtype in _DTYPES
        and residual.dim() == 2
        and residual.shape[1] % 16 == 0
    )


def add_rms_norm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place; x None adds nothing), then (rms_norm(residual) * weight,
    residual). Both [rows, dim], weight [dim], one dtype."""
    rows, dim = residual.shape
    if weight.shape != (dim,) or weight.dtype != residual.dtype:
        raise ValueError(f"norm weight {tuple(weight.shape)} does not fit rows of {dim}")
    if x is not None and (x.shape != residual.shape or x.dtype != residual.dtype):
        raise ValueError(f"cannot add {tuple(x.shape)} to a residual {tuple(residual.shape)}")
    if not residual.is_contiguous():
        raise ValueError("the residual must be contiguous: it is updated in place")
    x = None if x is None else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty_like(residual)
    _cpu_kernels.add_rms_norm(
        0 if x is None else x.data_ptr(),
        weight.data_ptr(),
        residual.data_ptr(),
        out.data_ptr(),
        rows,
        dim,
        eps,
        _DTYPES[residual.dtype],
        torch.get_num_threads(),
    )
    return out, residual
