"""The KV store's index on plain data: LRU per tier, capacity in bytes, demotion from host
to disk, the longest prefix of a prompt's keys, namespaces that never share, pins."""

from __future__ import annotations

import dataclasses

import pytest

from appliance.kv.prefix_cache import prefix_keys
from appliance.kv_store.namespace import StoreNamespace
from appliance.kv_store.tier_index import Hit, Move, Placement, StoreIndex, TierSpec

NS = StoreNamespace(model="smollm2-135m", weights="q8_0:abc", kv_dtype="bfloat16", block_size=4)
A = NS.digest()


def key(block: int) -> tuple[bytes, int]:
    return (A, block)


def test_lru_order_decides_what_the_host_tier_drops() -> None:
    index = StoreIndex(TierSpec(300))
    for block in (1, 2, 3):
        assert index.insert(key(block), 100).tier == "host"
    assert index.lookup(A, [1]) == [Hit(key(1), "host")]  # 1 is now the most recent
    placed = index.insert(key(4), 100)
    assert placed.tier == "host"
    assert placed.moves == [Move(key(2), "host", None)]  # the least recently used goes
    assert index.keys("host") == [key(3), key(1), key(4)]
    assert index.tier_of(key(2)) is None


def test_capacity_is_counted_in_bytes_and_whole_units() -> None:
    index = StoreIndex(TierSpec(1000, unit_bytes=256))
    index.insert(key(1), 10)  # charged one unit of 256
    index.insert(key(2), 300)  # two units
    assert index.used_bytes("host") == 768
    placed = index.insert(key(3), 200)  # 256 more: 1024 > 1000, the oldest goes
    assert placed.moves == [Move(key(1), "host", None)]
    assert index.used_bytes("host") == 768 and index.count("host") == 2
    assert index.nbytes(key(2)) == 300
    # A disk file's header is charged with it: 4096 bytes and 76 of header take two units.
    assert TierSpec(0, unit_bytes=4096, overhead_bytes=76).charge(4096) == 8192
    assert TierSpec(0, unit_bytes=4096, overhead_bytes=76).charge(4000) == 4096
    # Larger than the whole tier and no disk: nowhere, nothing pushed out.
    assert index.insert(key(9), 2000).tier is None
    assert index.count("host") == 2


def test_a_block_pushed_out_of_host_goes_to_disk_and_from_disk_is_dropped() -> None:
    index = StoreIndex(TierSpec(200), TierSpec(200))
    for block in (1, 2):
        index.insert(key(block), 100)
    assert index.insert(key(3), 100).moves == [Move(key(1), "host", "disk")]
    assert index.insert(key(4), 100).moves == [Move(key(2), "host", "disk")]
    # The disk tier is full: its oldest is dropped before the next demotion lands.
    assert index.insert(key(5), 100).moves == [
        Move(key(1), "disk", None),
        Move(key(3), "host", "disk"),
    ]
    assert index.keys("host") == [key(4), key(5)]
    assert index.keys("disk") == [key(2), key(3)]
    assert index.used_bytes("disk") == 200


def test_a_block_too_large_for_host_goes_to_disk_directly() -> None:
    index = StoreIndex(TierSpec(100), TierSpec(1000))
    assert index.insert(key(1), 500).tier == "disk"


def test_lookup_returns_the_longest_prefix_and_each_hits_tier() -> None:
    tokens = list(range(20))
    keys = prefix_keys(tokens, 4)  # five chained blocks
    index = StoreIndex(TierSpec(300), TierSpec(1000))
    for block in keys:
        index.insert((A, block), 100)  # the first two end on disk
    assert index.lookup(A, keys) == [
        Hit((A, keys[0]), "disk"),
        Hit((A, keys[1]), "disk"),
        Hit((A, keys[2]), "host"),
        Hit((A, keys[3]), "host"),
        Hit((A, keys[4]), "host"),
    ]
    index.remove((A, keys[2]))
    # A hit after a miss is useless: the prefix stops at the first missing block.
    assert [h.key[1] for h in index.lookup(A, keys)] == keys[:2]
    assert index.lookup(A, [123, *keys]) == []


def test_a_repeated_insert_refreshes_and_stores_once() -> None:
    index = StoreIndex(TierSpec(200))
    index.insert(key(1), 100)
    index.insert(key(2), 100)
    assert index.insert(key(1), 100).moves == []
    assert index.used_bytes("host") == 200
    assert index.insert(key(3), 100).moves == [Move(key(2), "host", None)]


@pytest.mark.parametrize(
    "field, value",
    [
        ("model", "qwen3-0.6b"),
        ("weights", "q4_0:abc"),
        ("kv_dtype", "float32"),
        ("block_size", 16),
        ("shard_index", 1),
        ("shard_count", 4),
        ("prefill_kernel", "int16"),
        ("cache_salt", "tenant-b"),
    ],
)
def test_namespaces_that_differ_in_any_field_never_share(field: str, value: object) -> None:
    changes: dict[str, object] = {field: value}
    if field == "shard_index":
        changes["shard_count"] = 2
    other = dataclasses.replace(NS, **changes).digest()  # type: ignore[arg-type]
    assert other != A
    index = StoreIndex(TierSpec(1000))
    keys = prefix_keys(list(range(12)), 4)
    for block in keys:
        index.insert((A, block), 100)
    assert index.lookup(other, keys) == []
    assert len(index.lookup(A, keys)) == 3


def test_the_digest_is_stable_and_the_namespace_validated() -> None:
    same = StoreNamespace("smollm2-135m", "q8_0:abc", "bfloat16", 4)
    assert same.digest() == A and len(A) == 16
    # A fixed hash, not Python's salted one: the same bytes in every process and run.
    assert A.hex() == StoreNamespace(**dataclasses.asdict(NS)).digest().hex()
    with pytest.raises(ValueError, match="shard_index"):
        StoreNamespace("m", "w", "bfloat16", 4, shard_index=2, shard_count=2)
    with pytest.raises(ValueError, match="block_size"):
        StoreNamespace("m", "w", "bfloat16", 0)
    with pytest.raises(ValueError, match="model, weights"):
        StoreNamespace("", "w", "bfloat16", 4)


def test_a_pinned_block_is_never_pushed_out() -> None:
    index = StoreIndex(TierSpec(200), TierSpec(100))
    index.insert(key(1), 100)
    index.insert(key(2), 100)
    reading = index.lookup(A, [1])
    index.pin(reading)
    index.lookup(A, [2])  # 1 is now the least recently used, but pinned
    assert index.insert(key(3), 100).moves == [Move(key(2), "host", "disk")]
    assert index.tier_of(key(1)) == "host"
    index.pin(index.lookup(A, [3]))
    # Everything in the host tier pinned: a new block goes to disk, pushing out 2.
    placed = index.insert(key(4), 100)
    assert placed.tier == "disk" and placed.moves == [Move(key(2), "disk", None)]
    index.pin(index.lookup(A, [4]))
    assert index.insert(key(5), 100).tier is None  # both tiers pinned full
    index.unpin(reading)
    # 1 may go now; the disk tier holds only the pinned 4, so 1 is dropped, not demoted.
    assert index.insert(key(5), 100) == Placement("host", [Move(key(1), "host", None)])
    with pytest.raises(ValueError, match="unpinned more often"):
        index.unpin(reading)


def test_clear_forgets_all_but_pinned_blocks() -> None:
    index = StoreIndex(TierSpec(100), TierSpec(100))
    index.insert(key(1), 100)
    index.insert(key(2), 100)
    index.pin(index.lookup(A, [2]))
    assert index.clear() == [key(1)]
    assert index.keys("disk") == [] and index.keys("host") == [key(2)]


def test_a_disk_block_promoted_to_host_pushes_the_oldest_host_block_down() -> None:
    index = StoreIndex(TierSpec(200), TierSpec(200))
    for block in (1, 2, 3):
        index.insert(key(block), 100)  # 1 on disk
    reading = index.lookup(A, [1])
    index.pin(reading)
    placed = index.promote(key(1))
    # Room made in host by demoting 2; 1 left the disk first, so it is never pushed out.
    assert placed == Placement("host", [Move(key(2), "host", "disk")])
    assert index.keys("host") == [key(3), key(1)] and index.keys("disk") == [key(2)]
    assert index.pinned(key(1))  # the pin follows the block
    assert index.promote(key(1)) == Placement("host")  # already there


def test_a_promotion_without_room_leaves_the_block_on_disk() -> None:
    index = StoreIndex(TierSpec(100), TierSpec(300))
    index.insert(key(1), 100)
    index.insert(key(2), 100)  # 1 on disk
    index.pin(index.lookup(A, [2]))  # the host tier's only block is being read
    assert index.promote(key(1)) == Placement("disk")
    assert index.keys("disk") == [key(1)] and index.used_bytes("disk") == 100


def test_demote_pushes_unpinned_host_blocks_to_disk() -> None:
    index = StoreIndex(TierSpec(300), TierSpec(100))
    for block in (1, 2):
        index.insert(key(block), 100)
    index.pin(index.lookup(A, [2]))
    assert index.demote(key(2)) == []  # being read: stays
    assert index.demote(key(1)) == [Move(key(1), "host", "disk")]
    index.insert(key(3), 100)
    # The disk is full of 1: demoting 3 pushes 1 out first.
    assert index.demote(key(3)) == [Move(key(1), "disk", None), Move(key(3), "host", "disk")]


def test_a_looked_up_prompt_loses_its_tail_before_its_head() -> None:
    keys = prefix_keys(list(range(16)), 4)
    index = StoreIndex(TierSpec(400))
    for block in keys:
        index.insert((A, block), 100)
    index.lookup(A, keys)
    placed = index.insert(key(1), 100)
    # The last block goes: the first three are still a prefix of the prompt.
    assert placed.moves == [Move((A, keys[3]), "host", None)]
    assert len(index.lookup(A, keys)) == 3


def test_a_refreshed_block_is_pushed_out_last_and_a_gone_one_stays_gone() -> None:
    """A worker's pool evicted a block it had not copied (the store held it: written
    ahead or loaded): refreshed, it is the most recent of its tier, where it was; one
    pushed out meanwhile is not brought back."""
    index = StoreIndex(TierSpec(300), TierSpec(100))
    for block in (1, 2, 3):
        index.insert(key(block), 100)
    assert index.refresh(key(1)) == "host"
    assert index.keys("host") == [key(2), key(3), key(1)]
    assert index.insert(key(4), 100).moves == [Move(key(2), "host", "disk")]  # not 1
    assert index.refresh(key(2)) == "disk"  # refreshed in its own tier, not promoted
    assert index.insert(key(5), 100).moves == [
        Move(key(2), "disk", None),
        Move(key(3), "host", "disk"),
    ]
    assert index.refresh(key(2)) is None and index.tier_of(key(2)) is None
    assert index.used_bytes("host") == 300 and index.used_bytes("disk") == 100
