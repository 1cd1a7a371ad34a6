"""Moving a request's KV blocks from one worker's pool to another's (the pull handoff).

The source tensor is the prefill worker's pool, shared once at start (shared memory on
the CPU, a CUDA IPC handle on GPUs); the destination is the decode worker's own pool.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShard:
    """One tensor-parallel shard's KV pool: KV heads head_start.. of the model.

    A worker of one process has a single shard with every head."""

    head_start: int
    tensor: torch.Tensor  # [layers, 2, num_blocks, block_size, shard_kv_heads, head_dim]

    @property
    def heads(self) -> range:
        """The model's KV heads this shard holds."""
        return range(self.head_start, self.head_start + self.tensor.shape[-2])


def copy_between_shards(
    src: list[KVShard], src_ids: list[int], dst: list[KVShard], dst_ids: list[int]
) -> int:
    """Copy blocks between pools split over KV heads in different ways (a 2-shard prefill
    into a 1-shard decode gathers heads, the reverse splits them); returns bytes moved.

    Each destination shard takes, from every source shard, the heads both hold."""
    _check_covers(src, dst)
    moved = 0
    for to in dst:
        for origin in src:
            first = max(to.heads.start, origin.heads.start)
            last = min(to.heads.stop, origin.heads.stop)
            if first >= last:
                continue
            moved += copy_blocks(
                _heads(origin, first, last), src_ids, _heads(to, first, last), dst_ids
            )
    if dst[0].tensor.is_cuda:
        # The copy is queued; the source blocks are released once this returns, and other
        # shards' pools are read by other processes, whose streams do not wait for ours.
        for device in {to.tensor.device for to in dst}:
            torch.cuda.synchronize(device)
    return moved


def _check_covers(src: list[KVShard], dst: list[KVShard]) -> None:
    """Every destination head must come from exactly one source shard."""
    have = sorted(h for shard in src for h in shard.heads)
    want = sorted(h for shard in dst for h in shard.heads)
    if have != want:
        raise ValueError(f"KV shards hold heads {have}, the destination wants {want}")


def _heads(shard: KVShard, first: int, last: int) -> torch.Tensor:
    return shard.tensor[..., first - shard.head_start : last - shard.head_start, :]


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
    with torch.cuda.device(dst.device) if dst.is_cuda else contextlib.nullcontext():
        # One strided copy per run of consecutive ids on both sides: a single pass over
        # the bytes, where index_select + index_copy_ would make two and a temporary.
        # On CUDA it is queued on the destination's current stream; between GPUs with
        # peer access (see peer_access) it goes device to device, else through the host.
        for src_start, dst_start, length in block_runs(src_ids, dst_ids):
            dst[:, :, dst_start : dst_start + length].copy_(
                src[:, :, src_start : src_start + length], non_blocking=True
            )
    return len(src_ids) * src[:, :, :1].numel() * src.element_size()


def peer_access(src: torch.device, dst: torch.device) -> bool:
    """Whether dst's GPU can read src's memory directly (NVLink or PCIe P2P)."""
    if src.type != "cuda" or dst.type != "cuda":
        return False
    if src.index == dst.index:
        return True
    return torch.cuda.can_device_access_peer(dst.index, src.index)


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for each stretch where both id lists count up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
