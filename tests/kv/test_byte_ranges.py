"""The byte ranges of a handoff between boxes move exactly what the in-box copy moves."""

from __future__ import annotations

import pytest
import torch

from appliance.kv.byte_ranges import ByteRange, PoolShape, copy_ranges
from appliance.kv.handoff import KVShard, copy_between_shards


def pool(blocks: int, heads: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[layers 3, 2, blocks, block_size 4, heads, head_dim 8] of distinct values."""
    count = 3 * 2 * blocks * 4 * heads * 8
    return torch.arange(count, dtype=torch.float64).to(dtype).view(3, 2, blocks, 4, heads, 8)


def shape_of(tensor: torch.Tensor, head_start: int = 0) -> PoolShape:
    layers, _, blocks, block_size, heads, head_dim = tensor.shape
    return PoolShape(layers, blocks, block_size, heads, head_dim, tensor.element_size(), head_start)


def apply(ranges: list[ByteRange], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Each range copied as raw bytes, as a transfer engine would."""
    src_bytes, dst_bytes = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    for r in ranges:
        dst_bytes[r.dst : r.dst + r.length] = src_bytes[r.src : r.src + r.length]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_pools_move_the_named_blocks_in_runs(dtype: torch.dtype) -> None:
    src, dst = pool(7, 2, dtype), torch.zeros(3, 2, 5, 4, 2, 8, dtype=dtype)
    expected = dst.clone()
    src_ids, dst_ids = [4, 5, 6, 1], [0, 1, 2, 4]
    expected[:, :, dst_ids] = src[:, :, src_ids]
    ranges = copy_ranges(shape_of(src), src_ids, shape_of(dst), dst_ids)
    apply(ranges, src, dst)
    assert torch.equal(dst, expected)
    # blocks 4-6 -> 0-2 are one stretch per (layer, K/V); block 1 -> 4 another
    assert len(ranges) == 3 * 2 * 2
    assert sum(r.length for r in ranges) == 4 * 3 * 2 * 4 * 2 * 8 * src.element_size()


@pytest.mark.parametrize(
    ("src_split", "dst_split"), [((4,), (2, 2)), ((2, 2), (4,)), ((1, 3), (3, 1)), ((2, 2), (2, 2))]
)
def test_shards_split_over_heads_differently_gather_the_heads_they_share(
    src_split: tuple[int, ...], dst_split: tuple[int, ...]
) -> None:
    whole = pool(6, 4)
    src_ids, dst_ids = [5, 2, 3], [1, 3, 4]
    src_shards = _split(whole, src_split)
    dst_shards = _split(torch.zeros(3, 2, 5, 4, 4, 8), dst_split)
    reference = [KVShard(s.head_start, s.tensor.clone()) for s in dst_shards]
    copy_between_shards(src_shards, src_ids, reference, dst_ids)
    for to in dst_shards:
        for origin in src_shards:
            ranges = copy_ranges(
                shape_of(origin.tensor, origin.head_start),
                src_ids,
                shape_of(to.tensor, to.head_start),
                dst_ids,
            )
            apply(ranges, origin.tensor, to.tensor)
    for got, want in zip(dst_shards, reference, strict=True):
        assert torch.equal(got.tensor, want.tensor)


def test_shards_with_no_head_in_common_move_nothing() -> None:
    src, dst = PoolShape(2, 4, 4, 2, 8, 4, head_start=0), PoolShape(2, 4, 4, 2, 8, 4, head_start=2)
    assert copy_ranges(src, [1], dst, [2]) == []


def test_pools_that_cannot_meet_are_refused() -> None:
    src = PoolShape(2, 4, 4, 2, 8, 4)
    with pytest.raises(ValueError, match="block_size"):
        copy_ranges(src, [0], PoolShape(2, 4, 8, 2, 8, 4), [0])
    with pytest.raises(ValueError, match="elem_size"):
        copy_ranges(src, [0], PoolShape(2, 4, 4, 2, 8, 2), [0])
    with pytest.raises(ValueError, match="2 blocks into 1"):
        copy_ranges(src, [0, 1], src, [0])
    with pytest.raises(ValueError, match="source block id 4 is outside its pool of 4"):
        copy_ranges(src, [4], src, [0])
    with pytest.raises(ValueError, match="destination block id -1"):
        copy_ranges(src, [0], src, [-1])
    with pytest.raises(ValueError, match="not a KV pool shape"):
        PoolShape(2, 0, 4, 2, 8, 4)


def _split(tensor: torch.Tensor, heads: tuple[int, ...]) -> list[KVShard]:
    shards, start = [], 0
    for count in heads:
        shards.append(KVShard(start, tensor[..., start : start + count, :].contiguous()))
        start += count
    return shards
