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
        misses = store.counters.misses
        positions, hits = self._held_runs(store, namespace, keys, reader)
        # One miss per prompt whose blocks the store does not all hold (not one per run).
        store.counters.misses = misses + (len(hits) < len(keys))
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
        run = [keys[i] for i in positions[: len(slots)]]
        return StoreHits(request_id, arena, namespace, run, slots, positions[: len(slots)])

    @staticmethod
    def _held_runs(
        store: BlockStore, namespace: bytes, keys: list[int], reader: str
    ) -> tuple[list[int], list[Hit]]:
        """Every run of `keys` the store holds, pinned for `reader`, and each hit's index
        in `keys`. The gaps between runs may be in the worker's pool: a shared head stays
        hot there and never reaches a store written on eviction, and a chat's history may
        still be there while its last answer, decoded on a decode worker, is stored."""
        positions: list[int] = []
        hits: list[Hit] = []
        i = 0
        while i < len(keys):
            if not store.holds(namespace, keys[i]):
                i += 1
                continue
            run = store.lookup(namespace, keys[i:], reader)
            if not run:  # (held but not served: its file was refused)
                i += 1
                continue
            positions += range(i, i + len(run))
            hits += run
            i += len(run)
        return positions, hits

    def stored_keys(self, keys: list[int]) -> set[int]:
        """Which of these block keys the store holds under some worker's namespace (any
        worker of that namespace loads them): for the router, which does not count them
        as one worker's prefix. Nothing is pinned or counted."""
        store = self.store
        if store is None:
            return set()
        namespaces = set(self._namespaces.values())
        return {k for k in keys if any(store.holds(n, k) for n in namespaces)}

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

    def clear(self) -> dict[str, int] | None:
        """Drop every block no worker is reading, in both tiers (the disk tier's files
        deleted): what each tier lost; None while the store is not open."""
        store = self.store
        if store is None:
            return None
        tiers = ["host"] + (["disk"] if store.disk is not None else [])
        before = {t: store.index.count(t) for t in tiers}  # type: ignore[arg-type]
        store.clear()
        return {t: before[t] - store.index.count(t) for t in tiers}  # type: ignore[arg-type]

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
