"""Which stored KV blocks the box holds, in which tier, and what a new one pushes out.

Pure bookkeeping (no bytes, no torch): entries keyed by (namespace digest, block key) in
two tiers, host memory and an optional disk, each with a capacity in bytes and least
recently used order. A block pushed out of the host tier goes to the disk tier when there
is one, else it is dropped; one pushed out of the disk tier is dropped. A block is in one
tier at a time. The index says what to do (a list of moves, in order); the store moves the
bytes. A pinned block (a reader is copying it) is never pushed out nor dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

StoreKey = tuple[bytes, int]  # (namespace digest, chained 64-bit block key)
Tier = Literal["host", "disk"]


@dataclass(frozen=True)
class TierSpec:
    """A tier's capacity; each entry is charged whole units (a host slot, a file system
    block), so the count matches the memory or disk the tier really uses."""

    capacity_bytes: int
    unit_bytes: int = 1
    overhead_bytes: int = 0  # stored beside each entry's bytes (a disk file's header)

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0 or self.unit_bytes < 1 or self.overhead_bytes < 0:
            raise ValueError(f"not a tier capacity: {self}")

    def charge(self, nbytes: int) -> int:
        return -(-(nbytes + self.overhead_bytes) // self.unit_bytes) * self.unit_bytes


@dataclass(frozen=True)
class Move:
    """Move `key`'s bytes from `source` to `target` (None: drop them)."""

    key: StoreKey
    source: Tier
    target: Tier | None


@dataclass(frozen=True)
class Placement:
    """Where a new block goes (None: nowhere, the store is full of pinned blocks or the
    block is larger than any tier) and the moves to make first, in order."""

    tier: Tier | None
    moves: list[Move] = field(default_factory=list)


@dataclass(frozen=True)
class Hit:
    key: StoreKey
    tier: Tier


@dataclass
class _Tier:
    spec: TierSpec
    entries: OrderedDict[StoreKey, int] = field(default_factory=OrderedDict)  # LRU first
    used: int = 0
    reserved: int = 0  # room held for blocks a writer is filling in (host slots handed out)

    def add(self, key: StoreKey, charged: int) -> None:
        self.entries[key] = charged
        self.used += charged

    def pop(self, key: StoreKey) -> None:
        self.used -= self.entries.pop(key)


class StoreIndex:
    """The store's entries in a host tier and an optional disk tier (None: off)."""

    def __init__(self, host: TierSpec, disk: TierSpec | None = None) -> None:
        self._tiers: dict[Tier, _Tier] = {"host": _Tier(host)}
        if disk is not None:
            self._tiers["disk"] = _Tier(disk)
        self._nbytes: dict[StoreKey, int] = {}  # each entry's payload size
        self._pins: dict[StoreKey, int] = {}

    # ------------------------------------------------------------ reading

    def tier_of(self, key: StoreKey) -> Tier | None:
        for name, tier in self._tiers.items():
            if key in tier.entries:
                return name
        return None

    def used_bytes(self, tier: Tier) -> int:
        return self._tiers[tier].used if tier in self._tiers else 0

    def count(self, tier: Tier) -> int:
        return len(self._tiers[tier].entries) if tier in self._tiers else 0

    def keys(self, tier: Tier) -> list[StoreKey]:
        """The tier's keys, least recently used first."""
        return list(self._tiers[tier].entries) if tier in self._tiers else []

    def nbytes(self, key: StoreKey) -> int:
        return self._nbytes[key]

    def lookup(self, namespace: bytes, block_keys: Sequence[int]) -> list[Hit]:
        """The longest run of `block_keys` (a prompt's chained keys, in order) held, from
        the first: a block after a missing one is useless, its prefix must be computed
        anyway. The hits become the most recently used of their tiers, the first block
        most of all: a prompt's tail is pushed out before its head, since without its
        head the tail is never a hit again (vLLM frees a sequence's blocks tail first)."""
        hits: list[Hit] = []
        for block in block_keys:
            key = (namespace, block)
            tier = self.tier_of(key)
            if tier is None:
                break
            hits.append(Hit(key, tier))
        for hit in reversed(hits):
            self._tiers[hit.tier].entries.move_to_end(hit.key)
        return hits

    def refresh(self, key: StoreKey) -> Tier | None:
        """A block still held becomes the most recently used of its tier (a worker's pool
        used it until now: written ahead or loaded, then evicted, and hot meanwhile);
        the tier it is in, or None where it was pushed out already (nothing changes)."""
        tier = self.tier_of(key)
        if tier is not None:
            self._tiers[tier].entries.move_to_end(key)
        return tier

    # ------------------------------------------------------------ pins

    def pin(self, hits: Sequence[Hit]) -> None:
        """Keep these blocks where they are until unpinned (a reader is copying them)."""
        for hit in hits:
            self._pins[hit.key] = self._pins.get(hit.key, 0) + 1

    def unpin(self, hits: Sequence[Hit]) -> None:
        for hit in hits:
            left = self._pins.get(hit.key, 0) - 1
            if left < 0:
                raise ValueError(f"block {hit.key[1]:016x} unpinned more often than pinned")
            if left:
                self._pins[hit.key] = left
            else:
                del self._pins[hit.key]

    def pinned(self, key: StoreKey) -> bool:
        return key in self._pins

    # ------------------------------------------------------------ writing

    def insert(self, key: StoreKey, nbytes: int) -> Placement:
        """Place a new block of `nbytes` in the host tier (or, where the host cannot
        take it, the disk tier), pushing out least recently used blocks. A block already
        held only becomes the most recently used."""
        held = self.tier_of(key)
        if held is not None:
            self._tiers[held].entries.move_to_end(key)
            return Placement(held)
        for name in self._tiers:
            moves = self._make_room(name, self._tiers[name].spec.charge(nbytes))
            if moves is not None:
                self._place(name, key, nbytes)
                return Placement(name, moves)
        return Placement(None)

    def reserve(self, nbytes: int) -> list[Move] | None:
        """Hold room in the host tier for a block of up to `nbytes` that a writer fills
        in later (a host slot handed out ahead of need), pushing out least recently used
        blocks; None (nothing changed) where the unpinned blocks cannot make the room."""
        host = self._tiers["host"]
        charge = host.spec.charge(nbytes)
        moves = self._make_room("host", charge)
        if moves is not None:
            host.reserved += charge
        return moves

    def unreserve(self, nbytes: int) -> None:
        """Room held by `reserve(nbytes)` comes back unused."""
        host = self._tiers["host"]
        charge = host.spec.charge(nbytes)
        if charge > host.reserved:
            raise ValueError(f"{charge} bytes unreserved, {host.reserved} reserved")
        host.reserved -= charge

    def insert_reserved(self, key: StoreKey, nbytes: int, reserved: int) -> Placement:
        """A block of `nbytes` written into room held by `reserve(reserved)`: it takes
        that room as the host tier's most recently used (nothing pushed out). A block
        held already is only refreshed, and the room given back (Placement of its tier)."""
        self.unreserve(reserved)
        held = self.tier_of(key)
        if held is not None:
            self._tiers[held].entries.move_to_end(key)
            return Placement(held)
        if self._tiers["host"].spec.charge(nbytes) > self._tiers["host"].spec.charge(reserved):
            raise ValueError(f"a block of {nbytes} bytes in room held for {reserved}")
        self._place("host", key, nbytes)
        return Placement("host")

    def reserved_bytes(self) -> int:
        return self._tiers["host"].reserved

    def place_found(self, key: StoreKey, nbytes: int, tier: Tier) -> Placement:
        """Record a block found in `tier` (the disk tier's files at start) as its most
        recently used; the moves push out what no longer fits (a smaller capacity)."""
        moves = self._make_room(tier, self._tiers[tier].spec.charge(nbytes))
        if moves is None:
            return Placement(None)
        self._place(tier, key, nbytes)
        return Placement(tier, moves)

    def promote(self, key: StoreKey) -> Placement:
        """Move a disk block into the host tier (a reader wants it in shared memory),
        pushing out least recently used host blocks; it stays on disk where the host
        tier cannot make room. Pinned or not: a pin follows the block."""
        if "disk" not in self._tiers or key not in self._tiers["disk"].entries:
            return Placement(self.tier_of(key))
        nbytes = self._nbytes[key]
        disk = self._tiers["disk"]
        charged = disk.entries[key]
        disk.pop(key)  # out first, so the room made in host never pushes it out of disk
        moves = self._make_room("host", self._tiers["host"].spec.charge(nbytes))
        if moves is None:
            disk.add(key, charged)
            return Placement("disk")
        self._tiers["host"].add(key, self._tiers["host"].spec.charge(nbytes))
        return Placement("host", moves)

    def demote(self, key: StoreKey) -> list[Move]:
        """Push an unpinned host block out now (to disk, or dropped where there is no
        room): the host tier is about to go (a shutdown keeps what the disk can hold)."""
        if key not in self._tiers["host"].entries or key in self._pins:
            return []
        return self._push_out("host", key)

    def remove(self, key: StoreKey) -> Tier | None:
        """Forget a block (its bytes were refused: corrupt, or gone), pinned or not."""
        tier = self.tier_of(key)
        if tier is not None:
            self._tiers[tier].pop(key)
            del self._nbytes[key]
        return tier

    def clear(self) -> list[StoreKey]:
        """Forget every unpinned block; returns them."""
        gone = [k for t in self._tiers.values() for k in t.entries if k not in self._pins]
        for key in gone:
            self.remove(key)
        return gone

    def _place(self, tier: Tier, key: StoreKey, nbytes: int) -> None:
        self._tiers[tier].add(key, self._tiers[tier].spec.charge(nbytes))
        self._nbytes[key] = nbytes

    def _make_room(self, name: Tier, charge: int) -> list[Move] | None:
        """The moves that leave `charge` bytes free in tier `name`, made in the index; None
        (and nothing changed) where the unpinned blocks cannot free enough."""
        tier = self._tiers[name]
        need = tier.used + tier.reserved + charge - tier.spec.capacity_bytes
        if need <= 0:
            return []
        victims, freed = [], 0
        for key, charged in tier.entries.items():  # least recently used first
            if freed >= need:
                break
            if key not in self._pins:
                victims.append(key)
                freed += charged
        if freed < need:
            return None
        moves: list[Move] = []
        for key in victims:
            moves += self._push_out(name, key)
        return moves

    def _push_out(self, name: Tier, key: StoreKey) -> list[Move]:
        """Demote `key` from the host tier to the disk tier (making room there first), or
        drop it where there is no disk tier or no room."""
        nbytes = self._nbytes[key]
        self._tiers[name].pop(key)
        if name == "host" and "disk" in self._tiers:
            room = self._make_room("disk", self._tiers["disk"].spec.charge(nbytes))
            if room is not None:
                self._tiers["disk"].add(key, self._tiers["disk"].spec.charge(nbytes))
                return [*room, Move(key, "host", "disk")]
        del self._nbytes[key]
        return [Move(key, name, None)]
