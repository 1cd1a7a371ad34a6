"""The store wired to the pools, on plain data: a worker's prefix cache hands blocks to the
store as it evicts them (or as their last request lets go) and caches a prompt's stored
prefix loaded into free blocks; the supervisor's owner opens the store at the first
worker's StoreReady, pins a prompt's hits for that worker, lets go of a dead worker's
pins, and at shutdown flushes the host tier to disk and removes its arena file."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.kv.block_allocator import BlockAllocator
from appliance.kv.prefix_cache import PrefixCache, prefix_keys
from appliance.kv_store.namespace import StoreNamespace
from appliance.pools.kv_store_owner import StoreOwner
from appliance.settings.kv_store import KVStoreSettings
from appliance.workers.messages import StorePut, StoreReady, StoreRelease

SIZE = 4
BLOCK = 8192
NAMESPACE = StoreNamespace("smollm2-135m", "q8_0:abc", "bfloat16", SIZE)
OTHER = StoreNamespace("smollm2-135m", "q8_0:abc", "float32", SIZE)


def compute(cache: PrefixCache, tokens: list[int]) -> list[int]:
    """A sequence that computed `tokens`: its blocks, full ones cached, then let go."""
    blocks = cache.allocate(-(-len(tokens) // SIZE))
    previous = None
    for i in range(len(tokens) // SIZE):
        previous = cache.register(blocks[i], previous, tokens[i * SIZE : (i + 1) * SIZE])
    cache.free(blocks)
    return blocks


def test_a_cached_block_goes_to_the_store_before_the_pool_reuses_it() -> None:
    cache = PrefixCache(BlockAllocator(4), SIZE)
    evicted: list[tuple[int, int]] = []
    cache.on_evict = lambda block, key: evicted.append((block, key))
    first = list(range(8))
    blocks = compute(cache, first)  # two cached blocks, nobody using them
    assert evicted == []
    cache.allocate(3)  # two free blocks, then the least recently used cached one
    assert evicted == [(blocks[0], prefix_keys(first, SIZE)[0])]


def test_finish_policy_hears_of_each_block_its_last_user_lets_go() -> None:
    cache = PrefixCache(BlockAllocator(8), SIZE)
    idle: list[int] = []
    cache.on_idle = lambda _block, key: idle.append(key)
    compute(cache, list(range(9)))  # two full blocks and a partial one
    assert idle == prefix_keys(list(range(8)), SIZE)


def test_a_stored_prefix_is_loaded_after_the_pools_own_and_then_matched() -> None:
    cache = PrefixCache(BlockAllocator(8), SIZE)
    prompt = list(range(17))  # four full blocks and the last token
    compute(cache, prompt[:4])  # the pool holds block 0 itself
    found = [f"stored-{i}" for i in range(3)]  # the store holds blocks 0..2
    copied: list[tuple[int, str]] = []

    def load(block: int, name: str) -> bool:
        copied.append((block, name))
        return True

    assert cache.load_prefix(prompt, (len(prompt) - 1) // SIZE, found, load) == 2
    assert [name for _, name in copied] == ["stored-1", "stored-2"]  # block 0 was here
    blocks, keys = cache.match(prompt, 4)
    assert blocks[1:] == [block for block, _ in copied]
    assert keys == prefix_keys(prompt, SIZE)[:3]
    assert cache.stored_tokens == 2 * SIZE


def test_loading_never_evicts_the_prompts_own_blocks_after_the_gap() -> None:
    cache = PrefixCache(BlockAllocator(6), SIZE)
    prompt = list(range(13))  # three full blocks and the last token
    compute(cache, prompt[:12])
    compute(cache, list(range(100, 112)))  # another prompt's three: the pool is full
    cache.allocate(2)  # the prompt's first two blocks evicted (into the store), now in use
    assert len(cache.match(prompt, 3)[0]) == 0
    loaded = cache.load_prefix(prompt, 3, ["s0", "s1"], lambda _block, _name: True)
    assert loaded == 2  # room made from the other prompt's blocks, not the third of this one
    assert len(cache.match(prompt, 3)[0]) == 3


def test_a_refused_read_ends_the_loaded_prefix_and_frees_the_rest() -> None:
    cache = PrefixCache(BlockAllocator(8), SIZE)
    prompt = list(range(17))
    loaded = cache.load_prefix(prompt, 4, ["a", "b", "c"], lambda _block, name: name != "b")
    assert loaded == 1
    assert cache.num_free == 8  # the loaded block is cached, unused; the other two went back
    assert cache.num_cached == 1
    assert len(cache.match(prompt, 4)[0]) == 1


def test_a_stored_run_behind_the_pools_own_head_is_loaded_and_one_behind_a_gap_is_not() -> None:
    """Multi-turn chat: the shared system prompt stays hot in the pool and never reaches a
    store written on eviction, so the store's run of a history starts after it.
    Loaded behind the pool's own head; useless where the pool lacks that head."""
    cache = PrefixCache(BlockAllocator(8), SIZE)
    prompt = list(range(17))  # four full blocks and the last token
    compute(cache, prompt[:8])  # the pool holds blocks 0 and 1 (the shared head)
    load = lambda _block, _name: True  # noqa: E731
    assert cache.load_prefix(prompt, 4, ["s2", "s3"], load, positions=[2, 3]) == 2
    assert len(cache.match(prompt, 4)[0]) == 4
    other = PrefixCache(BlockAllocator(8), SIZE)  # a pool without the head
    assert other.load_prefix(prompt, 4, ["s2", "s3"], load, positions=[2, 3]) == 0
    assert other.num_cached == 0 and other.num_free == 8


def test_stored_blocks_fill_the_gaps_between_the_pools_own() -> None:
    """Multi-turn chat in the split layout: the pool holds the head and the middle of a
    history; the store holds what the pool evicted before it and the last answer, which a
    decode worker stored. Every gap is filled; a stored block after a gap neither fills
    is not."""
    cache = PrefixCache(BlockAllocator(16), SIZE)
    prompt = list(range(7 * SIZE + 1))  # seven full blocks and the last token
    keys = prefix_keys(prompt, SIZE)
    compute(cache, prompt[:SIZE])  # block 0 (the shared head) in the pool
    middle = cache.allocate(1)  # block 3 (the history's later part) in the pool
    cache.register(middle[0], keys[2], prompt[3 * SIZE : 4 * SIZE])
    cache.free(middle)
    copied: list[str] = []

    def load(_block: int, name: str) -> bool:
        copied.append(name)
        return True

    found, positions = ["s1", "s2", "s4", "s5", "s6"], [1, 2, 4, 5, 6]
    assert cache.load_prefix(prompt, 7, found, load, positions=positions) == 5
    assert copied == found
    assert cache.match(prompt, 7)[1] == keys

    lacking = PrefixCache(BlockAllocator(16), SIZE)
    compute(lacking, prompt[:SIZE])  # block 0 only: block 3 is nobody's
    assert lacking.load_prefix(prompt, 7, found, load, positions=positions) == 2


# ---------------------------------------------------------------- the supervisor's owner


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[KVStoreSettings]:
    shm = Path("/dev/shm") / f"kvwiring-{uuid.uuid4().hex}"
    shm.mkdir()
    yield KVStoreSettings(
        enabled=True,
        host_memory_mb=1,
        shm_dir=shm,
        disk_path=tmp_path / "disk",
        disk_mb=4,
    )
    for leftover in shm.iterdir():
        leftover.unlink()
    shm.rmdir()


def block_of(key: int) -> bytes:
    return hashlib.shake_256(key.to_bytes(8, "little")).digest(BLOCK)


def test_the_owner_serves_a_stored_run_after_a_head_the_store_lacks(
    settings: KVStoreSettings,
) -> None:
    owner = StoreOwner(settings, SIZE)
    owner.on_ready(StoreReady(1, NAMESPACE, BLOCK))
    assert owner.store is not None
    prompt = list(range(5 * SIZE + 1))
    keys = prefix_keys(prompt, SIZE)
    digest = NAMESPACE.digest()
    owner.on_put(StorePut(1, digest, [(k, block_of(k)) for k in keys[2:4]]))  # not 0, 1
    hits = owner.hits_for(1, 7, prompt)
    assert hits is not None and hits.positions == [2, 3] and hits.block_keys == keys[2:4]
    owner.on_release(StoreRelease(1, [7], [2]))
    assert not owner.store.index.pinned((digest, keys[2]))


def test_the_owner_serves_a_prompts_stored_prefix_and_frees_every_pin(
    settings: KVStoreSettings,
) -> None:
    owner = StoreOwner(settings, SIZE)
    owner.on_ready(StoreReady(1, NAMESPACE, BLOCK))
    owner.on_ready(StoreReady(2, NAMESPACE, BLOCK))
    assert owner.store is not None
    arena = owner.store.host.arena.path
    assert arena.exists()
    prompt = list(range(4 * SIZE + 1))
    keys = prefix_keys(prompt, SIZE)
    digest = NAMESPACE.digest()
    owner.on_put(StorePut(1, digest, [(k, block_of(k)) for k in keys[:3]]))

    hits = owner.hits_for(2, 7, prompt)  # worker 2 never computed it
    assert hits is not None and hits.block_keys == keys[:3]
    assert hits.arena == str(arena)
    for key, slot in zip(hits.block_keys, hits.slots, strict=True):
        view = owner.store.host.arena.read(slot, (digest, key))
        assert view is not None and bytes(view) == block_of(key)
        view.release()
    assert owner.store.index.pinned((digest, keys[0]))
    owner.on_release(StoreRelease(2, [7], [3]))
    assert not owner.store.index.pinned((digest, keys[0]))

    assert owner.hits_for(2, 8, prompt) is not None
    assert owner.forget_worker(2) == 3  # it died holding them: its pins go, bytes stay
    assert not owner.store.index.pinned((digest, keys[0]))
    figures = owner.figures()
    assert figures is not None
    assert figures.hits["host"] == 3 and figures.blocks["host"] == 3  # copied once

    owner.close()
    assert not arena.exists()  # the host tier goes with its owner...
    reopened = StoreOwner(settings, SIZE)  # ...after its blocks went to disk: a restart
    reopened.on_ready(StoreReady(1, NAMESPACE, BLOCK))
    hits = reopened.hits_for(1, 1, prompt)
    assert hits is not None and hits.block_keys == keys[:3]
    reopened.on_release(StoreRelease(1, [1], [3]))
    figures = reopened.figures()
    assert figures is not None and figures.hits == {"host": 0, "disk": 3}
    reopened.close()


def test_another_namespace_never_reads_the_blocks(settings: KVStoreSettings) -> None:
    owner = StoreOwner(settings, SIZE)
    owner.on_ready(StoreReady(1, NAMESPACE, BLOCK))
    owner.on_ready(StoreReady(2, OTHER, BLOCK))  # another KV dtype
    prompt = list(range(3 * SIZE + 1))
    keys = prefix_keys(prompt, SIZE)
    owner.on_put(StorePut(1, NAMESPACE.digest(), [(k, block_of(k)) for k in keys]))
    assert owner.hits_for(2, 1, prompt) is None
    assert owner.hits_for(1, 1, prompt) is not None
    owner.close()


def test_a_disabled_store_opens_nothing(settings: KVStoreSettings) -> None:
    owner = StoreOwner(settings.model_copy(update={"enabled": False}), SIZE)
    owner.on_ready(StoreReady(1, NAMESPACE, BLOCK))
    assert owner.store is None and owner.hits_for(1, 1, list(range(20))) is None
    assert list(settings.shm_dir.iterdir()) == []


def test_the_owner_serves_every_stored_run_of_a_prompt(settings: KVStoreSettings) -> None:
    """The store holds blocks 1-2 (evicted) and 4-5 (a decode worker's answer), not 0 and
    3 (in the pool): both runs come, with their positions."""
    owner = StoreOwner(settings, SIZE)
    owner.on_ready(StoreReady(1, NAMESPACE, BLOCK))
    assert owner.store is not None
    prompt = list(range(7 * SIZE + 1))
    keys = prefix_keys(prompt, SIZE)
    digest = NAMESPACE.digest()
    stored = [keys[i] for i in (1, 2, 4, 5)]
    owner.on_put(StorePut(1, digest, [(k, block_of(k)) for k in stored]))
    hits = owner.hits_for(1, 3, prompt)
    assert hits is not None and hits.positions == [1, 2, 4, 5] and hits.block_keys == stored
    assert owner.store.counters.misses == 1  # one prompt short of its blocks: one miss
    assert all(owner.store.index.pinned((digest, k)) for k in stored)
    owner.on_release(StoreRelease(1, [3], [4]))
    assert not any(owner.store.index.pinned((digest, k)) for k in stored)
    figures = owner.figures()
    assert figures is not None and figures.hits["host"] == 4
    owner.close()


def test_the_owner_tells_the_router_which_blocks_it_holds(settings: KVStoreSettings) -> None:
    owner = StoreOwner(settings, SIZE)
    assert owner.stored_keys(1, [1, 2]) == set()  # not open yet
    owner.on_ready(StoreReady(1, NAMESPACE, BLOCK))
    keys = prefix_keys(list(range(4 * SIZE)), SIZE)
    owner.on_put(StorePut(1, NAMESPACE.digest(), [(k, block_of(k)) for k in keys[1:3]]))
    assert owner.stored_keys(1, keys) == set(keys[1:3])
    # A worker of another KV dtype cannot load them: none are its (nor an unknown one's).
    owner.on_ready(StoreReady(2, OTHER, BLOCK))
    assert owner.stored_keys(2, keys) == set() and owner.stored_keys(3, keys) == set()
    assert (
        owner.store is not None and owner.store.index.pinned((NAMESPACE.digest(), keys[1])) is False
    )
    assert owner.figures() is not None and owner.figures().lookups == 0  # type: ignore[union-attr]
    owner.close()
