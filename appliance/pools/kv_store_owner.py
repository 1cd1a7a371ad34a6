"""The supervisor's side of the box's KV store (issue 41): it owns the one store of the
box and serves it to the workers over their message queues.

The store opens when the first worker says StoreReady (a block's size is the model's, known
once a worker loaded it; None while kv_store.enabled is off, and no worker says it then).
Before a prompt goes to a worker, `hits_for` looks its full blocks up under that worker's
namespace, brings disk hits into shared memory, pins them for the worker and names their
slots (StoreHits); the worker copies them into its pool and answers StoreRelease. Blocks
the workers send (StorePut) go in. A worker that exits lets go of its pins; at shutdown
the host tier goes to disk (a restart finds it there) and the arena file is removed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from appliance.kv.prefix_cache import prefix_keys
from appliance.kv_store.block_store import BlockStore
from appliance.kv_store.tier_index import Hit, Tier
from appliance.settings.kv_store import KVStoreSettings
from appliance.workers.messages import StoreHits, StorePut, StoreReady, StoreRelease

log = logging.getLogger("appliance.kv_store")


@dataclass(frozen=True)
class StoreFigures:
    """The store's figures for /metrics and the admin snapshot (counts since it opened)."""

    hits: dict[str, int]  # blocks workers copied from the store, by the tier they were in
    misses: int  # lookups whose prefix stopped short of the prompt's full blocks
    lookups: int
    bytes_read: dict[str, int]  # bytes of the blocks served, by tier
    bytes_written: dict[str, int]  # bytes put into each tier (demotions to disk included)
    blocks: dict[str, int]  # held now, by tier
    used_bytes: dict[str, int]  # what they take, by tier
    capacity_bytes: dict[str, int]
    dropped: int
    refused: int  # disk blocks whose file failed its checks: dropped, recomputed
    put_blocks: int  # blocks the workers sent


class StoreOwner:
    """The box's store, opened at the first worker's StoreReady."""

    def __init__(self, settings: KVStoreSettings, block_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.store: BlockStore | None = None
        self._namespaces: dict[int, bytes] = {}  # worker -> its namespace's digest
        # (worker, request) -> its hits, each with the tier it was found in and its size
        self._pinned: dict[tuple[int, int], list[tuple[Hit, Tier, int]]] = {}
        self._served: dict[str, int] = {"host": 0, "disk": 0}
        self._served_bytes: dict[str, int] = {"host": 0, "disk": 0}
        self._lookups = 0
        self._put_blocks = 0

    def on_ready(self, message: StoreReady) -> None:
        """A worker loaded: open the store for its block size (the first), note its
        namespace. A worker whose blocks do not fit the slots does not use the store."""
        if not self.settings.enabled:
            return
        if self.store is None:
            self.store = BlockStore.from_settings(self.settings, message.block_bytes)
            assert self.store is not None
            log.info(
                "KV store open: %d host slots of %d bytes at %s, disk tier %s",
                self.store.host.arena.slots,
                message.block_bytes,
                self.store.host.arena.path,
                self.settings.disk_path or "off",
            )
        if message.block_bytes > self.store.host.arena.slot_bytes:
            log.warning("worker %d's blocks do not fit the store's slots", message.worker_id)
            return
        self._namespaces[message.worker_id] = message.namespace.digest()

    def hits_for(
        self, worker_id: int, request_id: int, token_ids: list[int], salt: str = ""
    ) -> StoreHits | None:
        """The stored blocks of this prompt's prefix (under the request's cache_salt
        `salt`), pinned for `worker_id` and in shared memory (disk hits are promoted
        first), or None where there are none. The block with the prompt's last token is
        never asked for: the worker computes it."""
        namespace = self._namespaces.get(worker_id)
        store = self.store
        if store is None or namespace is None:
            return None
        full = (len(token_ids) - 1) // self.block_size
        keys = prefix_keys(token_ids[: full * self.block_size], self.block_size, salt)
        if not keys:
            return None
        self._lookups += 1
        reader = str(worker_id)
        # A head the store lacks may be in the worker's pool (a shared system prompt stays
        # hot there and is never evicted into the store): the run starts after it.
        first = next((i for i, key in enumerate(keys) if store.holds(namespace, key)), 0)
        hits = store.lookup(namespace, keys[first:], reader)
        slots: list[int] = []
        for hit in hits:
            held = store.promote(hit)  # a disk hit into a host slot; None: its file was bad
            slot = None if held is None else store.host.slot_of(hit.key)
            if slot is None:
                break
            slots.append(slot)
        store.release(hits[len(slots) :], reader)
        if not slots:
            return None
        self._pinned[(worker_id, request_id)] = [
            (hit, hit.tier, store.index.nbytes(hit.key)) for hit in hits[: len(slots)]
        ]
        arena = str(store.host.arena.path)
        run = keys[first : first + len(slots)]
        return StoreHits(request_id, arena, namespace, run, slots, first)

    def on_put(self, message: StorePut) -> None:
        """Blocks a worker sent: into the store (a block of the wrong size is refused)."""
        if self.store is None:
            return
        for key, data in message.blocks:
            try:
                self.store.put((message.namespace, key), data)
            except ValueError as exc:
                log.warning("worker %d: %s", message.worker_id, exc)
                return
            self._put_blocks += 1

    def on_release(self, message: StoreRelease) -> None:
        """A worker copied these requests' hits: they may be pushed out again."""
        if self.store is None:
            return
        for request_id, loaded in zip(message.request_ids, message.loaded, strict=True):
            pinned = self._pinned.pop((message.worker_id, request_id), [])
            # Served: the blocks the worker copied (those it held already are its own hits).
            for _, tier, nbytes in pinned[:loaded]:
                self._served[tier] += 1
                self._served_bytes[tier] += nbytes
            self.store.release([hit for hit, _, _ in pinned], str(message.worker_id))

    def forget_worker(self, worker_id: int) -> int:
        """A worker exited (maybe mid-copy): its pins go; the store's bytes are as they were.
        Returns how many pins it held."""
        self._namespaces.pop(worker_id, None)
        for key in [k for k in self._pinned if k[0] == worker_id]:
            del self._pinned[key]
        return 0 if self.store is None else self.store.release_reader(str(worker_id))

    def close(self) -> None:
        """At shutdown: the host tier's blocks to the disk tier (a restart finds them),
        then the arena file goes."""
        if self.store is not None:
            self.store.close(flush=True)
            self.store = None

    def figures(self) -> StoreFigures | None:
        """What the store holds and has done; None while it is not open."""
        store = self.store
        if store is None:
            return None
        index, counters = store.index, store.counters
        tiers = ["host"] + (["disk"] if store.disk is not None else [])
        disk_capacity = self.settings.disk_mb << 20 if store.disk is not None else 0
        return StoreFigures(
            hits=dict(self._served),
            misses=counters.misses,
            lookups=self._lookups,
            bytes_read=dict(self._served_bytes),
            bytes_written=dict(counters.bytes_written),
            blocks={t: index.count(t) for t in tiers},  # type: ignore[arg-type]
            used_bytes={t: index.used_bytes(t) for t in tiers},  # type: ignore[arg-type]
            capacity_bytes={
                "host": store.host.arena.slots * store.host.arena.slot_bytes,
                **({"disk": disk_capacity} if store.disk is not None else {}),
            },
            dropped=counters.dropped,
            refused=0 if store.disk is None else store.disk.counters.refused,
            put_blocks=self._put_blocks,
        )
