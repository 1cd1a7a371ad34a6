"""Blocks written in place (issue 41): the store's owner reserves free arena slots for
each worker ahead of need; a worker copies a block its pool evicts straight into one,
seals it and says so; the owner commits it into the index and tops the worker's slots
up. No block's bytes cross a pipe unless a worker has no slot left (then counted). A
slot a worker filled and never committed (it died mid-write) comes back free, as does
every slot it held. An idle worker writes the blocks its pool evicts next ahead of need,
so the eviction that makes room for a prompt copies nothing."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.kv.block_allocator import BlockAllocator
from appliance.kv.prefix_cache import PrefixCache, prefix_keys
from appliance.kv_store.block_store import BlockStore
from appliance.kv_store.host_arena import HostArena
from appliance.kv_store.namespace import StoreNamespace
from appliance.kv_store.pool_blocks import block_bytes
from appliance.kv_store.tier_index import Move, StoreIndex, TierSpec
from appliance.pools.kv_store_owner import StoreOwner
from appliance.settings.kv_store import KVStoreSettings
from appliance.workers.messages import (
    FromWorker,
    StorePut,
    StoreReady,
    StoreRelease,
    StoreSlots,
    StoreWritten,
    ToWorker,
)
from appliance.workers.outboxes import Outbox
from appliance.workers.store_client import StoreClient

BLOCK = 4096
SIZE = 4  # tokens a block
NAMESPACE = StoreNamespace("smollm2-135m", "q8_0:abc", "float32", SIZE)
NS = NAMESPACE.digest()


def kv_bytes(key: int, n: int = BLOCK) -> bytes:
    return hashlib.shake_256(key.to_bytes(8, "little")).digest(n)


def fill(arena: HostArena, slot: int, key: int, seal: bool = True) -> None:
    """What a worker does with a reserved slot: the payload in place, then the header."""
    view = arena.payload(slot, BLOCK)
    view[:] = kv_bytes(key)
    view.release()
    if seal:
        arena.seal(slot, (NS, key), BLOCK)


@pytest.fixture
def open_store() -> Iterator[Callable[[int], BlockStore]]:
    opened: list[BlockStore] = []

    def make(host_blocks: int) -> BlockStore:
        path = Path("/dev/shm") / f"appliance-kv-test-{uuid.uuid4().hex}"
        opened.append(BlockStore.open(path, host_blocks * BLOCK, BLOCK))
        return opened[-1]

    yield make
    for store in opened:
        store.close()


def test_reserved_room_counts_against_the_host_tier() -> None:
    index = StoreIndex(TierSpec(3 * BLOCK, unit_bytes=BLOCK))
    for key in (1, 2, 3):
        index.insert((NS, key), BLOCK)
    assert index.reserve(BLOCK) == [Move((NS, 1), "host", None)]  # the oldest makes room
    assert index.count("host") == 2 and index.reserved_bytes() == BLOCK
    assert index.insert((NS, 4), BLOCK).moves == [Move((NS, 2), "host", None)]
    assert index.insert_reserved((NS, 5), BLOCK, BLOCK).tier == "host"
    assert index.reserved_bytes() == 0 and index.keys("host") == [(NS, 3), (NS, 4), (NS, 5)]
    index.pin([h for h in index.lookup(NS, [3, 4, 5])])
    assert index.reserve(BLOCK) is None  # everything pinned: no room, nothing changed
    assert index.reserved_bytes() == 0 and index.count("host") == 3
    with pytest.raises(ValueError, match="unreserved"):
        index.unreserve(BLOCK)


def test_a_block_written_in_a_reserved_slot_is_committed_and_served(
    open_store: Callable[[int], BlockStore],
) -> None:
    store = open_store(4)
    slots = store.reserve(3)
    assert len(slots) == 3 and store.host.free_slots == 1 and store.host.reserved_slots == 3
    fill(store.host.arena, slots[0], 10)
    assert store.commit(slots[0], (NS, 10)) == "host"
    hits = store.lookup(NS, [10])
    view = store.read(hits[0])
    assert view is not None and bytes(view) == kv_bytes(10)
    if isinstance(view, memoryview):
        view.release()
    store.release(hits)
    assert store.counters.in_place == 1 and store.counters.bytes_written["host"] == BLOCK

    fill(store.host.arena, slots[1], 10)  # another worker stored it first: slot back
    assert store.commit(slots[1], (NS, 10)) == "host"
    fill(store.host.arena, slots[2], 11, seal=False)  # never sealed: refused, slot back
    assert store.commit(slots[2], (NS, 11)) is None
    assert store.host.free_slots == 3 and store.host.reserved_slots == 0
    assert store.index.reserved_bytes() == 0 and store.index.count("host") == 1
    assert store.host.arena.holder(slots[2]) is None
    with pytest.raises(ValueError, match="not reserved"):
        store.commit(slots[2], (NS, 11))


def test_reserved_slots_push_out_the_oldest_blocks_only_as_far_as_the_pins_allow(
    open_store: Callable[[int], BlockStore],
) -> None:
    store = open_store(3)
    for key in (1, 2, 3):
        store.put((NS, key), kv_bytes(key))
    pinned = store.lookup(NS, [1, 2])
    assert len(store.reserve(5)) == 1  # block 3 dropped; 1 and 2 are being read
    assert store.index.tier_of((NS, 3)) is None and store.counters.dropped == 1
    store.release(pinned)


def writer(conn: Connection, path: str, slots: list[int]) -> None:
    """A worker: a block whole and sealed in the first slot (its StoreWritten never
    sent), half a block in the second; then it waits to be killed."""
    arena = HostArena.attach(Path(path))
    fill(arena, slots[0], 20)
    view = arena.payload(slots[1], BLOCK)
    view[: BLOCK // 2] = kv_bytes(21)[: BLOCK // 2]
    view.release()
    conn.send(os.getpid())
    signal.pause()


@pytest.fixture
def settings() -> Iterator[KVStoreSettings]:
    shm = Path("/dev/shm") / f"kvinplace-{uuid.uuid4().hex}"
    shm.mkdir()
    yield KVStoreSettings(enabled=True, host_memory_mb=1, shm_dir=shm)
    for leftover in shm.iterdir():
        leftover.unlink()
    shm.rmdir()


@pytest.mark.process
def test_a_worker_killed_mid_write_leaves_every_slot_free(settings: KVStoreSettings) -> None:
    sent: list[tuple[int | None, ToWorker]] = []
    owner = StoreOwner(settings, SIZE, send=lambda w, m: sent.append((w, m)))
    owner.on_ready(StoreReady(1, NAMESPACE, BLOCK))
    store = owner.store
    assert store is not None
    handed = sent[0][1]
    assert isinstance(handed, StoreSlots) and sent[0][0] == 1
    total = store.host.arena.slots  # 1 MiB of 4 KiB blocks: 256, a worker holds 32
    assert len(handed.slots) == 32 and store.host.reserved_slots == 32

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=writer, args=(theirs, handed.arena, handed.slots[:2]))
    child.start()
    assert ours.poll(120), "the writer process did not start writing"
    pid = ours.recv()
    os.kill(pid, signal.SIGKILL)
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    assert store.host.arena.holder(handed.slots[0]) is not None  # its block, uncommitted

    owner.forget_worker(1)  # as the supervisor does when a worker exits
    assert store.host.reserved_slots == 0 and store.host.free_slots == total
    assert store.index.reserved_bytes() == 0 and store.index.count("host") == 0
    assert all(store.host.arena.holder(slot) is None for slot in range(total))
    # Its last words, read after it was forgotten: those slots are not its any more.
    owner.on_written(StoreWritten(1, NS, [(20, handed.slots[0])]))
    assert store.index.count("host") == 0 and store.host.free_slots == total
    owner.close()


def test_the_owner_commits_tops_up_and_counts_what_no_longer_crosses_the_pipe(
    settings: KVStoreSettings,
) -> None:
    sent: list[tuple[int | None, ToWorker]] = []
    owner = StoreOwner(settings, SIZE, send=lambda w, m: sent.append((w, m)))
    owner.on_ready(StoreReady(1, NAMESPACE, BLOCK))
    store = owner.store
    assert store is not None
    handed = sent[-1][1]
    assert isinstance(handed, StoreSlots)
    prompt = list(range(3 * SIZE + 1))
    keys = prefix_keys(prompt, SIZE)
    for key, slot in zip(keys, handed.slots, strict=False):
        fill(store.host.arena, slot, key)
    owner.on_written(StoreWritten(1, NS, list(zip(keys, handed.slots, strict=False))))
    topped = sent[-1][1]
    assert isinstance(topped, StoreSlots) and len(topped.slots) == 3  # back to 32
    assert store.host.reserved_slots == 32
    hits = owner.hits_for(1, 7, prompt)
    assert hits is not None and hits.block_keys == keys
    figures = owner.figures()
    assert figures is not None
    assert (figures.put_blocks, figures.put_in_place) == (3, 3)
    assert figures.put_in_place_bytes == 3 * BLOCK and figures.put_piped_bytes == 0
    assert figures.reserved_slots == 32
    owner.on_put(StorePut(1, NS, [(99, kv_bytes(99))]))  # a worker out of slots
    figures = owner.figures()
    assert figures is not None and figures.put_piped_bytes == BLOCK
    owner.close()


BIG = 64 * 1024  # a block of 64 KiB: a 1 MiB arena holds 16, a worker's share is 2


def starved(settings: KVStoreSettings) -> tuple[StoreOwner, list[tuple[int | None, ToWorker]]]:
    """Worker 2 holds its 2 slots and the store's other 14 as pinned hits of request 7
    when worker 1 loads: worker 1 gets no slot (it pipes its blocks meanwhile)."""
    sent: list[tuple[int | None, ToWorker]] = []
    owner = StoreOwner(settings, SIZE, send=lambda w, m: sent.append((w, m)))
    owner.on_ready(StoreReady(2, NAMESPACE, BIG))
    store = owner.store
    assert store is not None and store.host.arena.slots == 16
    assert [(w, len(cast(StoreSlots, m).slots)) for w, m in sent] == [(2, 2)]
    prompt = list(range(14 * SIZE + 1))
    keys = prefix_keys(prompt[:-1], SIZE)
    owner.on_put(StorePut(2, NS, [(k, kv_bytes(k, BIG)) for k in keys]))
    hits = owner.hits_for(2, 7, prompt)
    assert hits is not None and len(hits.slots) == 14
    assert sent[1:] == []  # worker 2 holds its share: nothing more for it
    owner.on_ready(StoreReady(1, NAMESPACE, BIG))
    assert sent[1:] == []  # nothing free, nothing to push out
    return owner, sent


def test_a_worker_that_got_no_slot_gets_some_once_the_pins_go(
    settings: KVStoreSettings,
) -> None:
    """A worker with no reserved slot sends only StorePut, so no StoreWritten ever tops it
    up: the release of the pins that filled the store must."""
    owner, sent = starved(settings)
    owner.on_release(StoreRelease(2, [7], [14]))
    assert [(w, len(cast(StoreSlots, m).slots)) for w, m in sent[1:]] == [(1, 2)]
    owner.close()


def test_a_worker_piping_for_want_of_a_slot_is_topped_up_by_its_put(
    settings: KVStoreSettings,
) -> None:
    """Room came while worker 1 had no slot (worker 2 exited: its pins and slots went):
    the block worker 1 pipes brings it slots, so its next blocks are written in place."""
    owner, sent = starved(settings)
    owner.forget_worker(2)
    assert sent[1:] == []
    owner.on_put(StorePut(1, NS, [(99, kv_bytes(99, BIG))]))
    assert [(w, len(cast(StoreSlots, m).slots)) for w, m in sent[1:]] == [(1, 2)]
    figures = owner.figures()
    assert figures is not None and figures.put_piped_bytes == 15 * BIG
    owner.close()


def test_only_blocks_the_store_took_are_counted_as_put(settings: KVStoreSettings) -> None:
    """A reserved slot whose header does not name its block (written, never sealed) is
    not committed, and a piped block with no room (all pinned or reserved) not stored:
    neither counts as a block the workers put."""
    owner, sent = starved(settings)
    store = owner.store
    assert store is not None
    owner.on_put(StorePut(1, NS, [(99, kv_bytes(99, BIG))]))  # no slot, no room
    assert not store.holds(NS, 99)
    slot = cast(StoreSlots, sent[0][1]).slots[0]  # worker 2's
    view = store.host.arena.payload(slot, BIG)
    view[:] = kv_bytes(98, BIG)
    view.release()  # and no seal: a header naming no block
    owner.on_written(StoreWritten(2, NS, [(98, slot)]))
    assert not store.holds(NS, 98)
    figures = owner.figures()
    assert figures is not None
    assert (figures.put_blocks, figures.put_in_place) == (14, 0)  # worker 2's piped ones
    owner.close()


# ---------------------------------------------------------------- the worker's side


class Sent:
    """The worker's outbox, kept: what it would send the supervisor."""

    def __init__(self) -> None:
        self.messages: list[FromWorker] = []

    def put(self, message: FromWorker) -> None:
        self.messages.append(message)


def worker_client(pool: torch.Tensor, decodes: bool = False) -> tuple[StoreClient, PrefixCache]:
    """A worker's store client over a real prefix cache and pool (the engine's parts it
    uses; no model); `decodes`: a decode worker's."""
    cache = PrefixCache(BlockAllocator(pool.shape[2]), SIZE)
    kv = SimpleNamespace(tensor=pool, block_size=SIZE)
    engine = SimpleNamespace(scheduler=SimpleNamespace(blocks=cache), kv=kv)
    return StoreClient(1, cast(LLMEngine, engine), NAMESPACE, decodes_handoffs=decodes), cache


def compute(cache: PrefixCache, pool: torch.Tensor, tokens: list[int]) -> list[int]:
    """A sequence that computed `tokens` (its blocks' K/V made up), cached and let go."""
    blocks = cache.allocate(len(tokens) // SIZE)
    previous = None
    for i, block in enumerate(blocks):
        pool[:, :, block] = torch.randn(pool[:, :, block].shape)
        previous = cache.register(block, previous, tokens[i * SIZE : (i + 1) * SIZE])
    cache.free(blocks)
    return blocks


def test_a_worker_writes_evicted_blocks_in_place_and_an_idle_one_ahead_of_need(
    settings: KVStoreSettings,
) -> None:
    # [layers, 2, blocks, block_size, kv_heads, head_dim]: a block is 512 bytes
    pool = torch.zeros(2, 2, 8, SIZE, 1, 8)
    client, cache = worker_client(pool)
    assert client.cuda is None  # a CPU pool copies directly (no staging, no side stream)
    outbox = Sent()
    sent: list[tuple[int | None, ToWorker]] = []
    owner = StoreOwner(settings, SIZE, send=lambda w, m: sent.append((w, m)))
    owner.on_ready(StoreReady(1, NAMESPACE, client.block_nbytes))
    store = owner.store
    assert store is not None
    for _, message in sent:
        assert isinstance(message, StoreSlots)
        client.take_slots(message)

    first = list(range(4 * SIZE))
    blocks = compute(cache, pool, first)
    keys = prefix_keys(first, SIZE)
    expected = {k: bytes(block_bytes(pool, b).numpy()) for k, b in zip(keys, blocks, strict=True)}
    held = cache.allocate(6)  # four free blocks, then the two oldest cached ones, evicted
    client.send(cast(Outbox, outbox))
    assert [type(m) for m in outbox.messages] == [StoreWritten]
    for message in outbox.messages:
        owner.on_written(cast(StoreWritten, message))
    for key in keys[:2]:
        hits = store.lookup(NS, [key])
        data = store.read(hits[0])
        assert data is not None and bytes(data) == expected[key]  # the pool's bytes
        if isinstance(data, memoryview):
            data.release()
        store.release(hits)
    figures = owner.figures()
    assert figures is not None and figures.put_in_place == 2 and figures.put_piped_bytes == 0

    # Idle: the two blocks next in line are written now; evicting them copies nothing.
    outbox.messages.clear()
    assert client.clean_ahead(cast(Outbox, outbox)) == 2
    assert client.clean_ahead(cast(Outbox, outbox)) == 0  # nothing more to write
    for message in outbox.messages:
        owner.on_written(cast(StoreWritten, message))
    assert all(store.holds(NS, key) for key in keys)
    outbox.messages.clear()
    slots = len(client.slots)
    held += cache.allocate(2)
    client.send(cast(Outbox, outbox))
    # No copy: the store is only told to count them as recent as this eviction.
    [refresh] = cast(list[StoreWritten], outbox.messages)
    assert refresh.blocks == [] and sorted(refresh.refreshed) == sorted(keys[2:])
    assert len(client.slots) == slots
    outbox.messages.clear()

    # With no slot left, a block's bytes go in the report (counted).
    client.slots.clear()
    cache.free(held)
    compute(cache, pool, list(range(100, 100 + SIZE)))
    cache.allocate(8)  # seven free, then the one cached
    client.send(cast(Outbox, outbox))
    assert [type(m) for m in outbox.messages] == [StorePut] and client.piped_blocks == 1
    owner.close()


def test_a_copy_into_a_slot_that_fails_gives_the_slot_back(
    settings: KVStoreSettings,
) -> None:
    """A block's copy into its reserved slot raises (here the pool's blocks no longer fit
    the slots): the error goes on, and the slot is the worker's to fill again, not lost
    until it exits."""
    pool = torch.zeros(2, 2, 8, SIZE, 1, 8)
    client, cache = worker_client(pool)
    sent: list[tuple[int | None, ToWorker]] = []
    owner = StoreOwner(settings, SIZE, send=lambda w, m: sent.append((w, m)))
    owner.on_ready(StoreReady(1, NAMESPACE, client.block_nbytes))
    client.take_slots(cast(StoreSlots, sent[-1][1]))
    reserved = sorted(client.slots)
    compute(cache, pool, list(range(2 * SIZE)))
    kv = cast(SimpleNamespace, client.engine.kv)
    kv.tensor = torch.zeros(2, 2, 8, SIZE, 1, 4)  # half a slot's bytes a block
    outbox = Sent()
    with pytest.raises(ValueError, match="does not fit a pool block"):
        client.clean_ahead(cast(Outbox, outbox))
    assert sorted(client.slots) == reserved and client.written == []
    kv.tensor = pool
    assert client.clean_ahead(cast(Outbox, outbox)) == 2
    written = cast(StoreWritten, outbox.messages[-1]).blocks
    assert sorted(client.slots + [slot for _, slot in written]) == reserved
    owner.close()


def test_a_decode_worker_writes_ahead_none_of_the_prompt_blocks_handed_to_it(
    settings: KVStoreSettings,
) -> None:
    pool = torch.zeros(2, 2, 8, SIZE, 1, 8)
    client, cache = worker_client(pool, decodes=True)
    sent: list[tuple[int | None, ToWorker]] = []
    owner = StoreOwner(settings, SIZE, send=lambda w, m: sent.append((w, m)))
    owner.on_ready(StoreReady(1, NAMESPACE, client.block_nbytes))
    client.take_slots(cast(StoreSlots, sent[-1][1]))
    prompt = list(range(3 * SIZE))
    client.handed_off(prompt, "")  # prefilled elsewhere: the prefill side stores them
    compute(cache, pool, prompt)
    outbox = Sent()
    assert client.clean_ahead(cast(Outbox, outbox)) == 0 and outbox.messages == []
    owner.close()


def test_an_idle_worker_writes_ahead_a_slice_at_a_time(settings: KVStoreSettings) -> None:
    """Writing ahead goes a slice of blocks a call, so a prompt arriving while an idle
    worker writes waits for a few copies, not all 32: the worker's loop looks at its inbox
    between slices (without blocking while `cleaning`), and every block gets written."""
    pool = torch.zeros(2, 2, 16, SIZE, 1, 8)
    client, cache = worker_client(pool)
    sent: list[tuple[int | None, ToWorker]] = []
    owner = StoreOwner(settings, SIZE, send=lambda w, m: sent.append((w, m)))
    owner.on_ready(StoreReady(1, NAMESPACE, client.block_nbytes))
    client.take_slots(cast(StoreSlots, sent[-1][1]))
    blocks = compute(cache, pool, list(range(10 * SIZE)))
    outbox = Sent()
    assert client.cleaning
    assert [client.clean_ahead(cast(Outbox, outbox), budget=4) for _ in range(3)] == [4, 4, 2]
    assert not client.cleaning  # the last slice reached the end of the line
    assert client.clean_ahead(cast(Outbox, outbox), budget=4) == 0
    written = [key for m in outbox.messages for key, _ in cast(StoreWritten, m).blocks]
    assert sorted(written) == sorted(key for _, key in cache.cached_blocks())
    assert len(written) == len(blocks)
    owner.close()


def test_blocks_evicted_uncopied_are_made_recent_in_the_store(
    settings: KVStoreSettings,
) -> None:
    """A block written ahead is ranked in the store's LRU by when it was written; the
    pool may use it long after. When the pool evicts it, the worker copies nothing (the
    store has it) but names it in its next StoreWritten, and the store makes it its
    most recent: blocks written since are pushed out before it."""
    pool = torch.zeros(2, 2, 8, SIZE, 1, 8)
    client, cache = worker_client(pool)
    sent: list[tuple[int | None, ToWorker]] = []
    owner = StoreOwner(settings, SIZE, send=lambda w, m: sent.append((w, m)))
    owner.on_ready(StoreReady(1, NAMESPACE, client.block_nbytes))
    client.take_slots(cast(StoreSlots, sent[-1][1]))
    store = owner.store
    assert store is not None
    outbox = Sent()

    def deliver() -> None:
        client.send(cast(Outbox, outbox))
        for message in outbox.messages:
            owner.on_written(cast(StoreWritten, message))

    first = list(range(4 * SIZE))
    compute(cache, pool, first)
    assert client.clean_ahead(cast(Outbox, outbox)) == 4  # written ahead: the oldest
    later = list(range(500, 500 + 2 * SIZE))
    compute(cache, pool, later)
    assert client.clean_ahead(cast(Outbox, outbox)) == 2  # written after them
    deliver()
    keys, later_keys = prefix_keys(first, SIZE), prefix_keys(later, SIZE)
    assert [k for _, k in store.index.keys("host")] == keys + later_keys
    slots = len(client.slots)

    outbox.messages.clear()
    cache.allocate(4)  # the two free blocks, then two of the first prompt's, evicted
    pooled = {key for _, key in cache.cached_blocks()}
    evicted = [k for k in keys if k not in pooled]
    assert len(evicted) == 2
    deliver()
    [message] = cast(list[StoreWritten], outbox.messages)
    assert message.blocks == [] and sorted(message.refreshed) == sorted(evicted)
    assert len(client.slots) == slots and client.piped_blocks == 0  # nothing copied
    order = [k for _, k in store.index.keys("host")]
    assert set(order[-2:]) == set(evicted)  # the most recent now, after `later`'s blocks
    assert order[:4] == [k for k in keys if k in pooled] + later_keys
    owner.close()


def test_under_write_policy_finish_an_eviction_refreshes_the_stored_block(
    settings: KVStoreSettings,
) -> None:
    pool = torch.zeros(2, 2, 4, SIZE, 1, 8)
    cache = PrefixCache(BlockAllocator(pool.shape[2]), SIZE)
    kv = SimpleNamespace(tensor=pool, block_size=SIZE)
    engine = SimpleNamespace(scheduler=SimpleNamespace(blocks=cache), kv=kv)
    client = StoreClient(1, cast(LLMEngine, engine), NAMESPACE, evict_policy=False)
    sent: list[tuple[int | None, ToWorker]] = []
    owner = StoreOwner(settings, SIZE, send=lambda w, m: sent.append((w, m)))
    owner.on_ready(StoreReady(1, NAMESPACE, client.block_nbytes))
    client.take_slots(cast(StoreSlots, sent[-1][1]))
    outbox = Sent()
    prompt = list(range(2 * SIZE))
    compute(cache, pool, prompt)  # stored as the request lets go
    client.send(cast(Outbox, outbox))
    [written] = cast(list[StoreWritten], outbox.messages)
    assert [key for key, _ in written.blocks] == prefix_keys(prompt, SIZE)
    assert written.refreshed == []
    outbox.messages.clear()
    cache.allocate(4)  # both evicted: stored already, only refreshed
    client.send(cast(Outbox, outbox))
    [refresh] = cast(list[StoreWritten], outbox.messages)
    assert refresh.blocks == [] and sorted(refresh.refreshed) == sorted(prefix_keys(prompt, SIZE))
    owner.close()
