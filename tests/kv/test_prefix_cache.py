"""PrefixCache on plain data: chained keys, sharing with reference counts, LRU eviction
that never takes a block in use, and exact accounting."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from appliance.kv.block_allocator import BlockAllocator, OutOfBlocks
from appliance.kv.prefix_cache import PrefixCache, block_key, prefix_keys

SIZE = 4


def cache_with(num_blocks: int = 8, enabled: bool = True) -> PrefixCache:
    return PrefixCache(BlockAllocator(num_blocks), SIZE, enabled)


def compute(cache: PrefixCache, tokens: list[int]) -> tuple[list[int], list[int]]:
    """A sequence that computed `tokens` from scratch: its blocks, with full ones cached."""
    blocks = cache.allocate(-(-len(tokens) // SIZE))
    keys: list[int] = []
    for i in range(len(tokens) // SIZE):
        keys.append(
            cache.register(blocks[i], keys[-1] if keys else None, tokens[i * SIZE :][:SIZE])
        )
    return blocks, keys


def test_a_shared_prefix_is_found_block_by_block() -> None:
    cache = cache_with()
    prompt = list(range(10))  # two full blocks and two tokens
    blocks, keys = compute(cache, prompt)
    hit, hit_keys = cache.match([*prompt[:8], 99, 98, 97, 96], max_blocks=3)
    assert hit == blocks[:2] and hit_keys == keys
    assert cache.hit_tokens == 8


def test_keys_chain_so_equal_blocks_after_different_prefixes_do_not_match() -> None:
    cache = cache_with()
    compute(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match([9, 9, 9, 9, 5, 6, 7, 8], max_blocks=2) == ([], [])


PROMPT = [151644, 8948, 198, *range(40_000, 40_061)]  # four 16-token blocks, ids past 2**16


def keys_in_a_new_process(hash_seed: str) -> list[int]:
    """PROMPT's block keys as another interpreter, with its own hash salt, computes them."""
    code = (
        "import json, sys; from appliance.kv.prefix_cache import prefix_keys; "
        "print(json.dumps(prefix_keys(json.loads(sys.argv[1]), 16)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(PROMPT)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(done.stdout)


@pytest.mark.process  # child pythons, one per hash seed
def test_block_keys_are_the_same_in_every_process_and_run() -> None:
    here = prefix_keys(PROMPT, 16)
    assert len(here) == 4 and len(set(here)) == 4
    assert all(0 <= key < 2**64 for key in here)  # fit a uint64 wherever they are sent
    seeds = {os.environ.get("PYTHONHASHSEED"), "1", "4242"} - {None}
    for seed in sorted(seeds):
        assert keys_in_a_new_process(seed) == here, f"PYTHONHASHSEED={seed}"


def test_a_block_key_depends_on_every_earlier_block() -> None:
    first, second, third = PROMPT[:16], PROMPT[16:32], PROMPT[32:48]
    changed = [*first[:15], first[15] + 1]  # one token off, in the first block only
    keys = prefix_keys([*first, *second, *third], 16)
    other = prefix_keys([*changed, *second, *third], 16)
    assert all(a != b for a, b in zip(keys, other, strict=True))  # every later key moves
    assert prefix_keys([*first, *second, *third], 16) == keys  # and is a pure function
    assert block_key(None, second) != block_key(keys[0], second)  # no prefix is a prefix too
    assert block_key(keys[0], second) == keys[1]  # prefix_keys is the chain of block_key


def test_max_blocks_caps_the_match() -> None:
    cache = cache_with()
    prompt = list(range(8))
    blocks, _ = compute(cache, prompt)
    assert cache.match(prompt, max_blocks=1)[0] == blocks[:1]


def test_blocks_in_use_are_never_evicted_and_idle_ones_go_lru_first() -> None:
    cache = cache_with(num_blocks=4)
    a_blocks, _ = compute(cache, [1, 1, 1, 1])
    b_blocks, _ = compute(cache, [2, 2, 2, 2])
    cache.free(a_blocks)  # idle first: evicted first
    cache.free(b_blocks)
    held, _ = cache.match([2, 2, 2, 2], max_blocks=1)  # b in use again
    assert cache.num_free == 3  # two never used + a's idle block
    taken = cache.allocate(3)
    assert a_blocks[0] in taken and b_blocks[0] not in taken
    assert cache.match([1, 1, 1, 1], max_blocks=1) == ([], [])  # a was evicted
    with pytest.raises(OutOfBlocks):
        cache.allocate(1)  # b is held: nothing left to evict
    cache.free(held)
    assert cache.allocate(1) == b_blocks


def test_references_count_every_user() -> None:
    cache = cache_with(num_blocks=2)
    blocks, _ = compute(cache, [5, 6, 7, 8])
    again, _ = cache.match([5, 6, 7, 8], max_blocks=1)
    assert again == blocks
    cache.free(blocks)  # the first user leaves; the second still uses it
    assert cache.num_free == 1
    cache.free(again)
    assert cache.num_free == 2 and cache.num_cached == 1


def test_the_same_content_computed_twice_is_cached_once() -> None:
    cache = cache_with()
    first, keys = compute(cache, [1, 2, 3, 4])
    second, second_keys = compute(cache, [1, 2, 3, 4])
    assert keys == second_keys and first != second
    cache.free(second)  # not cached: back to the free list at once
    assert cache.num_free == 7 and cache.num_cached == 1


def test_accounting_returns_to_all_free() -> None:
    cache = cache_with(num_blocks=6)
    for start in (0, 0, 3, 8):
        blocks, _ = compute(cache, list(range(start, start + 9)))
        cache.free(blocks)
    assert cache.num_free == 6
    assert cache.allocator.num_used == cache.num_cached  # the rest sits idle in the cache


def test_disabled_it_is_the_allocator() -> None:
    cache = cache_with(enabled=False)
    blocks, _ = compute(cache, [1, 2, 3, 4])
    assert cache.match([1, 2, 3, 4], max_blocks=1) == ([], []) and cache.num_cached == 0
    cache.free(blocks)
    assert cache.allocator.num_free == 8
