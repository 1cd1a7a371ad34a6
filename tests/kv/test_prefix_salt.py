"""vLLM's cache_salt in the prefix-cache keys (issue 41): the salt enters the first block's
key, so the same tokens under different salts share no key (nor, chained, any later one),
and no salt keys blocks exactly as before."""

from __future__ import annotations

import hashlib

from appliance.kv.block_allocator import BlockAllocator
from appliance.kv.prefix_cache import PrefixCache, block_key, prefix_keys

BLOCK = 4
TOKENS = list(range(100, 100 + 5 * BLOCK + 2))  # 5 full blocks and a partial one


def unsalted_first_key(tokens: list[int]) -> int:
    """The first block's key as it was before salts: BLAKE2b-64 of a 0 tag and the
    tokens as little-endian int64."""
    packed = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return int.from_bytes(hashlib.blake2b(b"\x00" + packed, digest_size=8).digest(), "little")


def test_no_salt_keys_as_before() -> None:
    keys = prefix_keys(TOKENS, BLOCK)
    assert len(keys) == 5
    assert keys == prefix_keys(TOKENS, BLOCK, "")
    assert keys[0] == unsalted_first_key(TOKENS[:BLOCK])
    assert keys[1] == block_key(keys[0], TOKENS[BLOCK : 2 * BLOCK])


def test_different_salts_share_no_key() -> None:
    plain = prefix_keys(TOKENS, BLOCK)
    a = prefix_keys(TOKENS, BLOCK, "tenant-a")
    b = prefix_keys(TOKENS, BLOCK, "tenant-b")
    assert len(a) == len(b) == len(plain) == 5
    assert not set(a) & set(b)
    assert not (set(a) | set(b)) & set(plain)
    assert a == prefix_keys(TOKENS, BLOCK, "tenant-a")  # stable: the same salt, the same keys
    # Only the first block takes the salt; the rest differ through the chain.
    assert a[1] == block_key(a[0], TOKENS[BLOCK : 2 * BLOCK], "ignored after the first")


def test_salt_length_is_part_of_the_key() -> None:
    # "ab" + tokens must not hash like "a" + a token run starting with "b"'s bytes.
    assert block_key(None, [1, 2, 3, 4], "ab") != block_key(None, [1, 2, 3, 4], "a")
    assert block_key(None, [1, 2, 3, 4], "é") != block_key(None, [1, 2, 3, 4], "e")


def cache_with(salt: str) -> tuple[PrefixCache, list[int]]:
    """A cache holding TOKENS' full blocks, computed under `salt`, unused."""
    cache = PrefixCache(BlockAllocator(16), BLOCK)
    blocks = cache.allocate(5)
    previous = None
    for i, block in enumerate(blocks):
        previous = cache.register(block, previous, TOKENS[i * BLOCK : (i + 1) * BLOCK], salt)
    cache.free(blocks)
    return cache, blocks


def test_a_cache_serves_a_prefix_only_under_its_salt() -> None:
    cache, blocks = cache_with("tenant-a")
    for other in ("tenant-b", ""):
        found, keys = cache.match(TOKENS, 5, other)
        assert (found, keys) == ([], [])
    found, keys = cache.match(TOKENS, 5, "tenant-a")
    assert found == blocks
    assert keys == prefix_keys(TOKENS, BLOCK, "tenant-a")


def test_unsalted_cache_is_not_served_to_a_salted_request() -> None:
    cache, blocks = cache_with("")
    assert cache.match(TOKENS, 5, "tenant-a") == ([], [])
    assert cache.match(TOKENS, 5)[0] == blocks


def test_store_loads_land_under_the_requests_salt() -> None:
    cache = PrefixCache(BlockAllocator(16), BLOCK)
    loaded: list[int] = []

    def load(block: int, found: str) -> bool:
        loaded.append(block)
        return True

    assert cache.load_prefix(TOKENS, 5, ["stored"] * 5, load, "tenant-a") == 5
    assert cache.match(TOKENS, 5, "tenant-b") == ([], [])
    found, keys = cache.match(TOKENS, 5, "tenant-a")
    assert found == loaded and keys == prefix_keys(TOKENS, BLOCK, "tenant-a")
