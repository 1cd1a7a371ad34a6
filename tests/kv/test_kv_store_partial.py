"""The box's store and partial blocks, on plain data: a worker's kept tail goes to the
store like any cached block (its key: block_key over its n tokens), and the owner finds
it for a later prompt after the stored run (the longest n held, never the prompt's last
token, under the same salt and namespace), pinned until the worker releases it."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.kv.prefix_cache import block_key, prefix_keys
from appliance.kv_store.namespace import StoreNamespace
from appliance.pools.kv_store_owner import StoreOwner
from appliance.settings.kv_store import KVStoreSettings
from appliance.workers.messages import StorePut, StoreReady, StoreRelease

SIZE = 4
BLOCK = 8192
NAMESPACE = StoreNamespace("smollm2-135m", "q8_0:abc", "bfloat16", SIZE)
OTHER = StoreNamespace("smollm2-135m", "q8_0:abc", "float32", SIZE)


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[StoreOwner]:
    shm = Path("/dev/shm") / f"kvpartial-{uuid.uuid4().hex}"
    shm.mkdir()
    settings = KVStoreSettings(enabled=True, host_memory_mb=1, shm_dir=shm)
    owner = StoreOwner(settings, SIZE)
    owner.on_ready(StoreReady(1, NAMESPACE, BLOCK))
    owner.on_ready(StoreReady(2, OTHER, BLOCK))
    yield owner
    owner.close()
    for leftover in shm.iterdir():
        leftover.unlink()
    shm.rmdir()


def block_of(key: int) -> bytes:
    return hashlib.shake_256(key.to_bytes(8, "little")).digest(BLOCK)


def put(owner: StoreOwner, keys: list[int]) -> None:
    owner.on_put(StorePut(1, NAMESPACE.digest(), [(k, block_of(k)) for k in keys]))


def test_the_owner_serves_the_partial_block_after_the_stored_run(owner: StoreOwner) -> None:
    history = list(range(2 * SIZE + 3))  # two full blocks, then a tail of three
    keys = prefix_keys(history, SIZE)
    tail = block_key(keys[-1], history[2 * SIZE :])
    put(owner, [*keys, tail])
    prompt = [*history, 90, 91, 92]  # the next turn: the history, then more
    hits = owner.hits_for(1, 5, prompt)
    assert hits is not None and hits.block_keys == keys
    assert hits.partial is not None
    at, n, key, slot = hits.partial
    assert (at, n, key) == (2, 3, tail)
    assert owner.store is not None
    view = owner.store.host.arena.read(slot, (NAMESPACE.digest(), tail))
    assert view is not None and bytes(view) == block_of(tail)
    view.release()
    assert owner.store.index.pinned((NAMESPACE.digest(), tail))
    owner.on_release(StoreRelease(1, [5], [3]))
    assert not owner.store.index.pinned((NAMESPACE.digest(), tail))


def test_a_partial_alone_is_a_hit_and_the_last_token_is_never_covered(owner: StoreOwner) -> None:
    tail = block_key(None, [7, 8, 9])
    put(owner, [tail])
    hits = owner.hits_for(1, 1, [7, 8, 9, 10])
    assert hits is not None and hits.block_keys == [] and hits.partial is not None
    assert hits.partial[:3] == (0, 3, tail)
    owner.on_release(StoreRelease(1, [1], [1]))
    # [7, 8, 9] alone: the partial would cover the last token, which is computed.
    assert owner.hits_for(1, 2, [7, 8, 9]) is None


def test_a_partial_needs_the_same_prefix_salt_and_namespace(owner: StoreOwner) -> None:
    history = list(range(SIZE + 2))
    keys = prefix_keys(history, SIZE)
    put(owner, [keys[0], block_key(keys[0], history[SIZE:])])
    prompt = [*history, 50]
    other_head = [99, *prompt[1:]]
    hits = owner.hits_for(1, 1, other_head)
    assert hits is None
    assert owner.hits_for(1, 2, prompt, salt="tenant") is None
    assert owner.hits_for(2, 3, prompt) is None  # another KV dtype
    hits = owner.hits_for(1, 4, prompt)
    assert hits is not None and hits.partial is not None and hits.partial[1] == 2
