"""The KV store's disk tier: one checksummed file per block, written atomically; what does
not match is refused and deleted, another namespace's file is never returned."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

import pytest

from appliance.kv_store import disk_tier
from appliance.kv_store.disk_tier import DiskTier
from appliance.kv_store.namespace import StoreNamespace

SMOL = StoreNamespace("smollm2-135m", "q8_0:abc", "bfloat16", 16).digest()
QWEN = StoreNamespace("qwen3-0.6b", "bf16:def", "bfloat16", 16).digest()


def block(n: int, size: int = 3000) -> bytes:
    return hashlib.shake_256(n.to_bytes(8, "little")).digest(size)


def test_a_block_round_trips_through_its_file(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "kv")
    assert disk.write((SMOL, 7), block(7))
    assert disk.read((SMOL, 7)) == block(7)
    path = disk.path_of((SMOL, 7))
    assert path.parent.name == SMOL.hex() and path.name == f"{7:016x}.kv"
    # What prompts said is the service user's only.
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    assert disk.read((SMOL, 8)) is None and disk.counters.refused == 0
    disk.delete((SMOL, 7))
    assert disk.read((SMOL, 7)) is None


def test_a_corrupted_or_truncated_file_is_refused_and_deleted(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    for n in (1, 2, 3):
        disk.write((SMOL, n), block(n))
    flipped = bytearray(disk.path_of((SMOL, 1)).read_bytes())
    flipped[-10] ^= 0x01  # one bit of the payload
    disk.path_of((SMOL, 1)).write_bytes(bytes(flipped))
    truncated = disk.path_of((SMOL, 2)).read_bytes()[:-100]
    disk.path_of((SMOL, 2)).write_bytes(truncated)
    assert disk.read((SMOL, 1)) is None
    assert disk.read((SMOL, 2)) is None
    assert disk.counters.refused == 2
    assert not disk.path_of((SMOL, 1)).exists() and not disk.path_of((SMOL, 2)).exists()
    assert disk.read((SMOL, 3)) == block(3)


def test_another_namespaces_file_is_never_returned(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    disk.write((SMOL, 5), block(5))
    assert disk.read((QWEN, 5)) is None  # the same block key under another model
    # A file moved under another model's name is refused by its header, not served.
    os.makedirs(disk.path_of((QWEN, 5)).parent)
    os.replace(disk.path_of((SMOL, 5)), disk.path_of((QWEN, 5)))
    assert disk.read((QWEN, 5)) is None
    assert disk.counters.refused == 1


def test_scan_finds_the_blocks_and_refuses_strays(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    for n in (1, 2):
        disk.write((SMOL, n), block(n, 100 * n))
    disk.write((QWEN, 3), block(3))
    # Write times set apart (a file system's clock ticks coarser than these writes):
    # 1 was written last.
    for seconds, key in enumerate([(SMOL, 2), (QWEN, 3), (SMOL, 1)]):
        os.utime(disk.path_of(key), ns=((1_700_000_000 + seconds) * 10**9,) * 2)
    leftover = disk.path_of((SMOL, 9)).with_name(f".{9:016x}.kv.4242.tmp")  # a write cut short
    leftover.write_bytes(b"partial")
    # Files that are not the tier's own are left alone, wherever they are.
    foreign = [disk.path_of((SMOL, 2)).with_name("notes.txt"), tmp_path / "other" / "x.kv"]
    foreign[1].parent.mkdir()
    for path in foreign:
        path.write_bytes(b"someone else's")
    bad = disk.path_of((SMOL, 4))
    bad.write_bytes(disk.path_of((SMOL, 2)).read_bytes())  # header says block 2
    short = disk.path_of((QWEN, 6))
    short.write_bytes(disk.path_of((QWEN, 3)).read_bytes()[:-1])
    found = DiskTier(tmp_path).scan()  # a new tier object: as after a restart
    assert [(f.key, f.nbytes) for f in found] == [
        ((SMOL, 2), 200),
        ((QWEN, 3), 3000),
        ((SMOL, 1), 100),
    ]
    assert not leftover.exists() and not bad.exists() and not short.exists()
    assert all(path.exists() for path in foreign)
    assert DiskTier(tmp_path).clear() == 3
    assert all(path.exists() for path in foreign)
    # QWEN's emptied folder is gone; SMOL's stays for the file that is not ours.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["other", SMOL.hex()])


def test_a_failed_write_is_counted_and_stores_nothing(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    (tmp_path / SMOL.hex()).write_bytes(b"")  # the namespace's folder cannot be made
    assert not disk.write((SMOL, 1), block(1))
    assert disk.counters.write_errors == 1
    assert disk.read((SMOL, 1)) is None


def test_clear_deletes_every_block(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    disk.write((SMOL, 1), block(1))
    disk.write((QWEN, 1), block(1))
    assert disk.clear() == 2
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_pauses_writes_until_room_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    disk = DiskTier(tmp_path, retry_s=30.0, clock=lambda: now[0])
    assert disk.write((SMOL, 1), block(1))

    def no_space(fd: int, data: bytes | memoryview) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "_write_all", no_space)
    assert not disk.write((SMOL, 2), block(2))
    assert disk.full and disk.counters.write_errors == 1
    assert list(disk.path_of((SMOL, 2)).parent.glob(".*.tmp")) == []  # no temporary left
    monkeypatch.undo()
    # Paused: not even tried, though the disk would take it now.
    assert not disk.write((SMOL, 3), block(3))
    assert disk.counters.writes_skipped == 1 and disk.read((SMOL, 3)) is None
    now[0] += 31
    assert disk.write((SMOL, 3), block(3)) and not disk.full
    monkeypatch.setattr(disk_tier, "_write_all", no_space)
    assert not disk.write((SMOL, 4), block(4)) and disk.full
    monkeypatch.undo()
    disk.delete((SMOL, 1))  # room made: writes are tried again at once
    assert not disk.full and disk.write((SMOL, 4), block(4))
    assert disk.read((SMOL, 4)) == block(4)
