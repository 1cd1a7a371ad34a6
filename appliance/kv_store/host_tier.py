"""The host tier as the store's owner sees it: which arena slot holds which block.

The index (tier_index.py) decides which blocks are in the host tier; this hands each one
a free slot of the arena and takes it back when the block leaves. Readers in other
processes are told (key, slot) and read the arena themselves. A writer in another process
(a worker storing the blocks its pool evicts) is handed free slots ahead of need
(`reserve`): it fills one in place and says which block it holds, and the owner `commit`s
it, or takes it back unused (`unreserve`: the writer died, or the block was stored).
"""

from __future__ import annotations

from pathlib import Path

from appliance.kv_store.host_arena import HostArena
from appliance.kv_store.tier_index import StoreKey


class HostTier:
    """A slot allocator over one arena this process created."""

    def __init__(self, arena: HostArena) -> None:
        self.arena = arena
        self._free = list(range(arena.slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._slot_of: dict[StoreKey, int] = {}
        self._reserved: set[int] = set()  # handed to a writer, not yet committed

    @classmethod
    def create(cls, path: Path, capacity_bytes: int, slot_bytes: int) -> HostTier:
        """An arena of as many slots as `capacity_bytes` holds."""
        slots = capacity_bytes // slot_bytes
        if slots < 1:
            raise ValueError(
                f"a host tier of {capacity_bytes} bytes holds no block of {slot_bytes} bytes; "
                "raise kv_store.host_memory_mb"
            )
        return cls(HostArena.create(path, slots, slot_bytes))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def reserved_slots(self) -> int:
        return len(self._reserved)

    def is_reserved(self, slot: int) -> bool:
        return slot in self._reserved

    def slot_of(self, key: StoreKey) -> int | None:
        return self._slot_of.get(key)

    def write(self, key: StoreKey, data: bytes | memoryview) -> int:
        """Store a block in a free slot (the index made room); returns the slot."""
        if key in self._slot_of:
            raise ValueError(f"block {key[1]:016x} is in the host tier already")
        if not self._free:
            raise RuntimeError("no free host slot: the index and the arena disagree")
        slot = self._free.pop()
        try:
            self.arena.write(slot, key, data)
        except ValueError:
            self._free.append(slot)
            raise
        self._slot_of[key] = slot
        return slot

    def read(self, key: StoreKey) -> memoryview | None:
        slot = self._slot_of.get(key)
        return None if slot is None else self.arena.read(slot, key)

    def free(self, key: StoreKey) -> None:
        """The block left the host tier: empty its slot and hand it out again."""
        slot = self._slot_of.pop(key)
        self.arena.empty(slot)
        self._free.append(slot)

    def reserve(self) -> int:
        """A free slot handed to a writer in another process (the index made room)."""
        if not self._free:
            raise RuntimeError("no free host slot: the index and the arena disagree")
        slot = self._free.pop()
        self.arena.empty(slot)
        self._reserved.add(slot)
        return slot

    def commit(self, slot: int, key: StoreKey) -> int:
        """The reserved `slot` holds block `key` (its writer sealed it): the block is in
        the tier now; returns its size. ValueError, and the slot still reserved, where
        the slot was not reserved or its header does not name the block whole."""
        if slot not in self._reserved:
            raise ValueError(f"slot {slot} is not reserved")
        if key in self._slot_of:
            raise ValueError(f"block {key[1]:016x} is in the host tier already")
        held = self.arena.holder(slot)
        if held is None or held[0] != key:
            raise ValueError(f"slot {slot} does not hold block {key[1]:016x}")
        self._reserved.remove(slot)
        self._slot_of[key] = slot
        return held[1]

    def unreserve(self, slot: int) -> None:
        """A reserved slot comes back unused (or written but never committed): emptied."""
        self._reserved.remove(slot)
        self.arena.empty(slot)
        self._free.append(slot)
