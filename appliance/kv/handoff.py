"""Moving a request's KV blocks from one worker's pool to another's (the pull handoff).

The source tensor is the prefill worker's pool, shared once at start (shared memory on
the CPU, a CUDA IPC handle on GPUs); the destination is the decode worker's own pool.
"""

from __future__ import annotations

import torch


def copy_blocks(
    src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]
) -> int:
    """dst[:, :, dst_ids] = src[:, :, src_ids] for pools [layers, 2, blocks, ...]; returns bytes.

    Across GPUs this is one device-to-device copy (over NVLink where peer access exists),
    issued on the destination's current stream.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copying {len(src_ids)} blocks into {len(dst_ids)}")
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"KV pools differ in layout: {tuple(src.shape)} vs {tuple(dst.shape)}")
    src_index = torch.tensor(src_ids, dtype=torch.int64, device=src.device)
    dst_index = torch.tensor(dst_ids, dtype=torch.int64, device=dst.device)
    # [layers, 2, n, block_size, kv_heads, head_dim]
    moved = src.index_select(2, src_index).to(dst.device, dst.dtype, non_blocking=True)
    dst.index_copy_(2, dst_index, moved)
    return moved.numel() * moved.element_size()
