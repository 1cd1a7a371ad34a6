"""The KV store's host tier: fixed-size slots in one shared file under /dev/shm, written by
the store's owner and read in place by another process."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import stat
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from appliance.kv_store.host_arena import HostArena
from appliance.kv_store.host_tier import HostTier
from appliance.kv_store.namespace import StoreNamespace

NS = StoreNamespace("smollm2-135m", "q8_0:abc", "bfloat16", 16).digest()
SLOT = 4096


@pytest.fixture
def arena_path() -> Iterator[Path]:
    path = Path("/dev/shm") / f"appliance-kv-test-{uuid.uuid4().hex}"
    yield path
    path.unlink(missing_ok=True)


def block(n: int, size: int = SLOT) -> bytes:
    return hashlib.shake_256(n.to_bytes(8, "little")).digest(size)


def test_a_block_reads_back_in_place_and_a_freed_slot_is_reused(arena_path: Path) -> None:
    tier = HostTier.create(arena_path, capacity_bytes=3 * SLOT + 100, slot_bytes=SLOT)
    assert tier.free_slots == 3
    assert stat.S_IMODE(os.stat(arena_path).st_mode) == 0o600  # prompts' K/V: ours only
    first = tier.write((NS, 1), block(1))
    tier.write((NS, 2), block(2, 100))  # a shorter block reads back at its own length
    view = tier.read((NS, 1))
    assert view is not None and view == block(1) and view.readonly is False
    view.release()
    short = tier.read((NS, 2))
    assert short is not None and bytes(short) == block(2, 100)
    short.release()
    tier.free((NS, 1))
    assert tier.read((NS, 1)) is None
    assert tier.write((NS, 3), block(3)) == first  # the freed slot
    # The old name in a reused slot is not read as the new block.
    assert tier.arena.read(first, (NS, 1)) is None
    tier.arena.close()


def test_the_tier_refuses_what_does_not_fit(arena_path: Path) -> None:
    with pytest.raises(ValueError, match="holds no block"):
        HostTier.create(arena_path, capacity_bytes=100, slot_bytes=SLOT)
    tier = HostTier.create(arena_path, capacity_bytes=SLOT, slot_bytes=SLOT)
    with pytest.raises(ValueError, match="larger than a slot"):
        tier.write((NS, 1), block(1, SLOT + 1))
    assert tier.free_slots == 1  # the refused write gave its slot back
    tier.write((NS, 1), block(1))
    with pytest.raises(ValueError, match="already"):
        tier.write((NS, 1), block(1))
    with pytest.raises(RuntimeError, match="no free host slot"):
        tier.write((NS, 2), block(2))
    with pytest.raises(FileExistsError):  # two owners would clobber each other's slots
        HostArena.create(arena_path, 1, SLOT)
    tier.arena.close()


def reader(conn: Connection, path: str, wanted: list[tuple[int, bytes, int]]) -> None:
    """Another worker: map the arena by its path and hash each block it is told of."""
    arena = HostArena.attach(Path(path))
    digests = []
    for slot, namespace, key in wanted:
        view = arena.read(slot, (namespace, key))
        digests.append(None if view is None else hashlib.blake2b(view).hexdigest())
        if view is not None:
            view.release()
    arena.close()
    conn.send((os.getpid(), digests))


@pytest.mark.process
def test_another_process_reads_the_same_bytes(arena_path: Path) -> None:
    tier = HostTier.create(arena_path, capacity_bytes=8 * SLOT, slot_bytes=SLOT)
    slots = [tier.write((NS, key), block(key)) for key in range(100, 108)]
    tier.free((NS, 103))  # gone before the reader looks: it must not get stale bytes
    wanted = [(slot, NS, key) for slot, key in zip(slots, range(100, 108), strict=True)]
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=reader, args=(theirs, str(arena_path), wanted))
    child.start()
    assert ours.poll(120), "the reader process did not answer"
    pid, digests = ours.recv()
    child.join(30)
    assert pid != os.getpid() and child.exitcode == 0
    expected = [hashlib.blake2b(block(key)).hexdigest() for key in range(100, 108)]
    expected[3] = None
    assert digests == expected
    tier.arena.close()
