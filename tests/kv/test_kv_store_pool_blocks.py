"""A worker's KV blocks through the store and into another pool: bytes out of one pool,
through shared memory (read by another process) or a disk file, into another pool at
other block ids, equal to the last bit."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from appliance.kv.prefix_cache import prefix_keys
from appliance.kv_store.block_store import BlockStore
from appliance.kv_store.host_arena import HostArena
from appliance.kv_store.namespace import StoreNamespace
from appliance.kv_store.pool_blocks import block_bytes, load_block

# [layers, 2, blocks, block_size, kv_heads, head_dim]: a small pool of SmolLM2's shape
SHAPE = (30, 2, 6, 16, 3, 64)
NS = StoreNamespace("smollm2-135m", "q8_0:abc", "bfloat16", 16).digest()


def pool(seed: int | None) -> torch.Tensor:
    if seed is None:
        return torch.zeros(SHAPE, dtype=torch.bfloat16)
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def block_nbytes() -> int:
    return int(pool(None)[:, :, 0].numel()) * 2


def test_a_block_leaves_one_pool_and_lands_in_another(tmp_path: Path) -> None:
    src, dst = pool(1), pool(None)
    data = block_bytes(src, 4)
    assert data.dtype == torch.uint8 and data.numel() == block_nbytes()
    load_block(dst, 1, memoryview(data.numpy()))
    assert torch.equal(dst[:, :, 1], src[:, :, 4])
    assert dst[:, :, [0, 2, 3, 4, 5]].abs().sum() == 0  # no other block touched
    with pytest.raises(ValueError, match="does not fit"):
        load_block(dst, 0, bytes(block_nbytes() // 2))  # a float32 pool's half, say


def test_blocks_through_the_disk_tier_into_a_new_pool(tmp_path: Path) -> None:
    src, dst = pool(2), pool(None)
    keys = prefix_keys(list(range(16 * 3)), 16)
    arena = Path("/dev/shm") / f"appliance-kv-test-{uuid.uuid4().hex}"
    store = BlockStore.open(arena, block_nbytes(), block_nbytes(), tmp_path, 10 * block_nbytes())
    try:
        for block, key in zip([5, 0, 3], keys, strict=True):
            store.put((NS, key), block_bytes(src, block).numpy())
        hits = store.lookup(NS, keys)
        assert [h.tier for h in hits] == ["disk", "disk", "host"]
        for hit, block in zip(hits, [0, 1, 2], strict=True):
            data = store.read(hit)
            assert data is not None
            load_block(dst, block, data)
            if isinstance(data, memoryview):
                data.release()
        store.release(hits)
    finally:
        store.close()
    assert torch.equal(dst[:, :, [0, 1, 2]], src[:, :, [5, 0, 3]])


def other_worker(conn: Connection, path: str, wanted: list[tuple[int, bytes, int]]) -> None:
    """Another worker's process: map the arena, load each named slot into its own pool."""
    own = pool(None)
    arena = HostArena.attach(Path(path))
    for block, (slot, namespace, key) in enumerate(wanted):
        view = arena.read(slot, (namespace, key))
        assert view is not None, f"slot {slot} does not hold block {key:016x}"
        load_block(own, block, view)
        view.release()
    arena.close()
    # Plain bytes back: a tensor would travel as a shared-memory handle this process owns.
    conn.send(own[:, :, : len(wanted)].contiguous().view(torch.uint8).numpy().tobytes())


@pytest.mark.process
def test_another_worker_loads_the_blocks_from_shared_memory() -> None:
    src = pool(3)
    keys = prefix_keys(list(range(16 * 4)), 16)
    arena = Path("/dev/shm") / f"appliance-kv-test-{uuid.uuid4().hex}"
    store = BlockStore.open(arena, 4 * block_nbytes(), block_nbytes())
    try:
        for block, key in zip([2, 5, 1, 0], keys, strict=True):
            assert store.put((NS, key), block_bytes(src, block).numpy()) == "host"
        hits = store.lookup(NS, keys)  # pinned while the other process reads
        wanted = []
        for hit in hits:
            slot = store.host.slot_of(hit.key)
            assert slot is not None
            wanted.append((slot, *hit.key))
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=other_worker, args=(theirs, str(arena), wanted))
        child.start()
        assert ours.poll(180), "the other worker did not answer"
        raw = bytearray(ours.recv())
        child.join(30)
        store.release(hits)
    finally:
        store.close()
    assert child.exitcode == 0
    loaded = torch.frombuffer(raw, dtype=torch.bfloat16).view(30, 2, 4, 16, 3, 64)
    assert torch.equal(loaded, src[:, :, [2, 5, 1, 0]])
