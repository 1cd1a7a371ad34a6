"""The chaos soak's full disk (benchmarks/chaos_soak.py): the KV store's disk tier on a
filesystem of its own, a small tmpfs the soak mounts, fills to ENOSPC and frees.

Filling is not enough on its own: the tier keeps its blocks within its capacity by
deleting its oldest before it writes, and a delete frees the room of the write that
follows it. So while the disk is full every block file the tier has is held by a second
name (a hard link in a folder of the soak's): the tier's deletes then free nothing, as on
a disk another program has filled, and each write meets ENOSPC.

Mounting needs root. Without it the disk tier still runs (in a plain folder), but the
fault is not available: each draw of it is logged as not applied, with the reason, never
faked by shrinking the tier's own capacity (that is the tier's LRU, not a full disk).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
from pathlib import Path

FILL_CHUNK = 1 << 20  # bytes per write of the filler file
FULL_WARNING = re.compile(r"KV store disk tier .* is full")  # disk_tier.py's, once an episode
TAKES_AGAIN = re.compile(r"KV store disk tier .* takes blocks again")


class FullDisk:
    """A tmpfs of `size_mb` at `path` (mounted by `mount`, unmounted by `unmount`), and a
    filler file on it that takes every byte left."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path, self.size_mb = path, size_mb
        # Neither is a name the disk tier reads (it reads only folders named by a digest).
        self.filler = path / "filler.bin"
        self.held = path / "held"  # second names of the tier's block files while full
        self._held_inodes: set[int] = set()
        self.mounted = False
        self.why_not = ""  # why the fault is not available, once mount found it is not

    def mount(self) -> bool:
        """Mount the tmpfs (root only); False with `why_not` set where it cannot be."""
        self.path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            self.why_not = "not available without root: a full disk needs a tmpfs mount"
            return False
        size = f"size={self.size_mb}m,mode=0700"
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(self.path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            self.why_not = f"not available: mount -t tmpfs failed: {done.stderr.strip()}"
            return False
        self.mounted = True
        return True

    def fill(self) -> int:
        """Hold the tier's block files, write the filler until the filesystem says ENOSPC,
        and hold the files written meanwhile; the bytes the filler took."""
        self.held.mkdir(exist_ok=True)
        self._hold_files()
        written = self._fill_up()
        self._hold_files()
        return written

    def top_up(self) -> int:
        """Keep it full: hold new block files, and fill whatever room came free."""
        self._hold_files()
        return self._fill_up()

    def _hold_files(self) -> None:
        """A second name for each of the tier's block files not held yet (a link takes no
        room, so this works on a full disk)."""
        for path in self.path.glob("*/*.kv"):
            with contextlib.suppress(FileNotFoundError, FileExistsError):
                inode = path.stat().st_ino
                if inode not in self._held_inodes:
                    os.link(path, self.held / f"{inode}.kv")
                    self._held_inodes.add(inode)

    def _fill_up(self) -> int:
        written = 0
        chunk = bytes(FILL_CHUNK)
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                try:
                    written += os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    return written
        finally:
            os.close(fd)

    def free(self) -> None:
        """Delete the filler and the second names: the room they took is the tier's again."""
        self.filler.unlink(missing_ok=True)
        shutil.rmtree(self.held, ignore_errors=True)
        self._held_inodes.clear()

    def unmount(self) -> None:
        """Free the filler and unmount (lazily if a process still holds a file there)."""
        if not self.mounted:
            return
        with contextlib.suppress(OSError):
            self.free()
        done = subprocess.run(["umount", str(self.path)], capture_output=True, check=False)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
        self.mounted = False


def count_lines(log: Path, pattern: re.Pattern[str], after: int = 0) -> int:
    """Lines of `log` past byte `after` that match `pattern`."""
    with log.open("rb") as f:
        f.seek(after)
        text = f.read().decode(errors="replace")
    return sum(bool(pattern.search(line)) for line in text.splitlines())
