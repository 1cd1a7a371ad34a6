"""Block accounting for one paged KV pool. Pure Python so it tests on plain data."""

from __future__ import annotations

import bisect


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for."""


class BlockAllocator:
    """Hands out block ids of one KV pool and takes them back, exactly once each."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # Sorted, so a request can get consecutive ids: the KV handoff copies a run of
        # consecutive blocks in one go, and pays a copy call per block otherwise.
        self._free: list[int] = list(range(num_blocks))
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
        """Take n free block ids, consecutive ones where a long enough run is free; all or
        nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        if n == 0:
            return []
        start = self._first_run(n)
        ids = self._free[start : start + n]
        del self._free[start : start + n]
        self._used.update(ids)
        return ids

    def _first_run(self, n: int) -> int:
        """Index in the free list of the first n consecutive ids, else 0 (the lowest ids)."""
        free = self._free
        for i in range(len(free) - n + 1):
            if free[i + n - 1] - free[i] == n - 1:  # sorted and distinct: a run
                return i
        return 0

    def free(self, ids: list[int]) -> None:
        """Give blocks back; freeing a block that is not in use is a bug and raises."""
        unknown = [b for b in ids if b not in self._used]
        if unknown or len(set(ids)) != len(ids):
            raise ValueError(f"blocks {unknown or ids} are not allocated (or listed twice)")
        self._used.difference_update(ids)
        for block_id in ids:
            bisect.insort(self._free, block_id)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens tokens."""
    return -(-num_tokens // block_size)
