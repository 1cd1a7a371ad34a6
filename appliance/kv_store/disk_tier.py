"""The disk tier's bytes: one file per KV block under a directory, surviving restarts.

A file is `<directory>/<namespace digest hex>/<block key hex>.kv`: a header (magic,
version, namespace digest, block key, payload length, BLAKE2b checksum of the payload)
and the block's bytes. Written to a temporary name and renamed, so a reader sees a whole
file or none; not fsynced (a block is a cache entry: one torn by a power cut fails its
checksum and is computed again). A file whose header or checksum does not match what was
asked for is refused: counted, deleted, and the caller recomputes. A failed write (a full
disk) is counted and the block is not stored; serving goes on. A full disk is logged once
when it is found and once when a write succeeds again (one warning per episode, not one per
block). Files and folders are the service user's only (they hold what prompts said).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from appliance.kv_store.namespace import DIGEST_BYTES
from appliance.kv_store.tier_index import StoreKey

_MAGIC = b"APKVDISK"
_VERSION = 1
_CHECKSUM_BYTES = 32
# magic, version, namespace digest, block key, payload length, payload checksum
_HEADER = struct.Struct(f"<8sI{DIGEST_BYTES}sQQ{_CHECKSUM_BYTES}s")
HEADER_BYTES = _HEADER.size  # a block file's bytes beside the block's own
_SUFFIX = ".kv"
_FULL = {errno.ENOSPC, errno.EDQUOT}  # the disk (or the user's quota) is full
_FOLDER = re.compile(f"[0-9a-f]{{{2 * DIGEST_BYTES}}}")  # a namespace digest
_BLOCK = re.compile(r"[0-9a-f]{16}\.kv")  # a block key
_TEMP = re.compile(r"\.[0-9a-f]{16}\.kv\.[0-9]+\.tmp")  # a write not yet renamed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """A block file found at start: its key, payload size and last write time."""

    key: StoreKey
    nbytes: int
    mtime_ns: int


@dataclass
class DiskCounters:
    refused: int = 0  # files whose header or checksum did not match: deleted, recomputed
    write_errors: int = 0  # writes that failed (a full disk): the block was not stored
    writes_skipped: int = 0  # writes not tried while the disk was last found full
    full_episodes: int = 0  # times the disk was found full after writes had worked


def _checksum(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_CHECKSUM_BYTES).digest()


class DiskTier:
    """Block files under `directory` (made, 0700, where missing). After a write finds
    the disk full, writes are not tried for `retry_s` seconds (or until a block is
    deleted here): the tier stops taking blocks, the requests go on. The episode is
    logged once when it starts and once when a write succeeds again."""

    def __init__(
        self,
        directory: Path,
        # A failed write on a full disk is cheap (an open and a short write): a few
        # seconds between tries lets the tier take blocks again soon after room is made.
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.counters = DiskCounters()
        self._retry_s = retry_s
        self._clock = clock
        self._full_until = float("-inf")
        self._lost_while_full = 0  # writes failed or skipped since the disk was found full
        self._in_episode = False  # the disk was found full and no write has worked since

    @property
    def full(self) -> bool:
        """Whether writes are paused after the disk was found full."""
        return self._clock() < self._full_until

    def path_of(self, key: StoreKey) -> Path:
        namespace, block = key
        return self.directory / namespace.hex() / f"{block:016x}{_SUFFIX}"

    def write(self, key: StoreKey, data: bytes | memoryview) -> bool:
        """Store a block's bytes atomically; False (counted) where the write failed or
        was not tried (the disk was found full a moment ago)."""
        if self.full:
            self.counters.writes_skipped += 1
            self._lost_while_full += 1
            return False
        payload = memoryview(data).cast("B")
        path = self.path_of(key)
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        header = _HEADER.pack(_MAGIC, _VERSION, key[0], key[1], len(payload), _checksum(payload))
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _write_all(fd, header)
                _write_all(fd, payload)
            finally:
                os.close(fd)
            os.replace(temp, path)
        except OSError as exc:
            # ENOSPC, EDQUOT, EIO: the tier takes no more, the request is served anyway.
            self.counters.write_errors += 1
            if exc.errno in _FULL:
                self._found_full(exc)
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            return False
        if self._in_episode:
            self._in_episode = False
            log.info(
                "KV store disk tier %s takes blocks again: room was made "
                "(%d blocks were not stored while it was full)",
                self.directory,
                self._lost_while_full,
            )
        return True

    def _found_full(self, exc: OSError) -> None:
        """A write found the disk full: writes pause; the first of an episode is logged."""
        self._full_until = self._clock() + self._retry_s
        self._lost_while_full += 1
        if self._in_episode:  # still full at a retry: said already
            return
        self._in_episode = True
        self._lost_while_full = 1
        self.counters.full_episodes += 1
        log.warning(
            "KV store disk tier %s is full (%s): blocks are not stored there until room "
            "is made (tried again every %.0f s); requests are served without it",
            self.directory,
            os.strerror(exc.errno or 0),
            self._retry_s,
        )

    def read(self, key: StoreKey) -> bytes | None:
        """The block's bytes, or None: no such file, or one refused (deleted, counted)."""
        path = self.path_of(key)
        try:
            raw = path.read_bytes()
        except OSError:  # gone (cleared, dropped), or its folder is not one
            return None
        if len(raw) < _HEADER.size:
            self._refuse(path)
            return None
        magic, version, namespace, block, nbytes, checksum = _HEADER.unpack_from(raw)
        payload = memoryview(raw)[_HEADER.size :]
        if (
            (magic, version) != (_MAGIC, _VERSION)
            or (namespace, block) != key
            or len(payload) != nbytes
            or _checksum(payload) != checksum
        ):
            self._refuse(path)
            return None
        return bytes(payload)

    def delete(self, key: StoreKey) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path_of(key).unlink()
            self._full_until = float("-inf")  # room was made: writing may work again

    def scan(self) -> list[Found]:
        """Every block file's header, oldest write first (the LRU order to rebuild the
        index in). Block files whose header does not parse or does not match their name
        are refused; leftover temporaries of a write cut short are deleted. Only the
        tier's own names are touched: a directory shared with other files loses none."""
        found = []
        for folder in self._folders():
            for path in sorted(folder.iterdir()):
                if _TEMP.fullmatch(path.name):
                    path.unlink(missing_ok=True)
                elif _BLOCK.fullmatch(path.name):
                    entry = self._header_of(path)
                    if entry is None:
                        self._refuse(path)
                    else:
                        found.append(entry)
        return sorted(found, key=lambda f: f.mtime_ns)

    def clear(self) -> int:
        """Delete every block file (and temporary, and the namespaces' folders left
        empty); returns how many blocks."""
        gone = 0
        for folder in self._folders():
            for path in folder.iterdir():
                if _BLOCK.fullmatch(path.name) or _TEMP.fullmatch(path.name):
                    path.unlink(missing_ok=True)
                    gone += path.suffix == _SUFFIX
            with contextlib.suppress(OSError):  # not empty: files not ours stay
                folder.rmdir()
        return gone

    def _folders(self) -> list[Path]:
        """The namespaces' folders (named by a digest), not whatever else is there."""
        return sorted(
            p for p in self.directory.iterdir() if p.is_dir() and _FOLDER.fullmatch(p.name)
        )

    def _header_of(self, path: Path) -> Found | None:
        try:
            with path.open("rb") as f:
                head = f.read(_HEADER.size)
                stat = os.fstat(f.fileno())
        except OSError:
            return None
        if len(head) < _HEADER.size or path.suffix != _SUFFIX:
            return None
        magic, version, namespace, block, nbytes, _ = _HEADER.unpack(head)
        key = (namespace, block)
        if (magic, version) != (_MAGIC, _VERSION) or self.path_of(key) != path:
            return None
        if stat.st_size != _HEADER.size + nbytes:  # truncated
            return None
        return Found(key, nbytes, stat.st_mtime_ns)

    def _refuse(self, path: Path) -> None:
        self.counters.refused += 1
        path.unlink(missing_ok=True)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
