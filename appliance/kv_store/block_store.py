"""The box's KV store: the index's decisions carried out on the host arena and the disk
directory, with counters of what it served.

One process owns a store (the supervisor, when the workers use it): it decides where each
block goes and moves bytes between tiers. Blocks enter by `put` (a worker's pool evicted
them, or a request finished, per kv_store.write_policy); a worker with a prefix miss asks
`lookup` for the rest of its prompt's keys, reads each hit (`read`: the host tier's bytes
in place, the disk tier's from its file) into its own pool, then `release`s them. Where
a read is refused (a corrupt disk file) the prefix ends there and the worker computes
the rest. At start the disk tier's files are read back into the index, so a restart
finds what the last run stored there; the host tier starts empty.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from appliance.kv_store.disk_tier import HEADER_BYTES, DiskTier
from appliance.kv_store.host_arena import arena_path, remove_stale_arenas
from appliance.kv_store.host_tier import HostTier
from appliance.kv_store.tier_index import Hit, Move, StoreIndex, StoreKey, Tier, TierSpec
from appliance.settings.kv_store import KVStoreSettings

DISK_UNIT = 4096  # a file takes whole file system blocks
MIB = 1 << 20


@dataclass
class StoreCounters:
    """What the store did since it opened, per tier."""

    hits: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    misses: int = 0  # lookups whose prefix stopped short of the keys asked for
    bytes_read: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    bytes_written: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    dropped: int = 0  # blocks pushed out of the store altogether
    promoted: int = 0  # disk blocks brought into the host tier for a reader
    in_place: int = 0  # blocks a writer put straight into a reserved host slot
    in_place_bytes: int = 0  # (those bytes reached the arena with no copy by the owner)


class BlockStore:
    """A host tier (shared memory) and an optional disk tier of KV blocks."""

    def __init__(self, host: HostTier, disk: DiskTier | None, disk_bytes: int = 0) -> None:
        self.host = host
        self.disk = disk
        arena = host.arena
        self.index = StoreIndex(
            TierSpec(arena.slots * arena.slot_bytes, unit_bytes=arena.slot_bytes),
            None if disk is None else TierSpec(disk_bytes, DISK_UNIT, HEADER_BYTES),
        )
        self.counters = StoreCounters()
        self._reading: dict[str, Counter[StoreKey]] = {}  # reader -> pins it holds
        if disk is not None:
            self._rebuild(disk)

    @classmethod
    def open(
        cls,
        host_path: Path,
        host_bytes: int,
        block_bytes: int,
        disk_dir: Path | None = None,
        disk_bytes: int = 0,
    ) -> BlockStore:
        """A store with a new arena at `host_path` holding `host_bytes` of blocks of
        `block_bytes` and, where `disk_dir` is given, the disk tier found there."""
        host = HostTier.create(host_path, host_bytes, block_bytes)
        return cls(host, None if disk_dir is None else DiskTier(disk_dir), disk_bytes)

    @classmethod
    def from_settings(cls, settings: KVStoreSettings, block_bytes: int) -> BlockStore | None:
        """The store the kv_store settings describe for blocks of `block_bytes` (None when
        kv_store.enabled is off): an arena named for this process under shm_dir (the
        arenas of owners no longer running are removed first: a crash leaves its file)
        and the disk tier at disk_path, if set."""
        if not settings.enabled:
            return None
        remove_stale_arenas(settings.shm_dir)
        return cls.open(
            arena_path(settings.shm_dir, os.getpid()),
            settings.host_memory_mb * MIB,
            block_bytes,
            settings.disk_path,
            settings.disk_mb * MIB,
        )

    # ------------------------------------------------------------ writing

    def put(self, key: StoreKey, data: bytes | memoryview) -> Tier | None:
        """Store a block (a no-op for one held already); returns its tier, None where it
        could not be stored (everything pinned, or the disk refused the write).
        ValueError for a block larger than the arena's slots (another model's blocks)."""
        nbytes = memoryview(data).nbytes
        if nbytes > self.host.arena.slot_bytes:
            raise ValueError(
                f"a block of {nbytes} bytes is larger than this store's slots "
                f"({self.host.arena.slot_bytes} bytes)"
            )
        if self.index.tier_of(key) is not None:
            return self.index.insert(key, nbytes).tier  # refreshed, not rewritten
        placement = self.index.insert(key, nbytes)
        for move in placement.moves:
            self._carry_out(move)
        if placement.tier is None:
            return None
        if not self._write(placement.tier, key, data):
            self.index.remove(key)
            return None
        return placement.tier

    def put_run(
        self, namespace: bytes, block_keys: Sequence[int], blocks: Sequence[bytes | memoryview]
    ) -> list[Tier | None]:
        """Store a sequence's consecutive blocks, last first, so its head ends the most
        recently used: where the store is short of room the tail goes, never the head
        without which the tail is no hit. Returns where each block is once the run is
        in (None: not stored, or pushed out by the run's head), in sequence order."""
        if len(block_keys) != len(blocks):
            raise ValueError(f"{len(block_keys)} block keys for {len(blocks)} blocks")
        for key, data in zip(block_keys[::-1], blocks[::-1], strict=True):
            self.put((namespace, key), data)
        return [self.index.tier_of((namespace, key)) for key in block_keys]

    def reserve(self, n: int) -> list[int]:
        """Up to `n` free host slots for a writer in another process to fill in place
        (room made by pushing out least recently used blocks; fewer where the rest are
        pinned). Each is `commit`ted once written, or `unreserve`d."""
        slots: list[int] = []
        slot_bytes = self.host.arena.slot_bytes
        for _ in range(n):
            moves = self.index.reserve(slot_bytes)
            if moves is None:
                break
            for move in moves:
                self._carry_out(move)
            slots.append(self.host.reserve())
        return slots

    def commit(self, slot: int, key: StoreKey) -> Tier | None:
        """A reserved slot its writer filled with block `key` and sealed: the block is in
        the host tier (its most recently used). A block held already keeps its place and
        the slot comes back free, as does a slot whose header does not name the block
        (None: not stored). ValueError for a slot not reserved."""
        if not self.host.is_reserved(slot):
            raise ValueError(f"slot {slot} is not reserved")
        slot_bytes = self.host.arena.slot_bytes
        held = self.index.tier_of(key)
        if held is not None:
            self.index.insert_reserved(key, slot_bytes, slot_bytes)  # refreshed
            self.host.unreserve(slot)
            return held
        try:
            nbytes = self.host.commit(slot, key)
        except ValueError:
            self.unreserve([slot])
            return None
        self.index.insert_reserved(key, nbytes, slot_bytes)
        self.counters.bytes_written["host"] += nbytes
        self.counters.in_place += 1
        self.counters.in_place_bytes += nbytes
        return "host"

    def refresh(self, key: StoreKey) -> Tier | None:
        """A worker's pool evicted block `key`, which it had not copied out since the
        store held it already: the block is as recent as that eviction (the index's
        `refresh`; None where it was pushed out meanwhile)."""
        return self.index.refresh(key)

    def unreserve(self, slots: Sequence[int]) -> None:
        """Reserved slots come back unused, or written and never committed (their writer
        died mid-write): emptied and free again."""
        for slot in slots:
            self.host.unreserve(slot)
            self.index.unreserve(self.host.arena.slot_bytes)

    def clear(self) -> int:
        """Drop every block not being read (both tiers); returns how many."""
        gone = self.index.clear()
        for key in gone:
            self._free_bytes(key)
        return len(gone)

    # ------------------------------------------------------------ reading

    def holds(self, namespace: bytes, block_key: int) -> bool:
        """Whether either tier holds this block (nothing pinned, nothing counted)."""
        return self.index.tier_of((namespace, block_key)) is not None

    def lookup(self, namespace: bytes, block_keys: Sequence[int], reader: str = "") -> list[Hit]:
        """The held prefix of `block_keys`, pinned for `reader` (a worker's name) until
        `release`d, or until `release_reader` when that worker dies mid-copy."""
        hits = self.index.lookup(namespace, block_keys)
        if len(hits) < len(block_keys):
            self.counters.misses += 1
        self.index.pin(hits)
        self._reading.setdefault(reader, Counter()).update(hit.key for hit in hits)
        return hits

    def read(self, hit: Hit) -> memoryview | bytes | None:
        """A pinned hit's bytes (the host tier's in place); None where they were refused
        (a corrupt or vanished disk file, now forgotten): the prefix ends before it."""
        data: memoryview | bytes | None
        if hit.tier == "host":
            data = self.host.read(hit.key)
        else:
            data = None if self.disk is None else self.disk.read(hit.key)
        if data is None:
            self.index.remove(hit.key)
            if hit.tier == "host" and self.host.slot_of(hit.key) is not None:
                self.host.free(hit.key)
            return None
        self.counters.hits[hit.tier] += 1
        self.counters.bytes_read[hit.tier] += memoryview(data).nbytes
        return data

    def promote(self, hit: Hit) -> Hit | None:
        """Bring a disk hit into the host tier, so a worker reads it from shared memory;
        the same hit where the host tier has no room (it stays on disk), None where its
        file was refused (the prefix ends before it)."""
        if hit.tier != "disk" or self.disk is None:
            return hit
        data = self.disk.read(hit.key)
        if data is None:
            self.index.remove(hit.key)
            return None
        placement = self.index.promote(hit.key)
        for move in placement.moves:
            self._carry_out(move)
        if placement.tier != "host":
            return hit
        self._write("host", hit.key, data)
        self.disk.delete(hit.key)
        self.counters.promoted += 1
        return Hit(hit.key, "host")

    def flush(self) -> int:
        """Push every unpinned host block to the disk tier (least recently used first, so
        the newest stay where the disk is full), before the host tier goes; returns how
        many reached the disk."""
        kept = 0
        for key in self.index.keys("host"):
            for move in self.index.demote(key):
                self._carry_out(move)
            kept += self.index.tier_of(key) == "disk"
        return kept

    def release(self, hits: Sequence[Hit], reader: str = "") -> None:
        """`reader` has copied these hits: they may be pushed out again."""
        held = self._reading.get(reader, Counter())
        wanted = Counter(hit.key for hit in hits)
        # Checked whole before any count moves: a bad release leaves every pin as it was.
        for key, n in wanted.items():
            if held[key] < n:
                raise ValueError(
                    f"{reader or 'a reader'} releases block {key[1]:016x} it does not hold"
                )
        held.subtract(wanted)
        self.index.unpin(hits)

    def release_reader(self, reader: str) -> int:
        """Let go of everything `reader` holds (it died while copying: the bytes it was
        reading are the store's, untouched); returns how many pins it held."""
        held = self._reading.pop(reader, Counter())
        hits = [Hit(key, "host") for key, n in held.items() for _ in range(n)]
        self.index.unpin(hits)  # pins are by key: the tier named here is not read
        return len(hits)

    def close(self, unlink: bool = True, flush: bool = False) -> None:
        """Unmap the arena (and remove its file: the host tier does not outlive its owner);
        with `flush`, its blocks go to the disk tier first, so a restart finds them."""
        if flush and self.disk is not None:
            self.flush()
        try:  # the file first: a reader's live view makes the unmap fail (BufferError)
            if unlink:
                self.host.arena.unlink()
        finally:
            self.host.arena.close()

    # ------------------------------------------------------------ moving bytes

    def _carry_out(self, move: Move) -> None:
        if move.target == "disk":
            assert self.disk is not None and move.source == "host"
            view = self.host.read(move.key)
            stored = view is not None and self._write("disk", move.key, view)
            if view is not None:
                view.release()
            self.host.free(move.key)
            if not stored:
                self.index.remove(move.key)
                self.counters.dropped += 1
            return
        self._free_bytes(move.key, move.source)
        self.counters.dropped += 1

    def _free_bytes(self, key: StoreKey, tier: Tier | None = None) -> None:
        if self.host.slot_of(key) is not None and tier in (None, "host"):
            self.host.free(key)
        elif self.disk is not None and tier in (None, "disk"):
            self.disk.delete(key)

    def _write(self, tier: Tier, key: StoreKey, data: bytes | memoryview) -> bool:
        if tier == "host":
            self.host.write(key, data)
            ok = True
        else:
            ok = self.disk is not None and self.disk.write(key, data)
        if ok:
            self.counters.bytes_written[tier] += memoryview(data).nbytes
        return ok

    def _rebuild(self, disk: DiskTier) -> None:
        """The disk tier's files into the index, oldest first: the newest are kept where
        the capacity is now smaller than what is there."""
        for found in disk.scan():
            placement = self.index.place_found(found.key, found.nbytes, "disk")
            for move in placement.moves:
                self._carry_out(move)
            if placement.tier is None:
                disk.delete(found.key)
