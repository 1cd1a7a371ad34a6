"""Which bytes of one KV pool go where in another: the read list of a handoff between
boxes, where a transfer engine moves byte ranges of registered memory, not tensors.

A pool is one contiguous tensor [layers, 2, blocks, block_size, heads, head_dim] (or a
tensor-parallel shard of one, holding heads head_start..). Block n of layer l, K or V, is
one contiguous stretch; a run of consecutive block ids on both sides is one stretch per
(layer, K/V). Between shards split over heads differently, only the heads both hold move,
a token row at a time. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ByteRange", "PoolShape", "copy_ranges"]


@dataclass(frozen=True)
class PoolShape:
    """A contiguous KV pool's shape and element size, and the first model KV head it holds."""

    layers: int
    blocks: int
    block_size: int
    heads: int
    head_dim: int
    elem_size: int  # bytes per element
    head_start: int = 0
    dtype: str = ""  # the elements' type by name ("bfloat16"); "" where not told

    def __post_init__(self) -> None:
        sizes = (self.layers, self.blocks, self.block_size, self.heads, self.head_dim)
        if min(sizes) < 1 or self.elem_size < 1 or self.head_start < 0:
            raise ValueError(f"not a KV pool shape: {self}")

    @property
    def token_bytes(self) -> int:
        """One token's row of every head this pool holds."""
        return self.heads * self.head_dim * self.elem_size

    @property
    def block_bytes(self) -> int:
        """One block of one layer's K or V."""
        return self.block_size * self.token_bytes

    @property
    def nbytes(self) -> int:
        return self.layers * 2 * self.blocks * self.block_bytes

    def offset(
        self, layer: int, kv: int, block: int, token: int = 0, head: int | None = None
    ) -> int:
        """Byte offset of (layer, K/V, block, token, model head; default its first) from
        the pool's start."""
        index = ((layer * 2 + kv) * self.blocks + block) * self.block_size + token
        within = 0 if head is None else head - self.head_start
        return index * self.token_bytes + within * self.head_dim * self.elem_size


@dataclass(frozen=True)
class ByteRange:
    """Copy `length` bytes from `src` (offset in the source pool) to `dst` (in the
    destination's)."""

    src: int
    dst: int
    length: int


def copy_ranges(
    src: PoolShape, src_ids: Sequence[int], dst: PoolShape, dst_ids: Sequence[int]
) -> list[ByteRange]:
    """The byte ranges that make dst[:, :, dst_ids] = src[:, :, src_ids] for the heads
    both pools hold, adjacent ranges merged. ValueError when the pools cannot meet (other
    layers, block size or head size, element size or type) or an id is out of range."""
    _check_meet(src, dst)
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copying {len(src_ids)} blocks into {len(dst_ids)}")
    _check_ids(src_ids, src.blocks, "source")
    _check_ids(dst_ids, dst.blocks, "destination")
    first = max(src.head_start, dst.head_start)
    last = min(src.head_start + src.heads, dst.head_start + dst.heads)
    if first >= last:
        return []
    whole = (
        (first, last)
        == (src.head_start, src.head_start + src.heads)
        == (
            dst.head_start,
            dst.head_start + dst.heads,
        )
    )
    ranges: list[ByteRange] = []
    for src_start, dst_start, count in block_runs(list(src_ids), list(dst_ids)):
        for layer in range(src.layers):
            for kv in (0, 1):
                if whole:  # the run's blocks are one stretch on both sides
                    ranges.append(
                        ByteRange(
                            src.offset(layer, kv, src_start),
                            dst.offset(layer, kv, dst_start),
                            count * src.block_bytes,
                        )
                    )
                    continue
                piece = (last - first) * src.head_dim * src.elem_size
                for token in range(count * src.block_size):
                    block, row = divmod(token, src.block_size)
                    ranges.append(
                        ByteRange(
                            src.offset(layer, kv, src_start + block, row, first),
                            dst.offset(layer, kv, dst_start + block, row, first),
                            piece,
                        )
                    )
    return _merged(ranges)


def _merged(ranges: list[ByteRange]) -> list[ByteRange]:
    """Ranges that continue each other on both sides joined into one."""
    out: list[ByteRange] = []
    for r in ranges:
        if out and out[-1].src + out[-1].length == r.src and out[-1].dst + out[-1].length == r.dst:
            out[-1] = ByteRange(out[-1].src, out[-1].dst, out[-1].length + r.length)
        else:
            out.append(r)
    return out


def _check_meet(src: PoolShape, dst: PoolShape) -> None:
    for name in ("layers", "block_size", "head_dim", "elem_size"):
        if getattr(src, name) != getattr(dst, name):
            raise ValueError(
                f"KV pools differ in {name}: {getattr(src, name)} vs {getattr(dst, name)}"
            )
    # Bytes move as stored: a bfloat16 pool into a float16 one would read as other numbers.
    if src.dtype and dst.dtype and src.dtype != dst.dtype:
        raise ValueError(
            f"KV pools differ in dtype: {src.dtype} vs {dst.dtype}; give every worker the "
            "same kv_cache_dtype (and dtype)"
        )


def _check_ids(ids: Sequence[int], blocks: int, side: str) -> None:
    bad = [i for i in ids if not 0 <= i < blocks]
    if bad:
        raise ValueError(f"{side} block id {bad[0]} is outside its pool of {blocks} blocks")


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for each stretch where both id lists count up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
