"""Block accounting for one paged KV pool. Pure Python so it tests on plain data."""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for."""


class BlockAllocator:
    """Hands out block ids of one KV pool and takes them back, exactly once each."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n free block ids; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        """Give blocks back; freeing a block that is not in use is a bug and raises."""
        unknown = [b for b in ids if b not in self._used]
        if unknown or len(set(ids)) != len(ids):
            raise ValueError(f"blocks {unknown or ids} are not allocated (or listed twice)")
        self._used.difference_update(ids)
        self._free.extend(ids)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens tokens."""
    return -(-num_tokens // block_size)
