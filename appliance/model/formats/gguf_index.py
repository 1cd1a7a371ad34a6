"""A GGUF file's tensor index (names, types, dimensions, offsets), read from its header
alone, skipping over the metadata."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from appliance.model.errors import ModelLoadError


def require_file(path: Path) -> None:
    """ModelLoadError unless `path` is a file."""
    if not path.is_file():
        raise ModelLoadError(path, "no such file")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file's index: its GGML type, its dimensions fastest first, and
    where its data starts in the file."""

    name: str
    type_id: int
    dims: tuple[int, ...]
    offset: int


# Bytes of each GGUF metadata value type of fixed size (8: string, 9: array are not).
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def tensor_index(path: Path) -> list[TensorEntry]:
    """The file's tensors, read from its header alone. GGUFReader builds a numpy object
    for every string of the tokenizer's lists (a hundred thousand here), 20-40 MiB of
    Python heap that a worker then keeps; this skips over the metadata instead."""
    require_file(path)
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as raw:
            return _read_index(raw)
    except (struct.error, ValueError, KeyError) as exc:
        # ValueError: mapping an empty file; KeyError: a value type GGUF does not have
        raise ModelLoadError(path, f"not a valid GGUF file ({exc})") from None


def _read_index(raw: mmap.mmap) -> list[TensorEntry]:
    at = 0

    def take(fmt: str) -> tuple:
        nonlocal at
        values = struct.unpack_from("<" + fmt, raw, at)
        at += struct.calcsize("<" + fmt)
        return values

    def text() -> str:
        nonlocal at
        (length,) = take("Q")
        at += length
        return raw[at - length : at].decode("utf-8")

    def skip(kind: int) -> int | None:
        """Steps over a value; returns it when it is an unsigned 32-bit one."""
        nonlocal at
        if kind == 8:
            text()
        elif kind == 9:
            item, count = take("IQ")
            if item in _VALUE_SIZES:
                at += count * _VALUE_SIZES[item]
            else:
                for _ in range(count):
                    skip(item)
        elif kind == 4:
            return take("I")[0]
        else:
            at += _VALUE_SIZES[kind]
        return None

    magic, version = take("4sI")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"magic {magic!r}, version {version}: not GGUF version 2 or 3")
    tensors, fields = take("QQ")
    alignment = 32
    for _ in range(fields):
        key = text()
        value = skip(take("I")[0])
        if key == "general.alignment" and value:
            alignment = value
    infos = []
    for _ in range(tensors):
        name = text()
        (dims,) = take("I")
        shape = take("Q" * dims)
        type_id, offset = take("IQ")
        infos.append((name, type_id, shape, offset))
    start = -(-at // alignment) * alignment
    return [TensorEntry(n, t, tuple(d), start + o) for n, t, d, o in infos]
