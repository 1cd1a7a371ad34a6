"""BlockAllocator: exact accounting, all-or-nothing allocation, strict frees."""

from __future__ import annotations

import pytest

from appliance.kv.block_allocator import BlockAllocator, OutOfBlocks, blocks_for_tokens


def assert_accounting(alloc: BlockAllocator) -> None:
    assert alloc.num_free + alloc.num_used == alloc.num_blocks


def test_new_pool_is_all_free() -> None:
    alloc = BlockAllocator(5)
    assert alloc.num_blocks == 5
    assert alloc.num_free == 5
    assert alloc.num_used == 0
    assert alloc.can_allocate(5)
    assert not alloc.can_allocate(6)


@pytest.mark.parametrize("bad", [0, -1])
def test_pool_needs_at_least_one_block(bad: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(bad)


def test_allocate_hands_out_distinct_valid_ids() -> None:
    alloc = BlockAllocator(8)
    first = alloc.allocate(3)
    second = alloc.allocate(5)
    ids = first + second
    assert len(first) == 3 and len(second) == 5
    assert sorted(ids) == list(range(8))
    assert alloc.num_free == 0
    assert alloc.num_used == 8
    assert_accounting(alloc)


def test_allocate_zero_is_a_no_op() -> None:
    alloc = BlockAllocator(2)
    assert alloc.allocate(0) == []
    assert alloc.num_free == 2
    alloc.allocate(2)
    assert alloc.allocate(0) == []  # also with nothing free
    assert_accounting(alloc)


def test_allocate_negative_raises() -> None:
    alloc = BlockAllocator(2)
    with pytest.raises(ValueError):
        alloc.allocate(-1)
    assert alloc.num_free == 2


def test_allocate_is_all_or_nothing() -> None:
    alloc = BlockAllocator(4)
    held = alloc.allocate(3)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(2)
    # Nothing was taken by the failed call.
    assert alloc.num_free == 1
    assert alloc.num_used == 3
    assert_accounting(alloc)
    # The one remaining block is still available, and is not one already held.
    (last,) = alloc.allocate(1)
    assert last not in held
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)


def test_out_of_blocks_is_a_runtime_error() -> None:
    assert issubclass(OutOfBlocks, RuntimeError)


def test_free_returns_blocks_for_reuse() -> None:
    alloc = BlockAllocator(3)
    ids = alloc.allocate(3)
    alloc.free(ids[:2])
    assert alloc.num_free == 2
    assert alloc.num_used == 1
    assert_accounting(alloc)
    again = alloc.allocate(2)
    assert sorted(again) == sorted(ids[:2])
    alloc.free(again + ids[2:])
    assert alloc.num_free == 3
    assert alloc.num_used == 0


def test_double_free_raises() -> None:
    alloc = BlockAllocator(3)
    ids = alloc.allocate(2)
    alloc.free(ids)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([ids[0]])
    assert alloc.num_free == 3
    assert_accounting(alloc)


def test_freeing_the_same_id_twice_in_one_call_raises() -> None:
    alloc = BlockAllocator(3)
    (block,) = alloc.allocate(1)
    with pytest.raises(ValueError):
        alloc.free([block, block])
    assert_accounting(alloc)
    assert alloc.num_free == 2  # all or nothing: the bad call freed nothing


def test_a_bad_free_frees_nothing() -> None:
    alloc = BlockAllocator(3)
    good = alloc.allocate(2)
    with pytest.raises(ValueError):
        alloc.free([good[0], 99])
    assert alloc.num_used == 2
    alloc.free(good)
    assert alloc.num_free == 3


@pytest.mark.parametrize("unknown", [99, -1, 3])
def test_freeing_unknown_ids_raises(unknown: int) -> None:
    alloc = BlockAllocator(3)
    with pytest.raises(ValueError):
        alloc.free([unknown])
    assert alloc.num_free == 3
    assert_accounting(alloc)


def test_freeing_a_never_allocated_id_raises() -> None:
    alloc = BlockAllocator(3)
    taken = alloc.allocate(1)
    never = next(i for i in range(3) if i not in taken)
    with pytest.raises(ValueError):
        alloc.free([never])
    assert alloc.num_used == 1
    assert_accounting(alloc)


def test_accounting_over_many_cycles() -> None:
    alloc = BlockAllocator(7)
    held: list[list[int]] = []
    for n in [1, 2, 3, 1]:
        held.append(alloc.allocate(n))
        assert_accounting(alloc)
    assert alloc.num_free == 0
    alloc.free(held.pop(1))
    alloc.free(held.pop(0))
    assert alloc.num_free == 3
    held.append(alloc.allocate(3))
    for ids in held:
        alloc.free(ids)
        assert_accounting(alloc)
    assert alloc.num_free == 7
    assert alloc.num_used == 0


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [
        (0, 4, 0),
        (1, 4, 1),
        (3, 4, 1),  # block_size - 1
        (4, 4, 1),  # exactly block_size
        (5, 4, 2),  # block_size + 1
        (7, 4, 2),
        (8, 4, 2),
        (9, 4, 3),
        (1, 1, 1),
        (5, 1, 5),
        (15, 16, 1),
        (16, 16, 1),
        (17, 16, 2),
    ],
)
def test_blocks_for_tokens(num_tokens: int, block_size: int, expected: int) -> None:
    assert blocks_for_tokens(num_tokens, block_size) == expected


def test_allocation_prefers_a_run_of_consecutive_ids() -> None:
    alloc = BlockAllocator(12)
    held = alloc.allocate(12)
    alloc.free([held[i] for i in (1, 3, 4, 7, 8, 9, 10)])  # free: 1, 3-4, 7-10
    assert alloc.allocate(3) == [7, 8, 9]  # the first run long enough
    assert alloc.allocate(2) == [3, 4]
    assert alloc.allocate(2) == [1, 10]  # no run left: the lowest ids
    assert alloc.num_free == 0


def test_freed_ids_come_back_in_order_for_later_runs() -> None:
    alloc = BlockAllocator(8)
    a, b = alloc.allocate(4), alloc.allocate(4)
    alloc.free(b[::-1])
    alloc.free(a[2:])
    assert alloc.allocate(6) == [2, 3, 4, 5, 6, 7]
