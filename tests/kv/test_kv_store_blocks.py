"""The KV store with its bytes: blocks put, pushed from shared memory to disk, looked up by
a prompt's chained keys and read back; the disk tier found again after a restart; a
corrupt file refused; another model's blocks never read."""

from __future__ import annotations

import hashlib
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance.kv.prefix_cache import prefix_keys
from appliance.kv_store.block_store import DISK_UNIT, BlockStore
from appliance.kv_store.host_arena import arena_path
from appliance.kv_store.namespace import StoreNamespace
from appliance.kv_store.tier_index import Hit
from appliance.settings.kv_store import KVStoreSettings

BLOCK = 4096  # one block's K/V bytes in these tests
DISK_FILE = 2 * DISK_UNIT  # what one takes on disk: its bytes, its file's header, rounded up
SMOL = StoreNamespace("smollm2-135m", "q8_0:abc", "bfloat16", 16).digest()
QWEN = StoreNamespace("qwen3-0.6b", "bf16:def", "bfloat16", 16).digest()
KEYS = prefix_keys(list(range(16 * 8)), 16)  # a prompt of eight full blocks

OpenStore = Callable[..., BlockStore]


def kv_bytes(namespace: bytes, key: int) -> bytes:
    return hashlib.shake_256(namespace + key.to_bytes(8, "little")).digest(BLOCK)


@pytest.fixture
def open_store() -> Iterator[OpenStore]:
    """Opens stores on fresh arenas under /dev/shm; closes them after the test."""
    opened: list[BlockStore] = []

    def make(host_blocks: int, disk_dir: Path | None = None, disk_blocks: int = 0) -> BlockStore:
        path = Path("/dev/shm") / f"appliance-kv-test-{uuid.uuid4().hex}"
        disk_bytes = disk_blocks * DISK_FILE
        store = BlockStore.open(path, host_blocks * BLOCK, BLOCK, disk_dir, disk_bytes)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def put_prompt(store: BlockStore, namespace: bytes = SMOL, keys: list[int] = KEYS) -> None:
    for key in keys:
        store.put((namespace, key), kv_bytes(namespace, key))


def read_all(store: BlockStore, hits: list[Hit]) -> list[bytes | None]:
    out = []
    for hit in hits:
        data = store.read(hit)
        out.append(None if data is None else bytes(data))
        if isinstance(data, memoryview):
            data.release()
    return out


def test_the_host_tier_alone_keeps_the_newest_blocks(open_store: OpenStore) -> None:
    store = open_store(host_blocks=5)
    put_prompt(store)
    assert store.index.keys("host") == [(SMOL, k) for k in KEYS[3:]]
    assert store.counters.dropped == 3 and store.host.free_slots == 0
    # The prompt's first blocks are gone, so nothing of it is a usable prefix.
    assert store.lookup(SMOL, KEYS) == []
    hits = store.lookup(SMOL, KEYS[3:])
    assert read_all(store, hits) == [kv_bytes(SMOL, k) for k in KEYS[3:]]
    store.release(hits)
    assert store.counters.hits == {"host": 5, "disk": 0}
    assert store.counters.bytes_read["host"] == 5 * BLOCK


def test_blocks_pushed_out_of_memory_are_read_back_from_disk(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = open_store(host_blocks=3, disk_dir=tmp_path, disk_blocks=100)
    put_prompt(store)
    hits = store.lookup(SMOL, KEYS)
    assert [h.tier for h in hits] == ["disk"] * 5 + ["host"] * 3
    assert read_all(store, hits) == [kv_bytes(SMOL, k) for k in KEYS]
    store.release(hits)
    assert store.counters.hits == {"host": 3, "disk": 5}
    assert store.counters.bytes_written == {"host": 8 * BLOCK, "disk": 5 * BLOCK}
    assert store.counters.dropped == 0


def test_a_restart_finds_the_disk_tier(open_store: OpenStore, tmp_path: Path) -> None:
    first = open_store(host_blocks=3, disk_dir=tmp_path, disk_blocks=100)
    put_prompt(first)
    first.close()
    again = open_store(host_blocks=3, disk_dir=tmp_path, disk_blocks=100)  # a new process
    # The host tier died with its owner: the prompt's first five blocks, on disk, remain.
    hits = again.lookup(SMOL, KEYS)
    assert [h.tier for h in hits] == ["disk"] * 5
    assert read_all(again, hits) == [kv_bytes(SMOL, k) for k in KEYS[:5]]
    again.release(hits)


def test_a_restart_with_a_smaller_disk_keeps_the_newest(
    open_store: OpenStore, tmp_path: Path
) -> None:
    first = open_store(host_blocks=1, disk_dir=tmp_path, disk_blocks=100)
    put_prompt(first)
    first.close()
    again = open_store(host_blocks=1, disk_dir=tmp_path, disk_blocks=4)
    assert len(again.index.keys("disk")) == 4
    assert again.index.used_bytes("disk") == 4 * DISK_FILE  # each file as the disk holds it
    assert len(list(tmp_path.glob("*/*.kv"))) == 4  # the others' files deleted


def test_a_corrupted_disk_block_is_refused_and_the_prefix_ends_there(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = open_store(host_blocks=2, disk_dir=tmp_path, disk_blocks=100)
    put_prompt(store)
    path = store.disk.path_of((SMOL, KEYS[2])) if store.disk else None
    assert path is not None
    raw = bytearray(path.read_bytes())
    raw[200] ^= 0xFF
    path.write_bytes(bytes(raw))
    hits = store.lookup(SMOL, KEYS)
    assert len(hits) == 8
    data = read_all(store, hits)
    store.release(hits)
    assert data[:2] == [kv_bytes(SMOL, k) for k in KEYS[:2]] and data[2] is None
    assert store.disk is not None and store.disk.counters.refused == 1
    # Forgotten: the next lookup's prefix stops before it, and the worker computes it.
    again = store.lookup(SMOL, KEYS)
    assert len(again) == 2
    store.release(again)
    store.put((SMOL, KEYS[2]), kv_bytes(SMOL, KEYS[2]))  # recomputed and stored again
    again = store.lookup(SMOL, KEYS)
    assert len(again) == 8
    store.release(again)


def test_another_models_store_on_the_same_folder_is_never_read(
    open_store: OpenStore, tmp_path: Path
) -> None:
    smol = open_store(host_blocks=1, disk_dir=tmp_path, disk_blocks=100)
    put_prompt(smol)
    smol.close()
    shared = open_store(host_blocks=1, disk_dir=tmp_path, disk_blocks=100)
    assert shared.lookup(QWEN, KEYS) == []  # the same tokens under another model: no hit
    put_prompt(shared, QWEN)
    hits = shared.lookup(QWEN, KEYS)
    assert read_all(shared, hits) == [kv_bytes(QWEN, k) for k in KEYS]
    shared.release(hits)
    hits = shared.lookup(SMOL, KEYS)
    assert read_all(shared, hits) == [kv_bytes(SMOL, k) for k in KEYS[:7]]
    shared.release(hits)


def test_a_block_being_read_is_never_pushed_out(open_store: OpenStore) -> None:
    store = open_store(host_blocks=2)
    put_prompt(store, keys=KEYS[:2])
    reading = store.lookup(SMOL, KEYS[:1])
    view = store.read(reading[0])
    assert isinstance(view, memoryview)
    put_prompt(store, keys=KEYS[2:])  # six more blocks through one free slot
    assert bytes(view) == kv_bytes(SMOL, KEYS[0])  # still this block's bytes
    assert store.index.tier_of((SMOL, KEYS[0])) == "host"
    view.release()
    store.release(reading)
    store.put((SMOL, 99), kv_bytes(SMOL, 99))
    assert store.index.tier_of((SMOL, KEYS[0])) is None  # now it may go


def test_a_disk_that_takes_no_writes_drops_blocks_and_serving_goes_on(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = open_store(host_blocks=2, disk_dir=tmp_path, disk_blocks=100)
    (tmp_path / SMOL.hex()).write_bytes(b"")  # the namespace's folder cannot be made
    put_prompt(store)
    assert store.disk is not None and store.disk.counters.write_errors == 6
    assert store.counters.dropped == 6 and store.index.count("disk") == 0
    hits = store.lookup(SMOL, KEYS[6:])
    assert read_all(store, hits) == [kv_bytes(SMOL, k) for k in KEYS[6:]]
    store.release(hits)


def test_clear_empties_both_tiers(open_store: OpenStore, tmp_path: Path) -> None:
    store = open_store(host_blocks=3, disk_dir=tmp_path, disk_blocks=100)
    put_prompt(store)
    assert store.clear() == 8
    assert store.lookup(SMOL, KEYS) == []
    assert store.host.free_slots == 3 and list(tmp_path.glob("*/*.kv")) == []


def test_a_disk_hit_promoted_is_read_from_shared_memory(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = open_store(host_blocks=4, disk_dir=tmp_path, disk_blocks=100)
    put_prompt(store)  # 0-3 on disk, 4-7 in host
    hits = store.lookup(SMOL, KEYS[:2])
    promoted = [store.promote(hit) for hit in hits]
    assert [h.tier for h in promoted if h is not None] == ["host", "host"]
    assert read_all(store, [h for h in promoted if h is not None]) == [
        kv_bytes(SMOL, k) for k in KEYS[:2]
    ]
    store.release(hits)
    assert store.counters.promoted == 2
    # Their files are gone; the two oldest host blocks took their place on disk.
    assert not store.disk or not store.disk.path_of((SMOL, KEYS[0])).exists()
    assert store.index.keys("disk") == [(SMOL, k) for k in [*KEYS[2:4], *KEYS[4:6]]]
    hits = store.lookup(SMOL, KEYS)
    assert read_all(store, hits) == [kv_bytes(SMOL, k) for k in KEYS]
    store.release(hits)


def test_a_corrupt_file_is_not_promoted(open_store: OpenStore, tmp_path: Path) -> None:
    store = open_store(host_blocks=1, disk_dir=tmp_path, disk_blocks=100)
    put_prompt(store, keys=KEYS[:2])
    assert store.disk is not None
    store.disk.path_of((SMOL, KEYS[0])).write_bytes(b"not a block")
    hits = store.lookup(SMOL, KEYS[:2])
    assert store.promote(hits[0]) is None
    store.release(hits)
    assert store.lookup(SMOL, KEYS[:2]) == []  # forgotten: computed again


def test_a_flushed_shutdown_keeps_the_host_tier_for_the_restart(
    open_store: OpenStore, tmp_path: Path
) -> None:
    first = open_store(host_blocks=3, disk_dir=tmp_path, disk_blocks=6)
    put_prompt(first)  # 0-4 on disk, 5-7 in host; the disk holds six
    first.close(flush=True)
    again = open_store(host_blocks=3, disk_dir=tmp_path, disk_blocks=6)
    # The newest six survive: the oldest were pushed off a full disk by the flush.
    assert again.index.keys("disk") == [(SMOL, k) for k in KEYS[2:]]
    assert again.lookup(SMOL, KEYS) == []  # the prompt's first blocks are gone...
    hits = again.lookup(SMOL, KEYS[2:])  # ...its later ones are there, in order
    assert read_all(again, hits) == [kv_bytes(SMOL, k) for k in KEYS[2:]]
    again.release(hits)


def test_a_run_put_tail_first_keeps_its_head_when_short_of_room(
    open_store: OpenStore,
) -> None:
    store = open_store(host_blocks=5)
    tiers = store.put_run(SMOL, KEYS, [kv_bytes(SMOL, k) for k in KEYS])
    assert tiers == ["host"] * 5 + [None] * 3  # stored, then pushed out by the head
    hits = store.lookup(SMOL, KEYS)
    assert read_all(store, hits) == [kv_bytes(SMOL, k) for k in KEYS[:5]]
    store.release(hits)
    with pytest.raises(ValueError, match="block keys for"):
        store.put_run(SMOL, KEYS, [])
    with pytest.raises(ValueError, match="larger than this store's slots"):
        store.put((SMOL, 1), bytes(BLOCK + 1))
    assert store.index.tier_of((SMOL, 1)) is None


def test_the_settings_open_the_store_and_a_dead_owners_arena_is_removed(
    tmp_path: Path,
) -> None:
    assert BlockStore.from_settings(KVStoreSettings(), BLOCK) is None  # off by default
    shm = tmp_path / "shm"
    shm.mkdir()
    stale = arena_path(shm, dead_pid())
    stale.write_bytes(b"left by a crash")
    unrelated = shm / "appliance-kv-notapid"
    unrelated.write_bytes(b"")
    settings = KVStoreSettings(
        enabled=True, host_memory_mb=1, shm_dir=shm, disk_path=tmp_path / "disk", disk_mb=1
    )
    store = BlockStore.from_settings(settings, BLOCK)
    assert store is not None
    try:
        assert not stale.exists() and unrelated.exists()
        assert store.host.arena.path == arena_path(shm, os.getpid())
        assert store.host.free_slots == (1 << 20) // BLOCK
        put_prompt(store)
        assert store.index.count("host") == 8 and (tmp_path / "disk").is_dir()
    finally:
        store.close()
    assert not arena_path(shm, os.getpid()).exists()


def dead_pid() -> int:
    """The id of a child that has exited and been reaped (so no process has it now)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_reader_that_dies_mid_copy_leaves_the_store_intact(open_store: OpenStore) -> None:
    store = open_store(host_blocks=4)
    put_prompt(store, keys=KEYS[:4])
    dying = store.lookup(SMOL, KEYS[:2], reader="prefill-0")
    living = store.lookup(SMOL, KEYS[:1], reader="prefill-1")
    view = store.read(dying[0])  # the worker dies here, its copy half done
    assert isinstance(view, memoryview)
    view.release()
    assert store.release_reader("prefill-0") == 2
    assert store.index.pinned((SMOL, KEYS[0]))  # still held by the living reader
    assert not store.index.pinned((SMOL, KEYS[1]))
    hits = store.lookup(SMOL, KEYS[:4])  # the bytes are the store's, unchanged
    assert read_all(store, hits) == [kv_bytes(SMOL, k) for k in KEYS[:4]]
    store.release(hits)
    with pytest.raises(ValueError, match="does not hold"):
        store.release(dying, reader="prefill-0")  # released already, with its reader
    store.release(living, reader="prefill-1")
    assert not store.index.pinned((SMOL, KEYS[0]))


def test_a_bad_release_leaves_every_pin_as_it_was(open_store: OpenStore) -> None:
    store = open_store(host_blocks=4)
    put_prompt(store, keys=KEYS[:2])
    held = store.lookup(SMOL, KEYS[:2], reader="prefill-0")
    with pytest.raises(ValueError, match="does not hold"):
        store.release(held + held, reader="prefill-0")  # the second copy is not held
    assert store.index.pinned((SMOL, KEYS[0])) and store.index.pinned((SMOL, KEYS[1]))
    store.release(held, reader="prefill-0")  # the good release still works whole
    assert not store.index.pinned((SMOL, KEYS[0])) and not store.index.pinned((SMOL, KEYS[1]))


def test_closing_while_a_block_is_read_still_removes_the_arena(open_store: OpenStore) -> None:
    store = open_store(host_blocks=2)
    put_prompt(store, keys=KEYS[:1])
    [hit] = store.lookup(SMOL, KEYS[:1])
    view = store.read(hit)
    assert isinstance(view, memoryview)
    with pytest.raises(BufferError):  # the unmap refuses while a view lives...
        store.close()
    assert not store.host.arena.path.exists()  # ...but the file went first
    view.release()
    store.host.arena.close()


def test_an_arena_named_for_our_own_pid_is_a_stale_one(tmp_path: Path) -> None:
    """A container restarted with the same pid over a kept shm_dir: the file is not ours."""
    stale = arena_path(tmp_path, os.getpid())
    stale.write_bytes(b"left by the earlier container")
    settings = KVStoreSettings(enabled=True, host_memory_mb=1, shm_dir=tmp_path)
    store = BlockStore.from_settings(settings, BLOCK)
    assert store is not None
    try:
        assert store.host.arena.path == stale and store.host.free_slots == (1 << 20) // BLOCK
    finally:
        store.close()
