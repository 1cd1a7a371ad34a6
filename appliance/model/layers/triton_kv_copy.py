"""A request's KV blocks copied between two paged pools in one Triton launch: every
layer's K and V of a list of (scattered) block ids, dst[:, :, dst_ids] = src[:, :, src_ids].

The handoff (appliance/kv/handoff.py) copies a prefilled request's blocks out of the
prefill worker's pool (mapped into the decode process through CUDA IPC) into the blocks
the decode worker allocated: on CUDA, where both pools are readable from the destination
GPU, this kernel does it in one launch where a copy_ per run of consecutive ids made one
launch each (~256 for a scattered 4k-token prompt at 16-token blocks). The CPU keeps
handoff's own strided copies. The kernel lives beside the other Triton kernels (the
compile table and the interpreter tests find them here); kv/ calls it.

Pools are [layers, 2, blocks, block_size, heads, head_dim] views of one dtype, possibly
a slice of a larger pool's heads (a tensor-parallel shard), so every dimension has its
own stride. The bytes move as stored: the kernel reads and writes the elements as
integers of the dtype's width, so any dtype (bf16, fp16, fp32, an fp8 cache) copies bit
for bit on any architecture.

Grid: (blocks, layers * 2). A program copies one block of one layer's K or V: its
block_size * heads rows of head_dim values, ROWS rows at a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

# Element width -> the integer dtype the bytes move as.
_AS_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _kv_block_copy_kernel(
    src_ptr,  # [layers, 2, src_blocks, block_size, heads, head_dim] as integers
    dst_ptr,  # [layers, 2, dst_blocks, block_size, heads, head_dim] as integers
    src_ids_ptr,  # [n] int64
    dst_ids_ptr,  # [n] int64
    heads,
    head_dim,
    src_s_layer,
    src_s_kv,
    src_s_block,
    src_s_token,
    src_s_head,
    src_s_dim,
    dst_s_layer,
    dst_s_kv,
    dst_s_block,
    dst_s_token,
    dst_s_head,
    dst_s_dim,
    BLOCK_SIZE: tl.constexpr,  # tokens a block
    ROWS: tl.constexpr,  # (token, head) rows a step
    DIM: tl.constexpr,  # head_dim padded to a power of two
):
    i = tl.program_id(0)
    plane = tl.program_id(1)  # layer * 2 + (0: K, 1: V)
    layer = plane // 2
    kv = plane % 2
    src_block = tl.load(src_ids_ptr + i)
    dst_block = tl.load(dst_ids_ptr + i)
    # int64 offsets: a pool of 8B-model shape is tens of GiB.
    src_base = src_ptr + (
        layer.to(tl.int64) * src_s_layer + kv * src_s_kv + src_block * src_s_block
    )
    dst_base = dst_ptr + (
        layer.to(tl.int64) * dst_s_layer + kv * dst_s_kv + dst_block * dst_s_block
    )
    d = tl.arange(0, DIM)  # [DIM]
    d_ok = d < head_dim
    rows = BLOCK_SIZE * heads
    for first in range(0, rows, ROWS):
        r = first + tl.arange(0, ROWS)  # [ROWS]: row r is token r // heads, head r % heads
        token = r // heads
        head = r % heads
        ok = (r < rows)[:, None] & d_ok[None, :]  # [ROWS, DIM]
        src_at = (token * src_s_token + head * src_s_head).to(tl.int64)[:, None] + d[
            None, :
        ] * src_s_dim
        dst_at = (token * dst_s_token + head * dst_s_head).to(tl.int64)[:, None] + d[
            None, :
        ] * dst_s_dim
        values = tl.load(src_base + src_at, mask=ok)
        tl.store(dst_base + dst_at, values, mask=ok)


@dataclass(frozen=True)
class CopyLaunch:
    """One launch of the block copy: grid, arguments in the kernel's order, constexprs and
    compile options (the compile table builds the same)."""

    kernel: Any  # a triton.JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    options: dict[str, Any]


def copy_launch(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor
) -> CopyLaunch:
    """The launch copy_blocks makes for these (checked) pools and id tensors."""
    bits = _AS_BITS[src.element_size()]
    src_bits, dst_bits = src.view(bits), dst.view(bits)
    layers, _, _, block_size, heads, head_dim = src.shape
    # 16 (token, head) rows of up to 128 values a step: 2048 elements, 16 a thread on 4
    # warps. A block of an 8B model (16 tokens x 8 heads x 128) is 8 steps; programs are
    # many (blocks x layers x 2), so each stays small. Untimed: no GPU yet.
    dim = triton.next_power_of_2(head_dim)
    args = (
        src_bits,
        dst_bits,
        src_ids,
        dst_ids,
        heads,
        head_dim,
        *(src_bits.stride(k) for k in (0, 1, 2, 3, 4, 5)),
        *(dst_bits.stride(k) for k in (0, 1, 2, 3, 4, 5)),
    )
    options = {
        "BLOCK_SIZE": block_size,
        "ROWS": max(1, 2048 // dim),
        "DIM": dim,
        "num_warps": 4,
        "num_stages": 2,
    }
    return CopyLaunch(_kv_block_copy_kernel, (src_ids.shape[0], layers * 2), args, options)


def copy_blocks(
    src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]
) -> None:
    """dst[:, :, dst_ids] = src[:, :, src_ids] for pools [layers, 2, blocks, block_size,
    heads, head_dim] of one dtype and shape past the block dimension, in one launch on
    dst's device (which must read src directly: the same GPU, or peer access enabled).
    The caller (kv/handoff.copy_blocks) has checked the shapes and dtypes."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copying {len(src_ids)} blocks into {len(dst_ids)}")
    if src.dim() != 6 or src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"KV pools differ in layout: {tuple(src.shape)} vs {tuple(dst.shape)}")
    if src.dtype != dst.dtype or src.element_size() not in _AS_BITS:
        raise ValueError(f"KV pools of {src.dtype} and {dst.dtype} cannot copy as stored")
    if not src_ids:
        return
    # One upload of both id lists: [2, n] int64.
    ids = torch.tensor([src_ids, dst_ids], dtype=torch.int64).to(dst.device, non_blocking=True)
    launch = copy_launch(src, ids[0], dst, ids[1])
    launch.kernel[launch.grid](*launch.args, **launch.options)
