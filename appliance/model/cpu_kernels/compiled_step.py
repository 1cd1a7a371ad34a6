"""A whole decode step's decoder layers and final norm in one compiled call
(csrc/decode_step.c): the binding that checks its tensors and passes their addresses.
appliance/model/decode_step.py builds what it takes from a model; it calls
`cpu_kernels.decode_step` through the package at call time, where tests replace it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.model.cpu_kernels.loading import DTYPES, compiled, threads

LAYER_FIELDS = 28  # kernels.h's DECODE_LAYER_FIELDS


@dataclass
class StepShape:
    """The sizes of a model that decode_step() runs: per layer `heads` query heads and
    `kv_heads` KV heads of `head_dim`, an MLP of `intermediate` columns; attention within
    the last `window` tokens (0: all)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float
    window: int = 0


def _check_step(
    layers: torch.Tensor,
    shape: StepShape,
    residual: torch.Tensor,
    final_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ints: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
) -> None:
    """Raises ValueError where decode_step()'s tensors do not fit each other; `ints` are
    its slots, tables and lens. What the kernel checks itself (slots, block ids, the
    projections' formats) is left to it."""
    dtype, n = residual.dtype, residual.shape[0]
    if compiled() is None or dtype not in DTYPES or residual.device.type != "cpu":
        raise ValueError("the decode step runs float32 or bfloat16 CPU tensors, compiled")
    if (
        layers.dtype != torch.int64
        or layers.dim() != 2
        or not layers.is_contiguous()
        or (layers.shape[1] != LAYER_FIELDS)
    ):
        raise ValueError(f"layers must be a contiguous [layers, {LAYER_FIELDS}] int64 tensor")
    if residual.shape != (n, shape.hidden) or final_norm.shape != (shape.hidden,):
        raise ValueError(
            f"residual must be [n, {shape.hidden}] and the final norm [{shape.hidden}]"
        )
    blocks, block_size = kv_cache.shape[2:4] if kv_cache.dim() == 6 else (0, 0)
    cache = (len(layers), 2, blocks, block_size, shape.kv_heads, shape.head_dim)
    if tuple(kv_cache.shape) != cache:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not fit the model's layers")
    floats = (residual, final_norm, cos, sin, kv_cache)
    if any(t.dtype != dtype or not t.is_contiguous() for t in floats):
        raise ValueError("residual, norms, cos, sin and the cache must be contiguous, one dtype")
    if cos.numel() != n * shape.head_dim // 2 or sin.shape != cos.shape:
        raise ValueError("cos and sin must be [n, 1, head_dim / 2]")
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in ints):
        raise ValueError("slots, tables and lens must be contiguous int64")
    slots, tables, lens = ints
    if slots.shape != (n,) or lens.shape != (n,) or tables.dim() != 2 or tables.shape[0] != n:
        raise ValueError("slots and lens must be [n], tables [n, width]")


def decode_step(
    layers: torch.Tensor,
    shape: StepShape,
    residual: torch.Tensor,
    final_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    kv_cache: torch.Tensor,
    precise: bool = True,
) -> torch.Tensor:
    """A decode step's decoder layers and final norm in one call (csrc/decode_step.c):
    residual [n, hidden] (the embeddings; left holding the residual stream) -> the final
    norm [n, hidden]. `layers` [num_layers, 28] int64 addresses and sizes of each layer's
    norms and block-quantized projections (kernels.h says which); cos, sin [n, 1,
    head_dim / 2]; slots [n], tables [n, width], lens [n] int64; kv_cache [layers, 2,
    blocks, block_size, kv_heads, head_dim]. The kernel checks sizes, slots, block ids
    and the projections' formats; the caller keeps what `layers` points to alive."""
    _check_step(layers, shape, residual, final_norm, cos, sin, (slots, tables, lens), kv_cache)
    out = torch.empty_like(residual)
    kernels = compiled()
    assert kernels is not None  # _check_step() found them loaded
    kernels.decode_step(
        layers.data_ptr(),
        len(layers),
        residual.data_ptr(),
        out.data_ptr(),
        kv_cache.data_ptr(),
        final_norm.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        residual.shape[0],
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.intermediate,
        kv_cache.shape[2],
        kv_cache.shape[3],
        tables.shape[1],
        shape.window,
        shape.eps,
        shape.scale,
        DTYPES[residual.dtype],
        threads(),
        int(precise),
    )
    return out
