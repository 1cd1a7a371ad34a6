"""The KV store's disk tier on a really full filesystem (issue 40): a small tmpfs, filled
to ENOSPC by a file beside the tier's. The tier warns once when it finds the disk full
(not once per block, nor at each retry), takes no blocks while it is full, and takes them
again once room is made, saying so once. Mounting needs root: without it the test is
skipped, with that reason (a shrunken capacity setting would be the tier's own LRU, not a
full disk)."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.kv_store.disk_tier import DiskTier

SMOL = bytes(range(16))  # a namespace digest
BLOCK_BYTES = 256 << 10  # a block of 256 KiB: the 2 MiB tmpfs holds a few
LOGGER = "appliance.kv_store.disk_tier"


def block(i: int) -> bytes:
    return bytes([i % 256]) * BLOCK_BYTES


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs at tmp_path/disk, unmounted after the test whatever it did."""
    if os.geteuid() != 0:
        pytest.skip("a real full disk needs a tmpfs mount, which needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)]
    subprocess.run(command, check=True, capture_output=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True, capture_output=True)


def fill(path: Path) -> None:
    """Write `path` until the filesystem says ENOSPC."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(64 << 10))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)


def test_a_full_disk_is_warned_once_and_the_tier_takes_blocks_again(
    tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    disk = DiskTier(tmpfs / "tier", retry_s=5.0, clock=lambda: now[0])
    assert disk.write((SMOL, 0), block(0))
    filler = tmpfs / "filler.bin"  # another program's file takes every byte left
    fill(filler)
    caplog.set_level(logging.INFO, logger=LOGGER)

    # Writes now fail; the tier pauses, then tries again every retry_s, and still fails.
    for i in range(1, 13):
        assert not disk.write((SMOL, i), block(i))
        now[0] += 1.0  # 12 s: two retries past the first failure
    assert disk.counters.full_episodes == 1
    assert disk.counters.write_errors == 3  # the first failure and the two retries
    assert disk.counters.writes_skipped == 9
    assert not list((tmpfs / "tier").rglob("*.tmp"))  # a failed write leaves no temporary
    warnings = [r for r in caplog.records if "is full" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "No space left on device" in warnings[0].getMessage()
    assert disk.read((SMOL, 0)) == block(0)  # what it held is still served

    # Room is made: at the next retry the tier takes blocks again, and says so once.
    filler.unlink()
    now[0] += 5.0
    assert disk.write((SMOL, 20), block(20)) and disk.write((SMOL, 21), block(21))
    assert disk.read((SMOL, 20)) == block(20)
    again = [r for r in caplog.records if "takes blocks again" in r.getMessage()]
    assert len(again) == 1 and "12 blocks were not stored" in again[0].getMessage()

    # A second episode is a second warning (once again).
    fill(filler)
    for i in range(30, 35):
        assert not disk.write((SMOL, i), block(i))
    assert disk.counters.full_episodes == 2
    assert len([r for r in caplog.records if "is full" in r.getMessage()]) == 2
