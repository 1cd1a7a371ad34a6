"""Reading and writing safetensors files. Reading is the safetensors library's
(`safe_open`): tensors mapped from their pages, nothing read until used. Writing is ours,
a piece at a time (the GGUF cache's: model/gguf_cache.py), which the library cannot do."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from appliance.model.errors import ModelLoadError

_SAFETENSORS_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# What a weight may be stored as: float8 and the packed kinds come with scales that we
# would not apply, so a file holding them is refused rather than served wrong.
_READABLE = frozenset(_SAFETENSORS_NAMES.values())
_ITEMSIZES = {name: dtype.itemsize for dtype, name in _SAFETENSORS_NAMES.items()}


class MappedTensors(Mapping[str, torch.Tensor]):
    """Tensors of safetensors files, each read through its own `safe_open` handle: the
    tensor is a copy-on-write view of the file's pages (nothing read until used, so a
    tensor-parallel shard reads only the rows it slices; what is written into it never
    reaches the file), and the handle is closed before it is returned, so the tensor alone
    holds its mapping and its pages leave this process with it (the page cache keeps them
    for the next reader). A load that copies each tensor and drops it
    (CausalLM.load_weights) thus holds one tensor of the files at a time
    (tests/model/test_load_memory.py). Not one handle per file: it keeps every page it
    handed out resident until closed, the files' size again beside the weights (loading
    SmolLM2-135M as float32, 513 MiB of weights: a peak of 1059 MiB over the imports with
    one handle, 548 MiB with one per tensor, on an Intel Xeon, AMX, 2 cores; opening a
    handle costs about 0.1 ms)."""

    def __init__(self) -> None:
        self._files: dict[str, Path] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._files[name]
        with _open(path) as file:
            tensor: torch.Tensor = file.get_tensor(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def release(self, name: str) -> None:
        """The loading protocol's "copied" (CausalLM.load_weights): nothing to give back
        here, since a tensor's pages go with the tensor."""
        if name not in self._files:
            raise KeyError(name)

    def add_file(self, path: Path) -> None:
        """One file's tensors (a name it shares with an earlier file replaces it), their
        dtypes checked: ModelLoadError for a file safetensors refuses or one we cannot use."""
        with _open(path) as file:
            for name in file.keys():
                kind = file.get_slice(name).get_dtype()
                if kind not in _READABLE:
                    raise ModelLoadError(
                        path, f"cannot read safetensors (tensors of dtype {kind} are not supported)"
                    )
                self._files[name] = path


def read_safetensors(*paths: Path) -> MappedTensors:
    """The files' tensors, mapped (MappedTensors)."""
    tensors = MappedTensors()
    for path in paths:
        tensors.add_file(path)
    return tensors


def _open(path: Path) -> Any:
    """`safe_open` on `path` for torch on the CPU; ModelLoadError when the library refuses
    the file, in our words where the header says what is wrong (see _diagnosis)."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (OSError, SafetensorError) as exc:
        raise ModelLoadError(path, _diagnosis(path) or f"cannot read safetensors ({exc})") from None


def _diagnosis(path: Path) -> str | None:
    """What is wrong with a file safetensors refused, read from its header, where the
    library's own words would not tell a user ("incomplete metadata, file not fully
    covered"): a truncated file with both sizes, a tensor outside the file or not
    filling its bytes. None where the header says nothing more (a missing file, a
    missing field: the library names those)."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            (header_size,) = struct.unpack("<Q", file.read(8))
            if header_size > size - 8:
                return f"cannot read safetensors (header of {header_size} bytes is past the end)"
            header = json.loads(file.read(header_size))
    except (OSError, ValueError, struct.error):
        return None
    if not isinstance(header, dict):
        return "cannot read safetensors (the header is not a JSON object)"
    tensors = {n: info for n, info in header.items() if n != "__metadata__"}
    try:
        data_size = size - 8 - header_size
        return _truncation(size, 8 + header_size, tensors) or _misfit(data_size, tensors)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return None


def _truncation(size: int, base: int, tensors: dict[str, Any]) -> str | None:
    """Both sizes, when the file is shorter than its header says (an interrupted
    download or copy)."""
    needed = base + max((int(info["data_offsets"][1]) for info in tensors.values()), default=0)
    if needed <= size:
        return None
    return (
        f"the file is truncated: it has {size} bytes, its header needs {needed}, so tensors "
        "lie outside the file (an interrupted download or copy? fetch it again)"
    )


def _misfit(data_size: int, tensors: dict[str, Any]) -> str | None:
    """The first tensor whose bytes lie outside the data or do not match its shape."""
    for info in tensors.values():
        start, stop = (int(o) for o in info["data_offsets"])
        shape = [int(d) for d in info["shape"]]
        if min(shape, default=0) < 0 or not 0 <= start <= stop <= data_size:
            return f"cannot read safetensors (a tensor of shape {shape} lies outside the file)"
        itemsize = _ITEMSIZES.get(info["dtype"])
        if itemsize is not None and stop - start != math.prod(shape) * itemsize:
            size = stop - start
            return (
                f"cannot read safetensors (a tensor of shape {shape} does not fit its {size} bytes)"
            )
    return None


def write_safetensors(
    path: Path,
    layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    pieces: Iterable[tuple[str, torch.Tensor]],
) -> None:
    """A safetensors file written a piece at a time. Ours, not the library's: safetensors
    writes a file only from whole tensors in memory (`save_file`, and `serialize_file`,
    whose TensorSpecs point at every tensor's bytes for the whole call), which for a
    dequantized GGUF would be the whole model at once. `layout` gives each tensor's shape
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
