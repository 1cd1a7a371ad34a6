"""The host tier's bytes: fixed-size slots of one KV block each, in one file under
/dev/shm mapped by every process on the box that reads or writes the store.

A slot holds one block's K/V bytes as the pool stores them (every layer's K then V, the
byte order of `kv/byte_ranges.py`'s pool for one block) behind a small header naming the
block: the namespace digest, the block key and the payload's length. A reader maps the
file by its path and gets a memoryview of the payload (no copy, no trip through the
supervisor); it checks the header names the block it asked for, so a slot reused for
another block is never read as this one. The file is the service user's only (0600: it
holds what prompts said).

Who may write and which slot a block takes is the owner's decision (HostTier in the
store's process, from the index); the arena is bytes and headers only. Pure: no torch
(a torch view is `torch.frombuffer(view, dtype=...)` on the reader's side).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from appliance.kv_store.namespace import DIGEST_BYTES
from appliance.kv_store.tier_index import StoreKey

_MAGIC = b"APKVHOST"
_FILE_HEADER = struct.Struct("<8sIIQ")  # magic, version, slots, slot_bytes
_SLOT_HEADER = struct.Struct(f"<{DIGEST_BYTES}sQQ")  # namespace digest, block key, nbytes
_VERSION = 1
_ALIGN = 64  # payloads start on a cache line


_PREFIX = "appliance-kv-"  # arena files: appliance-kv-<owner pid>


def arena_path(shm_dir: Path, owner_pid: int) -> Path:
    """The arena file of the store owned by process `owner_pid`."""
    return shm_dir / f"{_PREFIX}{owner_pid}"


def remove_stale_arenas(shm_dir: Path) -> list[Path]:
    """Remove the arena files whose owner process is gone (killed before it could remove
    its own: tmpfs pages stay taken until the file goes); returns them."""
    removed = []
    for path in shm_dir.glob(f"{_PREFIX}*"):
        pid = path.name.removeprefix(_PREFIX)
        # Our own pid on a file we did not make: a container restarted with the same pid
        # over a kept shm_dir, whose earlier owner is gone.
        if pid.isdigit() and (int(pid) == os.getpid() or not _running(int(pid))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: not ours to judge
    return True


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class HostArena:
    """`slots` slots of up to `slot_bytes` payload each in one shared file."""

    def __init__(self, path: Path, fd: int, slots: int, slot_bytes: int) -> None:
        self.path = path
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._stride = _aligned(_SLOT_HEADER.size) + _aligned(slot_bytes)
        self._first = _aligned(_FILE_HEADER.size)
        self._map = mmap.mmap(fd, self._first + slots * self._stride)
        os.close(fd)  # the mapping keeps the pages

    @classmethod
    def create(cls, path: Path, slots: int, slot_bytes: int) -> HostArena:
        """A new arena file (FileExistsError when one is there: two stores would clobber
        each other's slots)."""
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a host arena needs slots and bytes: {slots} x {slot_bytes}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        arena_bytes = _aligned(_FILE_HEADER.size) + slots * (
            _aligned(_SLOT_HEADER.size) + _aligned(slot_bytes)
        )
        os.ftruncate(fd, arena_bytes)  # tmpfs pages are taken when first written
        arena = cls(path, fd, slots, slot_bytes)
        arena._map[: _FILE_HEADER.size] = _FILE_HEADER.pack(_MAGIC, _VERSION, slots, slot_bytes)
        return arena

    @classmethod
    def attach(cls, path: Path) -> HostArena:
        """Map an arena another process created."""
        fd = os.open(path, os.O_RDWR)
        head = os.pread(fd, _FILE_HEADER.size, 0)
        magic, version, slots, slot_bytes = _FILE_HEADER.unpack(head)
        if magic != _MAGIC or version != _VERSION:
            os.close(fd)
            raise ValueError(f"{path} is not a KV store host arena of version {_VERSION}")
        return cls(path, fd, slots, slot_bytes)

    def write(self, slot: int, key: StoreKey, data: bytes | memoryview) -> None:
        """Put a block's bytes in `slot`: payload first, then the header that names it, so
        a reader never finds the name over half-written bytes."""
        nbytes = len(memoryview(data).cast("B"))
        if nbytes > self.slot_bytes:
            raise ValueError(f"a block of {nbytes} bytes is larger than a slot ({self.slot_bytes})")
        self.empty(slot)
        _, payload = self._offsets(slot)
        self._map[payload : payload + nbytes] = memoryview(data).cast("B")
        self.seal(slot, key, nbytes)

    def payload(self, slot: int, nbytes: int) -> memoryview:
        """The first `nbytes` of `slot`'s payload, writable in place (a worker fills a
        slot the owner reserved for it without a copy through the owner); `empty` the
        slot first and `seal` it after, then release the view."""
        if nbytes > self.slot_bytes:
            raise ValueError(f"a block of {nbytes} bytes is larger than a slot ({self.slot_bytes})")
        _, payload = self._offsets(slot)
        return memoryview(self._map)[payload : payload + nbytes]

    def seal(self, slot: int, key: StoreKey, nbytes: int) -> None:
        """Name the block whose `nbytes` are in `slot`'s payload (written last: a reader
        never finds the name over half-written bytes)."""
        header, _ = self._offsets(slot)
        self._map[header : header + _SLOT_HEADER.size] = _SLOT_HEADER.pack(*key, nbytes)

    def holder(self, slot: int) -> tuple[StoreKey, int] | None:
        """The block `slot`'s header names and its size, None when the slot is empty."""
        header, _ = self._offsets(slot)
        digest, block, nbytes = _SLOT_HEADER.unpack_from(self._map, header)
        return None if nbytes == 0 else ((digest, block), nbytes)

    def read(self, slot: int, key: StoreKey) -> memoryview | None:
        """The payload of `slot` without a copy, or None when the slot does not hold
        `key` (emptied or reused). Release the view before the arena is closed."""
        header, payload = self._offsets(slot)
        digest, block, nbytes = _SLOT_HEADER.unpack_from(self._map, header)
        if (digest, block) != key or nbytes == 0:
            return None
        return memoryview(self._map)[payload : payload + nbytes]

    def empty(self, slot: int) -> None:
        header, _ = self._offsets(slot)
        self._map[header : header + _SLOT_HEADER.size] = bytes(_SLOT_HEADER.size)

    def close(self) -> None:
        self._map.close()

    def unlink(self) -> None:
        """Remove the file (the owner, at shutdown); mappings stay valid until closed."""
        self.path.unlink(missing_ok=True)

    def _offsets(self, slot: int) -> tuple[int, int]:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is outside the arena's {self.slots}")
        header = self._first + slot * self._stride
        return header, header + _aligned(_SLOT_HEADER.size)
