"""Reading and writing safetensors files: tensors mapped from their pages (nothing read
until used), and files written a piece at a time (the GGUF cache's: model/gguf_cache.py)."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from appliance.model.errors import ModelLoadError

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


class MappedTensors(Mapping[str, torch.Tensor]):
    """Tensors of safetensors files as views of their pages, mapped copy-on-write: nothing
    is read until used, so a tensor-parallel shard reads only the rows it slices (the
    model copies them: see CausalLM.load_weights). release(name) drops a tensor's pages
    from this process once it is copied (the page cache keeps them for the next reader),
    so a load holds one tensor of the files at a time; the view then reads the file
    again, and loses what was written into it."""

    def __init__(self) -> None:
        self._views: dict[str, torch.Tensor] = {}
        self._spans: dict[str, tuple[mmap.mmap, int, int]] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def release(self, name: str) -> None:
        """Give back the pages that lie wholly inside the tensor's bytes."""
        pages, start, stop = self._spans[name]
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        last = stop // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            pages.madvise(mmap.MADV_DONTNEED, first, last - first)

    def add_file(self, path: Path) -> None:
        """Map one file's tensors in (a name it shares with an earlier file replaces it)."""
        try:
            with open(path, "rb") as file:
                (header_size,) = struct.unpack("<Q", file.read(8))
                if header_size > os.fstat(file.fileno()).st_size - 8:
                    raise ValueError(f"header of {header_size} bytes is past the end of the file")
                header = json.loads(file.read(header_size))
                pages = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            base = 8 + header_size
            _check_size(path, len(pages), base, header)
            for name, info in header.items():
                if name != "__metadata__":
                    self._views[name] = _view(pages, base, info)
                    start, stop = info["data_offsets"]
                    self._spans[name] = (pages, base + start, base + stop)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
            raise ModelLoadError(path, f"cannot read safetensors ({exc})") from None


def _check_size(path: Path, size: int, base: int, header: dict[str, Any]) -> None:
    """ModelLoadError naming both sizes when the file is shorter than its header says (an
    interrupted download or copy); a malformed header is left to the reading."""
    try:
        stops = [int(info["data_offsets"][1]) for n, info in header.items() if n != "__metadata__"]
    except (KeyError, TypeError, ValueError, IndexError):
        return
    needed = base + max(stops, default=0)
    if needed > size:
        raise ModelLoadError(
            path,
            f"the file is truncated: it has {size} bytes, its header needs {needed}, so tensors "
            "lie outside the file (an interrupted download or copy? fetch it again)",
        )


def read_safetensors(*paths: Path) -> MappedTensors:
    """The files' tensors, mapped (MappedTensors)."""
    tensors = MappedTensors()
    for path in paths:
        tensors.add_file(path)
    return tensors


def _view(pages: mmap.mmap, base: int, info: dict[str, Any]) -> torch.Tensor:
    """One tensor of the file as a view of its mapped bytes."""
    dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
        raise ValueError(f"tensors of dtype {info['dtype']} are not supported")
    start, stop = info["data_offsets"]
    shape = [int(d) for d in info["shape"]]
    count = math.prod(shape)
    if min(shape, default=0) < 0 or not 0 <= start <= stop <= len(pages) - base:
        raise ValueError(f"a tensor of shape {shape} lies outside the file")
    if stop - start != count * dtype.itemsize:
        raise ValueError(f"a tensor of shape {shape} does not fit its {stop - start} bytes")
    if count == 0:  # frombuffer refuses an empty view
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(pages, dtype=dtype, count=count, offset=base + start)
    return flat.view(shape)


def write_safetensors(
    path: Path,
    layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    pieces: Iterable[tuple[str, torch.Tensor]],
) -> None:
    """A safetensors file written a piece at a time (ours: the safetensors library writes
    a file only from whole tensors held in memory, which for a dequantized GGUF would be
    the whole model at once): `layout` gives each tensor's shape
    and dtype, in file order, and `pieces` their values in that order, as (name,
    row-major piece), each cast to its tensor's dtype as it is written. Written beside
    `path`, then renamed: a crash never leaves half a file."""
    header, size = {}, 0
    for name, (shape, dtype) in layout.items():
        stop = size + math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [size, stop]}  # fmt: skip
        size = stop
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("wb") as file:
            file.write(struct.pack("<Q", len(text)) + text)
            _write_pieces(file, header, layout, pieces)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _write_pieces(
    file: BinaryIO,
    header: dict[str, dict[str, Any]],
    layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    pieces: Iterable[tuple[str, torch.Tensor]],
) -> None:
    """Write the pieces after the header, checking that they fill each tensor in order."""
    base = file.tell()
    current: str | None = None

    def finish(name: str | None) -> None:
        if name is not None:
            start, stop = header[name]["data_offsets"]
            if file.tell() != base + stop:
                raise ValueError(f"the pieces of {name} do not fill its {stop - start} bytes")

    for name, piece in pieces:
        if name != current:
            finish(current)
            current = name
            if file.tell() != base + header[name]["data_offsets"][0]:
                raise ValueError(f"the pieces of {name} come out of the layout's order")
        file.write(piece.to(layout[name][1]).reshape(-1).view(torch.uint8).numpy().data)
    finish(current)
    end = max((h["data_offsets"][1] for h in header.values()), default=0)
    if file.tell() != base + end:
        raise ValueError("the pieces do not fill the file")
