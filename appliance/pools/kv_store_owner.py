"""The supervisor's side of the box's KV store (issue 41): it owns the one store of the
box and serves it to the workers over their message queues.

The store opens when the first worker says StoreReady (a block's size is the model's, known
once a worker loaded it; None while kv_store.enabled is off, and no worker says it then).
Before a prompt goes to a worker, `hits_for` looks its full blocks up under that worker's
namespace, brings disk hits into shared memory, pins them for the worker and names their
slots (StoreHits); the worker copies them into its pool and answers StoreRelease.

Writes: each worker holds a few free arena slots reserved for it ahead of need
(StoreSlots); it copies a block its pool evicts straight into one, seals it and says so
(StoreWritten), and the owner commits it into the index and tops the worker's slots up.
The owner still decides the tier (room for a reserved slot is made when it is handed
out; a block held already is not committed, its slot freed) and moves blocks to disk from
the arena. Only where a worker has no reserved slot left do a block's bytes travel on its
pipe (StorePut). A worker that exits lets go of its pins and its reserved slots (written
or not: a block never committed is not the store's); at shutdown the host tier goes to
disk (a restart finds it there) and the arena file is removed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from appliance.kv.prefix_cache import partial_keys, prefix_keys
from appliance.kv_store.block_store import BlockStore
from appliance.kv_store.tier_index import Hit, Tier
from appliance.settings.kv_store import KVStoreSettings
from appliance.workers.messages import (
    StoreHits,
    StorePut,
    StoreReady,
    StoreRelease,
    StoreSlots,
    StoreWritten,
    ToWorker,
)

log = logging.getLogger("appliance.kv_store")

RESERVED_SLOTS = 32  # free arena slots a worker holds ahead of need: a load's evictions
RESERVED_SHARE = 8  # ... but no worker holds more than 1/8 of a small arena


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
    put_in_place: int  # of those, written by the worker straight into a reserved slot
    put_in_place_bytes: int  # their bytes (none of them crossed a pipe)
    put_piped_bytes: int  # bytes of the blocks sent on a worker's pipe (no slot left)
    reserved_slots: int  # arena slots handed to workers, not yet committed


class StoreOwner:
    """The box's store, opened at the first worker's StoreReady."""

    def __init__(
        self,
        settings: KVStoreSettings,
        block_size: int,
        send: Callable[[int | None, ToWorker], None] | None = None,
    ) -> None:
        self.settings = settings
        self.block_size = block_size
        self.send = send  # to a worker's inbox (None: no slots handed out, bytes piped)
        self.store: BlockStore | None = None
        self._reserved: dict[int, set[int]] = {}  # worker -> arena slots handed to it
        self._put_piped_bytes = 0
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
        self._top_up(message.worker_id)

    def _top_up(self, worker_id: int) -> None:
        """Hand the worker free arena slots until it holds its share (none while the
        store is full of pinned blocks: it pipes its blocks meanwhile)."""
        store = self.store
        if store is None or self.send is None or worker_id not in self._namespaces:
            return
        held = self._reserved.setdefault(worker_id, set())
        share = min(RESERVED_SLOTS, store.host.arena.slots // RESERVED_SHARE)
        slots = store.reserve(share - len(held))
        if slots:
            held.update(slots)
            self.send(worker_id, StoreSlots(str(store.host.arena.path), slots))

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
        self._lookups += 1
        reader = str(worker_id)
        misses = store.counters.misses
        positions, hits = self._held_runs(store, namespace, keys, reader)
        # One miss per prompt whose blocks the store does not all hold (not one per run).
        store.counters.misses = misses + (len(hits) < len(keys))
        slots: list[int] = []
        for hit in hits:
            slot = self._in_arena(store, hit)
            if slot is None:
                break
            slots.append(slot)
        store.release(hits[len(slots) :], reader)
        kept = [(hit, hit.tier, store.index.nbytes(hit.key)) for hit in hits[: len(slots)]]
        # The partial block after the last stored run (a previous turn's answer's tail).
        start = positions[len(slots) - 1] + 1 if slots else 0
        partial = self._partial_hit(store, namespace, token_ids, keys, start, salt, reader)
        if partial is not None:
            kept.append((partial[0], partial[0].tier, store.index.nbytes(partial[0].key)))
        if not kept:
            return None
        self._pinned[(worker_id, request_id)] = kept
        arena = str(store.host.arena.path)
        run = [keys[i] for i in positions[: len(slots)]]
        where = None if partial is None else partial[1]
        return StoreHits(request_id, arena, namespace, run, slots, positions[: len(slots)], where)

    @staticmethod
    def _in_arena(store: BlockStore, hit: Hit) -> int | None:
        """A pinned hit's host slot (a disk hit promoted first); None where it could not
        be brought there or its file was bad."""
        held = store.promote(hit)
        return None if held is None else store.host.slot_of(hit.key)

    def _partial_hit(
        self,
        store: BlockStore,
        namespace: bytes,
        token_ids: list[int],
        keys: list[int],
        start: int,
        salt: str,
        reader: str,
    ) -> tuple[Hit, tuple[int, int, int, int]] | None:
        """The stored partial block of the prompt's latest block (from `start`, the end
        of the last stored run, to the block with its last token) with the longest run of
        its tokens, never the last token: pinned for `reader` and in the arena, with
        (position, n, key, slot).
        A partial is stored under the key of all its n tokens, so every n is tried (one
        streamed hash per block: ~11 us on the bench's EPYC under load)."""
        size = self.block_size
        for at in range(len(keys), start - 1, -1):
            tokens = token_ids[at * size : min((at + 1) * size - 1, len(token_ids) - 1)]
            runs = partial_keys(keys[at - 1] if at else None, tokens, salt)
            for n in range(len(runs), 0, -1):
                if not store.holds(namespace, runs[n - 1]):
                    continue
                found = store.lookup(namespace, [runs[n - 1]], reader)
                slot = self._in_arena(store, found[0]) if found else None
                if slot is not None:
                    return found[0], (at, n, runs[n - 1], slot)
                store.release(found, reader)
        return None

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

    def stored_keys(self, worker_id: int, keys: list[int]) -> set[int]:
        """Which of these block keys the store holds under `worker_id`'s namespace (those
        it can load; another model's or dtype's blocks are not its): for the router, which
        counts them as in that worker's pool. Nothing is pinned or counted."""
        store = self.store
        namespace = self._namespaces.get(worker_id)
        if store is None or namespace is None:
            return set()
        return {k for k in keys if store.holds(namespace, k)}

    def on_put(self, message: StorePut) -> None:
        """Blocks a worker sent: into the store (a block of the wrong size is refused; one
        the store has no room for, everything pinned, is not counted).
        It piped them for want of a reserved slot, so its slots are topped up here: it
        sends no StoreWritten (the other top-up) until it holds one, and room may have
        come since it ran out."""
        if self.store is None:
            return
        for key, data in message.blocks:
            self._put_piped_bytes += len(data)
            try:
                tier = self.store.put((message.namespace, key), data)
            except ValueError as exc:
                log.warning("worker %d: %s", message.worker_id, exc)
                break
            if tier is not None:
                self._put_blocks += 1
        self._top_up(message.worker_id)

    def on_written(self, message: StoreWritten) -> None:
        """Blocks a worker wrote into its reserved slots: into the index (a slot not
        reserved for it is ignored: it was taken back when the worker was forgotten).
        Then the blocks its pool evicted uncopied, held here already, become the most
        recent (in eviction order: a prompt's tail goes first, its head last, so the head
        stays the most recent); one pushed out meanwhile is not brought back."""
        store = self.store
        if store is None:
            return
        held = self._reserved.get(message.worker_id)
        if held is not None:
            for key, slot in message.blocks:
                if slot not in held:
                    continue
                held.remove(slot)
                # None: the slot's header did not name the block (it came back free).
                if store.commit(slot, (message.namespace, key)) is not None:
                    self._put_blocks += 1
        for block_key in message.refreshed:
            store.refresh((message.namespace, block_key))
        if held is not None:
            self._top_up(message.worker_id)

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
        # Unpinned blocks may be pushed out now: a worker that found the store full of
        # pinned blocks holds fewer slots than its share (maybe none, piping meanwhile).
        for worker_id in list(self._namespaces):
            self._top_up(worker_id)

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
        """A worker exited (maybe mid-copy, maybe mid-write): its pins go, and its reserved
        slots come back free (one it wrote but never said so holds no block of the
        store's); the store's bytes are as they were. Returns how many pins it held."""
        self._namespaces.pop(worker_id, None)
        slots = self._reserved.pop(worker_id, set())
        if self.store is not None:
            self.store.unreserve(sorted(slots))
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
            put_in_place=counters.in_place,
            put_in_place_bytes=counters.in_place_bytes,
            put_piped_bytes=self._put_piped_bytes,
            reserved_slots=store.host.reserved_slots,
        )
